"""Multi-LoRA overhead in the generation engine: denoising step time of a batch of jobs with the adapters served
unmerged (services/model/lora_registry.py, kernels/lora.py) vs the base weights (= an adapter merged at load).

For each image size: one batch of --jobs CFG jobs stepping together (Engine.step, prefixes in memory), timed
    merged            no registry: the cost of any merged adapter (the base GEMMs only)
    0 used            registry on (--max-loras slots), every row on the base weights (the hooks' cost)
    R resident        R adapters loaded, job i uses adapter i mod R (rows of different adapters in one batch)
on the random 8B geometry (services.model.tiny.full_config), bf16, adapters of rank --rank on every target
(q/k/v/o, gate/up/down of the gen branch).

GPU (one H200, about 2 min):
    python -m bench.bench_lora --device cuda --sizes 1024,2048 --resident 1,4,16 --json docs/benchmarks/lora.json
CPU smoke (seconds):
    python -m bench.bench_lora --device cpu --tiny --sizes 64 --jobs 2 --resident 1,2 --steps 1 --warmup 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from services.contract.image import GenerateRequest
from services.generation.engine import Engine
from services.model.lora_registry import LoraRegistry, Staged, target_names
from services.model.tiny import build_random_model, full_config, tiny_config


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny geometry (smoke test)")
    p.add_argument("--variant", default="u1-8b")
    p.add_argument("--sizes", default="1024,2048")
    p.add_argument("--jobs", default="1024:4,2048:2", help="jobs in the batch per size (SIZE:N,...), or one N")
    p.add_argument("--resident", default="1,4,16", help="resident adapter counts to time")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prefix", default="365,9", help="cond,uncond prefix tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def jobs_for(args, size: int) -> int:
    if ":" not in args.jobs:
        return int(args.jobs)
    table = dict(item.split(":") for item in args.jobs.split(","))
    return int(table.get(str(size), 1))


def random_adapter(reg: LoraRegistry, name: str, rank: int, seed: int) -> Staged:
    """Factors of `rank` on every target module (the scale folded in), as a loaded file would give."""
    g = torch.Generator(device=reg.device).manual_seed(seed)
    staged = Staged(name, "(random)")
    for m, hook in reg.hooks.items():
        k, n = hook.a.shape[2], hook.b.shape[1]
        staged.factors[m] = (torch.randn(rank, k, generator=g, device=reg.device) / k ** 0.5,
                             torch.randn(n, rank, generator=g, device=reg.device) * 0.01)
    return staged


def step_time(model, size: int, n_jobs: int, loras: list, prefix: tuple[int, int], warmup: int, steps: int,
              device, dtype) -> float:
    """Median seconds of one Engine.step over `n_jobs` CFG jobs (job i uses loras[i % len] or the base)."""
    engine = Engine(model, prefix_source=None)
    total = warmup + steps + 1
    kv = {b: torch.randn(model.num_layers, 2, p, model.num_kv_heads, model.head_dim, device=device, dtype=dtype)
          for b, p in zip(("cond", "uncond"), prefix)}
    for i in range(n_jobs):
        spec = GenerateRequest(request_id=f"j{i}", handles={"cond": {}, "uncond": {}}, mode="t2i", width=size,
                               height=size, num_inference_steps=total, guidance_scale=4.0, seed=i,
                               lora=loras[i % len(loras)] if loras else None)
        engine.add(engine.admit_local(spec, kv, {"cond": prefix[0], "uncond": prefix[1]}))
    for _ in range(warmup):
        engine.step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    for job in list(engine.running):
        engine.abort(job.request_id)
    return statistics.median(times)


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = tiny_config("u1") if args.tiny else full_config(args.variant)
    model = build_random_model(config, "gen", dtype, device)
    prefix = tuple(int(x) for x in args.prefix.split(","))
    resident = [int(x) for x in args.resident.split(",")]
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
           "rank": args.rank, "targets": len(target_names(model)), "rows": []}
    print(f"device {out['device']}, {out['targets']} target linears, rank {args.rank}")
    print("| size | jobs | adapters | step s | vs merged |")
    print("|---|---:|---|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        n = jobs_for(args, size)
        model.lora = None
        merged = step_time(model, size, n, [], prefix, args.warmup, args.steps, device, dtype)
        cases = [("merged", merged)]
        reg = LoraRegistry(model, max(resident), args.rank)     # hooks stay on the modules: one registry
        model.lora = reg
        cases.append(("0 used (registry on)", step_time(model, size, n, [], prefix, args.warmup, args.steps,
                                                         device, dtype)))
        for r in resident:
            for i in range(r):
                if f"a{i}" not in reg.adapters:
                    reg.install(random_adapter(reg, f"a{i}", args.rank, i), None)
            cases.append((f"{r} resident", step_time(model, size, n, [f"a{i}" for i in range(r)], prefix,
                                                     args.warmup, args.steps, device, dtype)))
        for name, sec in cases:
            print(f"| {size}² | {n} | {name} | {sec:.4f} | {sec / merged:.3f}x |")
            out["rows"].append({"size": size, "jobs": n, "case": name, "step_s": sec, "vs_merged": sec / merged})
        for hook in reg.hooks.values():     # the next size starts without adapters: hooks see no registry batch
            hook.a.zero_()
            hook.b.zero_()
        model.lora = None
        reg.batch = None
        _detach_hooks(model)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _detach_hooks(model) -> None:
    for m in target_names(model).values():
        m._forward_hooks.clear()


if __name__ == "__main__":
    sys.exit(main())
