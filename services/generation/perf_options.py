"""The generation server's speed options: flags, what they pass to the engine, their metrics.

fp8 (`--quantization`), LoRA adapters merged at load (`--lora PATH[:STRENGTH]`), step-caching
defaults for requests that do not set `cache` (`--cache-*`), the warm-up run before /health
turns 200 (`--default-size`, `--warmup-sizes`, `--warmup-steps`), and CUDA graphs of the denoise
step (`--cuda-graphs`, env U1SERVE_CUDA_GRAPHS=0|1 overrides; step_graph.py).
"""
from __future__ import annotations

import argparse

from prometheus_client import Counter, Gauge

from services.model.quant import QUANTIZATIONS
from services.model.step_cache import CACHE_MODES, CacheOptions

from .step_graph import ENV as CUDA_GRAPHS_ENV
from .step_graph import MODES as CUDA_GRAPH_MODES
from .step_graph import resolve_mode


def add_perf_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="fp8: gen-branch Linear layers in fp8 e4m3 (needs compute capability >= 8.9 "
                        "on CUDA; emulated on CPU)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="merge a LoRA into the gen branch at load (repeatable); adapters that name "
                        "no gen-branch weight are skipped")
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
    p.add_argument("--default-size", default=None,
                   help="the gateway's default image size, warmed up before /health turns 200 "
                        "(default: 2048x2048 on cuda, none on cpu)")
    p.add_argument("--warmup-sizes", default="", help="more sizes to warm up, e.g. 1024x1024,1536x2720")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="denoising steps per warm-up size (0: no warm-up)")
    p.add_argument("--cuda-graphs", default="off", choices=list(CUDA_GRAPH_MODES),
                   help="replay each job's denoise layer stack from a CUDA graph (captured on its second "
                        "step) where the step allows it: CUDA, no step cache, no --yield-to (--sp too). "
                        f"auto/on: where it allows it (eager on cpu); {CUDA_GRAPHS_ENV}=0|1 overrides")


def perf_engine_args(args: argparse.Namespace) -> dict:
    from services.model.lora_spec import parse_lora_spec
    return {"quantization": args.quantization, "lora": [parse_lora_spec(x) for x in args.lora],
            "default_size": args.default_size or ("2048x2048" if args.device == "cuda" else ""),
            "warmup_sizes": args.warmup_sizes,
            "warmup_steps": args.warmup_steps, "cuda_graphs": cuda_graphs_mode(args)}


def cuda_graphs_mode(args: argparse.Namespace) -> str:
    try:
        return resolve_mode(args.cuda_graphs)
    except ValueError as e:
        raise SystemExit(f"--cuda-graphs: {e}")


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
        self.warmup: dict | None = None
        self.graph_replays = Counter("u1_gen_graph_replays", "steps whose layer stack ran from a CUDA graph "
                                     "(rank 0)", registry=registry)
        self.graph_captures = Counter("u1_gen_graph_captures", "CUDA graphs captured: one per job "
                                      "composition that ran two steps (rank 0)", registry=registry)

    def on_stats(self, msg: dict) -> None:
        kind = msg.get("stat")
        if kind == "branch_steps":
            for branch, c in (msg.get("branch_steps") or {}).items():
                self.computed.labels(branch=branch).inc(c["computed"])
                self.reused.labels(branch=branch).inc(c["reused"])
        elif kind == "step":
            graph = msg.get("graph")
            if graph == "replay":
                self.graph_replays.inc()
            elif graph == "capture":
                self.graph_captures.inc()
        elif kind == "warmup":
            self.warmup = {k: msg[k] for k in ("sizes", "steps", "seconds")}
            self.warmup_seconds.set(msg["seconds"])
