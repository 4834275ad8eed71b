"""`u1serve rl-train`: train a copy of the model against a serving stack, one JSON line per iteration.

Without `--base` it starts a stack itself (the launcher's `build_stack`, on the CPU for the tiny checkpoint) and
stops it at the end; with `--base URL` it attaches to a running stack (local or remote). Before the first
iteration the copy's weights are pushed into the stack (a fresh weights version), so the copy and the stack
start equal whatever the stack served before (the first rollout's ratios are then exactly 1).

Defaults: on the tiny checkpoint (`--model tiny`, the default) the sampling defaults are a CPU-sized problem on
which every algorithm's reward visibly rises within a dozen iterations (TINY_DEFAULTS; why t_eps 0.5: docs/rl.md);
on a real checkpoint they are Flow-GRPO's (TrainConfig).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from typing import Optional

from services.base.netutil import free_port

from .flags import config_from_args

def _push_mode(mode: str, base: str) -> str:
    if mode != "auto":
        return mode
    from urllib.parse import urlparse
    host = urlparse(base).hostname or ""
    return "path" if host in ("localhost", "::1") or host.startswith("127.") else "upload"


def train(cfg, base: str, model_dir: str, iterations: int, api_key: Optional[str] = None, push: str = "auto",
          out=sys.stdout, admin_key: Optional[str] = None) -> list[dict]:
    """Attach to the stack at `base`, sync it to the copy, run `iterations` iterations; returns the records."""
    from .client import RLClient
    from .trainer import make_trainer
    records = []
    with RLClient(base, api_key, admin_key=admin_key) as client:
        trainer = make_trainer(cfg, model_dir, client, _push_mode(push, base))
        start = trainer.push_weights(everything=True)
        out.write(json.dumps({"event": "start", "algo": cfg.algo, "weights_version": start["weights_version"],
                              "config": {k: v for k, v in vars(cfg).items() if k != "prompts"}}) + "\n")
        out.flush()
        from services.launch.progress import bar
        with bar(total=iterations, desc=f"[u1serve] rl-train {cfg.algo}", unit="iteration") as line:
            for _ in range(iterations):
                rec = trainer.step()
                records.append(rec)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                line.set_postfix(reward=f"{rec['reward_mean']:.4f}")
                line.update()
    return records


def local_stack(model: str, api_key: Optional[str], echo_logs: bool = False, admin_key_file: Optional[str] = None):
    """A stack on this machine (CPU for the tiny checkpoint), started, with the RL routes on and the engines
    allowed to read the trainer's pushes (the temp directory); the caller stops it."""
    from services.launch.stack import add_stack_flags, build_stack
    ns = argparse.ArgumentParser()
    add_stack_flags(ns, model_default="tiny")
    argv = ["--model", model, "--host", "127.0.0.1", "--port", str(free_port()), "--und-port", str(free_port()),
            "--gen-port", str(free_port()), "--grace", "5", "--enable-rl",
            "--weights-allowed-dirs", tempfile.gettempdir()]
    if model == "tiny":
        argv += ["--device", "cpu"]
    if api_key:
        argv += ["--api-key", api_key]
    if admin_key_file:
        argv += ["--admin-api-key-file", admin_key_file]
    stack_args = ns.parse_args(argv)
    stack = build_stack(stack_args, out=sys.stderr, echo_logs=echo_logs)
    stack.start()
    return stack, f"http://127.0.0.1:{stack_args.port}"


def main(args: argparse.Namespace) -> int:
    from services.base import knobs
    from services.launch.stack import ensure_tiny_checkpoint
    cfg = config_from_args(args)
    api_key = args.api_key or knobs.API_KEY.get()
    admin_key = args.admin_api_key or knobs.ADMIN_API_KEY.get()
    model_dir = ensure_tiny_checkpoint("u1", out=sys.stderr) if args.model == "tiny" else args.model
    if args.base:
        train(cfg, args.base, model_dir, args.iterations, api_key, args.push, admin_key=admin_key)
        return 0
    with tempfile.TemporaryDirectory() as keys:
        admin_file = None
        if api_key:               # a keyed local stack: the trainer is its operator too
            admin_key = admin_key or secrets.token_hex(16)
            admin_file = os.path.join(keys, "admin-keys")
            with open(os.open(admin_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(admin_key + "\n")
        stack, base = local_stack(args.model, api_key, admin_key_file=admin_file)
        try:
            train(cfg, base, model_dir, args.iterations, api_key, args.push, admin_key=admin_key)
        finally:
            stack.stop()
    return 0
