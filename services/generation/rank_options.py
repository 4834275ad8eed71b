"""The generation engine's rank options (fields of config.GenerationConfig): how many ranks one image uses, how
they share their GPUs.

`--sp N` (sequence parallelism, sequence_parallel.py): the engine runs `--cfg-parallel` x `--sp`
ranks, one GPU each (rank r on visible device r). `--sp-mode ulysses` (default): sp must divide the
model's attention and KV head counts, checked from config.json before anything loads; `--sp-mode
kv-gather`: any sp (every rank holds every KV head); with --sp 1 the mode changes nothing.
`--yield-to NAME --yield-share F` (colocate QoS, qos.py): every rank wraps its layers in a YieldGate on
the shm page NAME that the understanding engine on the same GPUs raises while it decodes (its
`--yield-signal NAME`), yielding at most F of wall time. `u1serve up --qos-yield-share F` sets both.
"""
from __future__ import annotations

from .qos import YieldGate, YieldPolicy
from .sequence_parallel import check_heads


def check_rank_flags(args) -> None:
    """A SystemExit naming the flag for a value the engine cannot run (before any weights load); `args`: the
    parsed flags or a GenerationConfig."""
    if args.sp < 1:
        raise SystemExit("--sp must be >= 1")
    if args.engine_unit == "thread" and args.cfg_parallel * args.sp != 1:
        raise SystemExit("--engine-unit thread runs one engine rank: it needs --cfg-parallel 1 and --sp 1")
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
    if not 0 <= args.green_sm_percent < 100:
        raise SystemExit(f"--green-sm-percent must be in [0, 100), got {args.green_sm_percent}")
    if args.green_sm_percent and args.engine_unit != "thread":
        raise SystemExit("--green-sm-percent is for the fused mode (--engine-unit thread): a process of its own "
                         "shares the GPU through MPS's --gen-sm-percent instead")
    if args.yield_max_wait_ms <= 0:
        raise SystemExit(f"--yield-max-wait-ms must be > 0, got {args.yield_max_wait_ms}")
    if not 0 < args.yield_share <= 1:
        raise SystemExit(f"--yield-share must be in (0, 1], got {args.yield_share}")
    if args.yield_to:
        from services.kit.yield_signal import page_path
        try:
            page_path(args.yield_to)
        except ValueError as e:
            raise SystemExit(f"--yield-to: {e}") from None


def yield_gate(cfg, device) -> YieldGate | None:
    """The rank's gate (None without --yield-to)."""
    if not cfg.yield_to:
        return None
    return YieldGate(cfg.yield_to, device, YieldPolicy(share=float(cfg.yield_share),
                                                       max_wait_s=float(cfg.yield_max_wait_ms) / 1e3))
