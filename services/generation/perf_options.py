"""The generation server's speed options on the HTTP side: the step-caching defaults for requests that do not set
`cache` (`--cache-*`), and the metrics of the engine's speed options (step caching, warm-up, CUDA graphs). The
engine-side options (fp8, LoRA, warm-up sizes, CUDA graphs) are fields of config.GenerationConfig.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import Counter, Gauge

from services.contract.image import CacheOptions
from services.kit import flags
from services.kit.flags import flag
from services.model.step_cache import CACHE_MODES

from .protocol import BranchSteps, KvPoolStats, StepStats, WarmupStats


@dataclass(frozen=True)
class CacheDefaults:
    """The step-caching defaults (HTTP side: they fill `cache` of requests that do not set it), as flags; checked
    as the request's `cache` object is (CacheOptions)."""
    cache_mode: str = field(default="off", metadata=flag(
        "step caching for requests without a 'cache' object", choices=CACHE_MODES))
    cache_threshold: float = field(default=0.0, metadata=flag(
        "first_block: relative change below which a branch reuses its residual; teacache: the accumulated rescaled "
        "input change below which it does"))
    cache_warmup_steps: int = field(default=1, metadata=flag("steps always computed first"))
    cache_max_consecutive: int = field(default=0, metadata=flag(
        "reused steps in a row before one is computed (0: no limit)"))
    cfg_truncation: Optional[float] = field(default=None, metadata=flag(
        "CFG only while t <= this (t = 1 is the clean image); unset: off"))

    def __post_init__(self) -> None:
        self.options()

    def options(self) -> CacheOptions:
        return CacheOptions(mode=self.cache_mode, threshold=self.cache_threshold, warmup_steps=self.cache_warmup_steps,
                            max_consecutive=self.cache_max_consecutive, cfg_truncation=self.cfg_truncation)


def add_perf_flags(p: argparse.ArgumentParser) -> None:
    flags.add_flags(p, CacheDefaults)


def cache_defaults(args: argparse.Namespace) -> CacheOptions:
    try:
        return flags.from_args(CacheDefaults, args).options()
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
