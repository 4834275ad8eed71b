"""Issue-12 parts of bench_generation.py (`--part fp8|cache|preset|warmstart`): torch only.

Every job is admitted with random prefix KV held in memory (`Engine.admit_local`, no pool), P = 365
for cond and 9 for uncond as in the step benchmark. Timings synchronise the device around what they
time, never inside a step.
"""
from __future__ import annotations

import statistics
import time

import torch

from bench_generation import _sync, build
from services.generation.engine import Engine
from services.generation.request import GenerateJob
from services.model import reference as R
from services.model import sampler as S

PREFIX = {"cond": 365, "uncond": 9}


def spec(rid: str, size: int, steps: int, guidance: float, cache: dict | None = None) -> GenerateJob:
    branches = ["cond", "uncond"] if guidance > 1 else ["cond"]
    return GenerateJob(request_id=rid, handles={b: {} for b in branches}, mode="t2i", width=size,
                       height=size, n=1, num_inference_steps=steps, guidance_scale=guidance,
                       image_guidance_scale=1.0, cfg_norm="none", timestep_shift=3.0, t_eps=0.02,
                       cfg_interval=(0.0, 1.0), seed=0, output_format="png", cache=cache)


def prefix_kv(model, branches, device, dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {b: torch.randn((model.num_layers, 2, PREFIX[b], model.num_kv_heads, model.head_dim),
                           generator=g, device=device).to(dtype) for b in branches}


def admit(engine: Engine, sp: GenerateJob):
    job = engine.admit_local(sp, prefix_kv(engine.model, sp.branches, engine.device, engine.dtype),
                             {b: PREFIX[b] for b in sp.branches})
    engine.add(job)
    return job


def step_times(engine: Engine, sp: GenerateJob, warmup: int, steps: int) -> list[float]:
    """Seconds of `steps` single steps after `warmup` (sp must have more steps than both)."""
    job = admit(engine, sp)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    engine.drop(job.request_id)
    return times


def job_seconds(engine: Engine, sp: GenerateJob) -> tuple[float, dict]:
    """Whole job (every step and the uint8 pixels on the host). Returns (seconds, branch_steps)."""
    job = admit(engine, sp)
    _sync(engine.device)
    t0 = time.perf_counter()
    while not job.done:
        engine.step()
    engine.pixels(job)
    seconds = time.perf_counter() - t0
    job.free()
    return seconds, job.branch_steps


def velocity(model, kv: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor:
    th, tw = x.shape[2] // 32, x.shape[3] // 32
    s = S.noise_scale(model.cfg, th * tw)
    tt = torch.tensor(t, device=x.device)
    return R.gen_velocity(model, kv, PREFIX["cond"], model.gen_embed(x, tt, s), S.patchify(x), tt, th, tw,
                          0.02)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _sizes(args) -> list[int]:
    return [args.size] if args.tiny else [int(x) for x in args.sizes.split(",")]


def _fp8_models(args, device, dtype):
    from services.model.quant import Fp8Linear, check_fp8_device, quantize_model
    args.quantization = "none"
    m16 = build(args, device, dtype)
    m8 = build(args, device, dtype)             # same seed: the same weights
    check_fp8_device(device, dtype)
    quantize_model(m8, ("gen",), fast_accum=False)
    return m16, m8, Fp8Linear


@torch.inference_mode()
def part_fp8(args, device, dtype) -> dict:
    from kernels.fp8_quant import quant_fp8_rowwise, quant_fp8_rowwise_ref
    from services.model.quant import scaled_mm, scaled_mm_emulated
    m16, m8, Fp8Linear = _fp8_models(args, device, dtype)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "steps": {}}
    w, n = args.warmup, args.steps
    for size in _sizes(args):
        e16, e8 = Engine(m16, None), Engine(m8, None)
        row = {"bf16": statistics.median(step_times(e16, spec("b", size, w + n + 1, 1.0), w, n)),
               "fp8": statistics.median(step_times(e8, spec("f", size, w + n + 1, 1.0), w, n))}
        for mod in m8.modules():
            if isinstance(mod, Fp8Linear):
                mod.fast_accum = True
        row["fp8_fast_accum"] = statistics.median(step_times(e8, spec("a", size, w + n + 1, 1.0), w, n))
        for mod in m8.modules():
            if isinstance(mod, Fp8Linear):
                mod.fast_accum = False
        out["steps"][size] = row
    # per-step velocity error of fp8 vs bf16 along the bf16 trajectory of an 8-step schedule
    size = _sizes(args)[-1]
    kv = prefix_kv(m16, ["cond"], device, dtype)["cond"]
    x = S.initial_noise(1, size, size, 0, device, dtype, S.noise_scale(m16.cfg, (size // 32) ** 2))
    grid = S.timesteps(8, 3.0).tolist()
    errs = []
    for k in range(8):
        v16, v8 = velocity(m16, kv, x, grid[k]), velocity(m8, kv, x, grid[k])
        errs.append(rel(v8, v16))
        x = S.unpatchify(S.euler(S.patchify(x), v16, grid[k], grid[k + 1]), size // 32, size // 32)
    out["velocity_rel_err"] = {"size": size, "per_step": errs, "mean": statistics.mean(errs),
                               "max": max(errs)}
    # the fp8 GEMM against its emulation and the quantiser against the torch reference (bits)
    checks = []
    g = torch.Generator(device=device).manual_seed(1)
    h = m16.cfg.llm.hidden_size
    inter = m16.cfg.llm.intermediate_size
    for M, N, K in [(4096, h, h), (4096, inter, h), (4096, h, inter)] if not args.tiny else [(64, 64, 64)]:
        a = torch.randn(M, K, generator=g, device=device).to(dtype)
        b = (0.02 * torch.randn(N, K, generator=g, device=device)).to(dtype)
        qa, sa = quant_fp8_rowwise(a)
        ra, rsa = quant_fp8_rowwise_ref(a)
        qb, sb = quant_fp8_rowwise(b)
        got = scaled_mm(qa, qb, sa, sb.t().contiguous(), dtype).float()
        want = scaled_mm_emulated(qa, qb, sa, sb.t(), torch.float32)
        checks.append({"mnk": [M, N, K], "quant_bits_equal": bool(torch.equal(qa.view(torch.uint8),
                                                                                ra.view(torch.uint8))
                                                                    and torch.equal(sa, rsa)),
                       "gemm_vs_emulation_rel": rel(got, want)})
    out["checks"] = checks
    print(f"device: {out['device']}, torch {out['torch']}")
    print("| image | base s/step | fp8 s/step | fp8 fast-accum s/step | speedup | target (2048²) |")
    print("|---|---:|---:|---:|---:|---|")
    for size, r in out["steps"].items():
        print(f"| {size}² | {r['bf16']:.4f} | {r['fp8']:.4f} | {r['fp8_fast_accum']:.4f} | "
              f"{r['bf16'] / r['fp8']:.2f}x | {'<= 0.085 s' if size == 2048 else ''} |")
    v = out["velocity_rel_err"]
    print(f"\nfp8 vs bf16 velocity, {v['size']}², 8-step trajectory: mean {v['mean']:.4f}, max {v['max']:.4f} "
          f"(per step {', '.join(f'{e:.4f}' for e in v['per_step'])})")
    for c in checks:
        print(f"GEMM {c['mnk']}: quantiser bits equal torch: {c['quant_bits_equal']}, "
              f"_scaled_mm vs emulation rel {c['gemm_vs_emulation_rel']:.2e}")
    return out


@torch.inference_mode()
def part_cache(args, device, dtype) -> dict:
    model = build(args, device, dtype)
    engine = Engine(model, None)
    steps_by_size = dict(x.split(":") for x in args.job_steps.split(","))
    out = {"rows": []}
    print("| image | steps | cache | job s | s/step | speedup | computed (cond, uncond) |")
    print("|---|---:|---|---:|---:|---:|---|")
    for size in _sizes(args):
        steps = int(steps_by_size.get(str(size), 10))
        job_seconds(engine, spec("warm", size, 2, 4.0))
        base, _ = job_seconds(engine, spec("off", size, steps, 4.0))
        rows = [("off", base, None)]
        for thr in (float(x) for x in args.thresholds.split(",")):
            sec, bs = job_seconds(engine, spec(f"t{thr}", size, steps, 4.0,
                                               {"mode": "first_block", "threshold": thr}))
            rows.append((f"first_block {thr}", sec, bs))
        for name, sec, bs in rows:
            comp = "all" if bs is None else f"{bs['cond']['computed']}, {bs['uncond']['computed']}"
            print(f"| {size}² | {steps} | {name} | {sec:.3f} | {sec / steps:.4f} | {base / sec:.2f}x | {comp} |")
            out["rows"].append({"size": size, "steps": steps, "cache": name, "seconds": sec,
                                "branch_steps": bs})
    return out


@torch.inference_mode()
def part_preset(args, device, dtype) -> dict:
    from services.model.presets import PRESETS
    p = PRESETS["8step"]
    out = {"rows": []}
    quants = ["none"] + (["fp8"] if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
                         else [])
    print("| image | weights | 8-step job s (incl. uint8 to host) | s/step |")
    print("|---|---|---:|---:|")
    for q in quants:
        args.quantization = q
        engine = Engine(build(args, device, dtype), None)
        for size in _sizes(args):
            sp = lambda rid: spec(rid, size, p.num_inference_steps, p.guidance_scale)  # noqa: E731
            job_seconds(engine, sp("warm"))
            sec = statistics.median(job_seconds(engine, sp(f"r{i}"))[0] for i in range(3))
            print(f"| {size}² | {q if q != 'none' else 'bf16'} | {sec:.3f} | {sec / p.num_inference_steps:.4f} |")
            out["rows"].append({"size": size, "quantization": q, "job_s": sec})
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def part_warmstart(args, device, dtype) -> dict:
    """Run in a fresh process: the first step here is the first step of a service's life."""
    from services.generation.warmup import run_warmup
    t0 = time.perf_counter()
    engine = Engine(build(args, device, dtype), None)
    _sync(device)
    load_s = time.perf_counter() - t0
    warm = None if args.no_warmup else run_warmup(engine, [(args.size, args.size)], 2)
    times = step_times(engine, spec("first", args.size, 8, 4.0), 0, 6)
    steady = statistics.median(times[2:])
    out = {"size": args.size, "warmup": warm, "build_s": load_s, "first_step_s": times[0],
           "steady_step_s": steady, "ratio": times[0] / steady}
    print(f"| {args.size}² CFG | {'cold (no warm-up)' if warm is None else 'warm-up ' + str(warm['seconds']) + ' s'} "
          f"| first step {times[0]:.4f} s | steady {steady:.4f} s | ratio {out['ratio']:.2f} (goal <= 1.2) |")
    return out


PARTS = {"fp8": part_fp8, "cache": part_cache, "preset": part_preset, "warmstart": part_warmstart}
