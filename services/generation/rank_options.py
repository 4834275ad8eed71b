"""The generation server's rank options: how many ranks one image uses, how they share their GPUs.

`--sp N` (sequence parallelism, sequence_parallel.py): the engine runs `--cfg-parallel` x `--sp`
ranks, one GPU each (rank r on visible device r). `--sp-mode ulysses` (default): sp must divide the
model's attention and KV head counts, checked from config.json before anything loads; `--sp-mode
kv-gather`: any sp (every rank holds every KV head); with --sp 1 the mode changes nothing.
`--yield-to NAME --yield-share F` (colocate QoS, qos.py): every rank wraps its layers in a YieldGate on
the shm page NAME that the understanding engine on the same GPUs raises while it decodes (its
`--yield-signal NAME`), yielding at most F of wall time. `u1serve up --qos-yield-share F` sets both.
"""
from __future__ import annotations

import argparse

from .qos import YieldGate, YieldPolicy
from .sequence_parallel import MODES, check_heads


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sp", type=int, default=1,
                   help="sequence-parallel ranks per CFG rank: one image's tokens over N GPUs "
                        "(engine ranks = --cfg-parallel x --sp; with --sp-mode ulysses N must divide the "
                        "head counts)")
    p.add_argument("--sp-mode", choices=MODES, default="ulysses",
                   help="how the --sp ranks attend: ulysses (two all-to-alls a layer, each rank a slice of "
                        "the heads) or kv-gather (one all-gather of K/V a layer, each rank every KV head and "
                        "its own query rows); no effect with --sp 1")
    p.add_argument("--yield-to", default="", metavar="NAME",
                   help="colocate QoS: the shm page the understanding engine on these GPUs raises while "
                        "it decodes (its --yield-signal); the ranks yield the GPU between layers")
    p.add_argument("--yield-share", type=float, default=YieldPolicy.share,
                   help="with --yield-to: at most this fraction of wall time spent yielding (0 < F <= 1)")


def check_rank_flags(args: argparse.Namespace) -> None:
    """A SystemExit naming the flag for a value the engine cannot run (before any weights load)."""
    if args.sp < 1:
        raise SystemExit("--sp must be >= 1")
    if args.sp > 1:
        from services.model.config import ConfigError, load_config
        try:
            llm = load_config(args.model).llm
        except (ConfigError, OSError):
            llm = None               # the engine reports a broken checkpoint itself
        if llm is not None:
            try:
                check_heads(llm.num_attention_heads, llm.num_key_value_heads, args.sp, args.sp_mode)
            except ValueError as e:
                raise SystemExit(f"--sp {args.sp}: {e}") from None
    if not 0 < args.yield_share <= 1:
        raise SystemExit(f"--yield-share must be in (0, 1], got {args.yield_share}")
    if args.yield_to:
        from services.kit.yield_signal import page_path
        try:
            page_path(args.yield_to)
        except ValueError as e:
            raise SystemExit(f"--yield-to: {e}") from None


def engine_world(args: argparse.Namespace) -> int:
    return args.cfg_parallel * args.sp


def rank_engine_args(args: argparse.Namespace) -> dict:
    return {"sp": args.sp, "sp_mode": args.sp_mode, "yield_to": args.yield_to, "yield_share": args.yield_share}


def yield_gate(engine_args: dict, device) -> YieldGate | None:
    """The rank's gate (None without --yield-to)."""
    name = engine_args.get("yield_to")
    if not name:
        return None
    return YieldGate(name, device, YieldPolicy(share=float(engine_args.get("yield_share", YieldPolicy.share))))
