"""`u1serve up`'s multi-LoRA flags (vLLM's names) and the environment they become for every service of the stack:
the engines read it when they build their adapter registry (services/model/lora_registry.attach_lora), the
gateway its list of adapter names (services/gateway/routers/lora.py). Light: no torch."""
from __future__ import annotations

import argparse
import os

from services.base import knobs
from services.launch import hub

MODULES_ENV, MAX_LORAS_ENV, MAX_RANK_ENV = knobs.LORA_MODULES.name, knobs.MAX_LORAS.name, knobs.MAX_LORA_RANK.name


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH[:STRENGTH]",
                   help="LoRA adapters served unmerged, each picked by requests whose `model` is NAME (PEFT directory "
                        "or official .safetensors, or a hub id <org>/<name>[@<revision>]; docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="resident adapter slots per engine (default: 4 with --lora-modules, else 0 = off; "
                        "> 0 enables POST /v1/load_lora_adapter)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank the slots hold")


def _modules(args: argparse.Namespace) -> list[tuple[str, "hub.Resolved", str]]:
    """(NAME, where its adapter is, STRENGTH or "") of each --lora-modules item; a hub id is fetched (hub.py)."""
    out = []
    for item in getattr(args, "lora_modules", None) or []:
        name, sep, spec = item.partition("=")
        path, _, strength = spec.rpartition(":") if ":" in spec else (spec, "", "")
        if not path or not _is_number(strength):
            path, strength = spec, ""
        if not sep or not name or "," in item:
            raise SystemExit(f"--lora-modules {item!r}: expected NAME=PATH[:STRENGTH] (no commas)")
        if not os.path.exists(path) and hub.parse_hub_id(path) is None:
            raise SystemExit(f"--lora-modules {item!r}: no such file or directory (nor a hub id <org>/<name>)")
        out.append((name, hub.resolve(path, f"--lora-modules {name}="), strength))
    return out


def lora_env(args: argparse.Namespace) -> dict[str, str]:
    """The services' environment for these flags (absolute paths; a missing adapter is an error here)."""
    mods = [f"{name}={where.path}" + (f":{strength}" if strength else "") for name, where, strength in _modules(args)]
    max_loras = getattr(args, "max_loras", None)
    if max_loras is not None and max_loras < len(mods):
        raise SystemExit(f"--max-loras {max_loras} is fewer than the {len(mods)} --lora-modules")
    if not mods and not max_loras:
        return {}
    env = {MODULES_ENV: ",".join(mods), MAX_RANK_ENV: str(args.max_lora_rank)}
    if max_loras is not None:
        env[MAX_LORAS_ENV] = str(max_loras)
    return env


def lora_sources(args: argparse.Namespace) -> dict[str, dict]:
    """NAME -> where each adapter came from (stack.json): its path, and a hub id's revision."""
    return {name: where.record() for name, where, _ in _modules(args)}


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
