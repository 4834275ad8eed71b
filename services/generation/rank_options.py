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
    """A SystemExit naming the flag for a value the engine cannot run here (before any weights load): the checks
    that need the checkpoint or the host (the config checks its values itself)."""
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
    if args.yield_to:
        from shm_transfer.yield_signal import page_path
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
