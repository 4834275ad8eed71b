"""The generation server's speed options on the HTTP side: the step-caching defaults for requests that do not set
`cache` (`--cache-*`), and the metrics of the engine's speed options (step caching, warm-up, CUDA graphs). The
engine-side options (fp8, LoRA, warm-up sizes, CUDA graphs) are fields of config.GenerationConfig.
"""
from __future__ import annotations

import argparse

from prometheus_client import Counter, Gauge

from services.contract.image import CacheOptions
from services.model.step_cache import CACHE_MODES

from .protocol import BranchSteps, KvPoolStats, StepStats, WarmupStats


def add_perf_flags(p: argparse.ArgumentParser) -> None:
    """The step-caching defaults (HTTP side: they fill `cache` of requests that do not set it)."""
    p.add_argument("--cache-mode", default="off", choices=list(CACHE_MODES),
                   help="step caching for requests without a 'cache' object")
    p.add_argument("--cache-threshold", type=float, default=0.0,
                   help="first_block: relative change below which a branch reuses its residual; "
                        "teacache: the accumulated rescaled input change below which it does")
    p.add_argument("--cache-warmup-steps", type=int, default=1, help="steps always computed first")
    p.add_argument("--cache-max-consecutive", type=int, default=0,
                   help="reused steps in a row before one is computed (0: no limit)")
    p.add_argument("--cfg-truncation", type=float, default=None,
                   help="CFG only while t <= this (t = 1 is the clean image); default: off")


def cache_defaults(args: argparse.Namespace) -> CacheOptions:
    try:
        return CacheOptions(mode=args.cache_mode, threshold=args.cache_threshold,
                            warmup_steps=args.cache_warmup_steps,
                            max_consecutive=args.cache_max_consecutive, cfg_truncation=args.cfg_truncation)
    except ValueError as e:
        raise SystemExit(f"step-caching defaults (--cache-*, --cfg-truncation): {e}")


class EnginePerfMetrics:
    """Per-branch computed / reused steps (step caching), the warm-up and CUDA graph use, on the server's
    registry."""

    def __init__(self, registry) -> None:
        self.computed = Counter("u1_gen_branch_steps_computed", "steps a CFG branch ran the whole "
                                "layer stack for", ["branch"], registry=registry)
        self.reused = Counter("u1_gen_branch_steps_reused", "steps a CFG branch reused its cached "
                              "residual (step caching) instead of layers 1..", ["branch"], registry=registry)
        self.warmup_seconds = Gauge("u1_gen_warmup_seconds", "warm-up run before the engine reported "
                                    "ready", registry=registry)
        self.warmup_size_seconds = Gauge("u1_gen_warmup_size_seconds", "warm-up of one size (the size table's "
                                         "and the configured ones) before the engine reported ready", ["size"],
                                         registry=registry)
        self.warmup: dict | None = None
        self.kv_pool: dict | None = None      # rank 0's shm pool: attached before ready or not (kv_source.py)
        self.graph_replays = Counter("u1_gen_graph_replays", "steps whose layer stack ran from a CUDA graph "
                                     "(rank 0)", registry=registry)
        self.graph_captures = Counter("u1_gen_graph_captures", "CUDA graphs captured: one per layer segment "
                                      "of a job composition that ran two steps (rank 0)", registry=registry)

    def on_stats(self, msg) -> None:
        if isinstance(msg, BranchSteps):
            for branch, c in msg.branch_steps.items():
                self.computed.labels(branch=branch).inc(c["computed"])
                self.reused.labels(branch=branch).inc(c["reused"])
        elif isinstance(msg, StepStats):
            if msg.graph == "replay":
                self.graph_replays.inc()
            elif msg.graph == "capture":
                self.graph_captures.inc()
        elif isinstance(msg, KvPoolStats):
            self.kv_pool = msg.report
        elif isinstance(msg, WarmupStats):
            self.warmup = {"sizes": msg.sizes, "steps": msg.steps, "seconds": msg.seconds, "per_size": msg.per_size}
            self.warmup_seconds.set(msg.seconds)
            for size, seconds in msg.per_size.items():
                self.warmup_size_seconds.labels(size=size).set(seconds)
