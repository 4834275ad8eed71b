"""The load peak of `--quantization int8|fp8` from a FLOAT checkpoint (issue 42), next to `u1serve plan`'s figure.

Per branch: writes a random bf16 checkpoint of that branch alone at the 8B geometry (the loader reads only the
branch it loads), then loads it with the serving loader (services/model/loader.py: each decoder layer quantised as
it is read) with torch's allocator capped at that engine's share of the plan's colocated budget (--budget-gib,
default 24: the share `u1serve plan` gives it, less its CUDA context), and reports torch.cuda.max_memory_allocated
next to the plan's load peak (the quantised weights + one layer's float weights). For comparison it also loads the
branch in bf16 and quantises it after (the order before layer-by-layer loading), uncapped.

    python -m bench.bench_load_peak --json out.json                          # GPU (bench/gpu_memcap.sh loadpeak)
    python -m bench.bench_load_peak --tiny --json out.json                   # CPU smoke: tiny geometry, no cap
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from bench.stack import write_json
from services.launch.cli import plan_image_limits
from services.model import memory_plan as M
from services.model.config import parse_config
from services.model.loader import load_model
from services.model.moe import checkpoint_views
from services.model.quant import quantize_model
from services.model.quant_schemes import scheme
from services.model.tiny import build_random_model, full_config, tiny_config, write_checkpoint

ENGINES = {"und": "understanding", "gen": "generation"}


def write_branch(out_dir: str, config: dict, branch: str, dtype, device) -> str:
    """A random float checkpoint holding `branch`'s weights only (built on `device`, written from the host)."""
    model = build_random_model(config, branch, dtype, device)
    state = {k: v.detach().to("cpu").contiguous() for k, v in checkpoint_views(model.named_parameters())}
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return write_checkpoint(out_dir, config, state, num_shards=4)


def engine_share(cfg, weights, fmt: str, budget: int, itemsize: int) -> int | None:
    """The allocator share of each engine in the plan for `fmt` / `fmt` on `budget` (None: nothing fits)."""
    s = M.Settings(images=plan_image_limits(), und_format=fmt, gen_format=fmt, itemsize=itemsize,
                   streaming_fallback=0)    # resident: this loads the branch whole (streaming has its own bench)
    found = M.plan(cfg, s, budget, "colocate", weights)
    p = found["asked"] if found["asked"].fits else found["fix"]
    if p is None:
        return None
    return {b: e.total - e.parts["cuda_context"] for b, e in (("und", p.und), ("gen", p.gen))}


def peak_of(device, cap: int | None, load) -> dict:
    """Run `load` (-> model) with torch's allocator capped at `cap` bytes on a CUDA `device`: its peak, what it
    holds after, seconds; an out-of-memory is the result, not a crash."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.device(device).index or 0)  # the allocator's cap needs an index
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total) if cap else 1.0, device)
    t0 = time.perf_counter()
    try:
        model = load()
    except torch.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    out = {"load_s": round(time.perf_counter() - t0, 2)}
    if cuda:
        out.update(peak_bytes=torch.cuda.max_memory_allocated(device), held_bytes=torch.cuda.memory_allocated(device))
    del model
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny geometry on the CPU (checks the script)")
    ap.add_argument("--variant", default="u1-8b", help="full-size geometry (tiny.full_config)")
    ap.add_argument("--branches", default="gen,und")
    ap.add_argument("--format", default="int8", choices=["int8", "fp8"])
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    itemsize = 4 if args.tiny else 2
    config = tiny_config("u1") if args.tiny else full_config(args.variant)
    cfg = parse_config(config)
    weights = {b: M.branch_weights(cfg, b) for b in ("und", "gen")}
    shares = engine_share(cfg, weights, args.format, int(args.budget_gib * M.GiB), itemsize)
    root = args.dir or tempfile.mkdtemp(prefix="u1-loadpeak-")
    results = {}
    print(f"| branch | format | cap GiB (its share of {args.budget_gib:g} GiB) | plan load peak GiB | measured peak, "
          f"layer by layer | measured peak, quantised after the load (uncapped) | load s |")
    print("|---|---|---|---|---|---|---|")
    for branch in args.branches.split(","):
        d = write_branch(os.path.join(root, branch), config, branch, dtype, device)
        cap = None if args.tiny or shares is None else shares[branch]
        r = {"cap_bytes": cap, "plan_load_peak_bytes": M.quantized_load_peak(weights[branch], args.format, itemsize)}
        r["layerwise"] = peak_of(device, cap, lambda: load_model(d, branch, dtype, device, quantization=args.format))

        def after():
            m = load_model(d, branch, dtype, device)
            quantize_model(m, (branch,), scheme=scheme(args.format))
            return m
        r["after_load"] = peak_of(device, None, after)
        shutil.rmtree(d, ignore_errors=True)
        results[branch] = r
        g = lambda x: "-" if x is None else M.gib(x)   # noqa: E731
        lw, al = r["layerwise"], r["after_load"]
        print(f"| {ENGINES[branch]} | {args.format} | {g(cap)} | {g(r['plan_load_peak_bytes'])} | "
              f"{lw.get('error') or g(lw.get('peak_bytes'))} | {al.get('error') or g(al.get('peak_bytes'))} | "
              f"{lw.get('load_s', '-')} |")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args, results)
    return 1 if any("error" in r["layerwise"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
