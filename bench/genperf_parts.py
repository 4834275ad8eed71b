"""The speed-option parts of bench_generation.py (`--part fp8|fp8-profile|cache|preset|warmstart|graphs|addnorm|
fp8-fused`):
torch only.

Every job is admitted with random prefix KV held in memory (`Engine.admit_local`, no pool), P = 365
for cond and 9 for uncond as in the step benchmark. Timings synchronise the device around what they
time, never inside a step.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from services.generation.engine import Engine
from services.contract.image import GenerateRequest
from services.model import reference as R
from services.model import sampler as S

from bench.genperf_common import (OTHER_PREFIX, PREFIX, admit, bench_sizes, build, device_name, prefix_kv,
                                  spec, step_times, sync)


def job_seconds(engine: Engine, sp: GenerateRequest) -> tuple[float, dict]:
    """Whole job (every step and the uint8 pixels on the host). Returns (seconds, branch_steps)."""
    job = admit(engine, sp)
    sync(engine.device)
    t0 = time.perf_counter()
    while not job.flow.done:
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


# ----------------------------------------------------------------------------- fp8 models and policies
def _fp8_policies(device):
    """name -> GemmPolicy: what serving runs (`GemmPolicy.for_device`), every GEMM in fp8 with accurate
    accumulation, every GEMM in fp8 with fast accumulation."""
    from services.model.quant import GemmPolicy
    return {"serving": GemmPolicy.for_device(device), "all": GemmPolicy(0, None), "fast": GemmPolicy(0, 0)}


def set_policy(model, policy) -> None:
    """Switch every fp8 module of `model` to `policy` (built with the model-dtype weights kept)."""
    from services.model.quant import Fp8Linear, Fp8RMSNorm
    for mod in model.modules():
        if isinstance(mod, (Fp8Linear, Fp8RMSNorm)):
            mod.policy = policy


def _fp8_models(args, device, dtype):
    """(bf16 model, fp8 model) with the same random weights; the fp8 one keeps its model-dtype weights,
    so `set_policy` can switch it between the policies of `_fp8_policies`."""
    from services.model.quant import GemmPolicy, check_fp8_device, quantize_model
    args.quantization = "none"
    m16 = build(args, device, dtype)
    m8 = build(args, device, dtype)             # same seed: the same weights
    check_fp8_device(device, dtype)
    quantize_model(m8, ("gen",), policy=GemmPolicy(min_tokens=1))   # keeps the model-dtype weights
    return m16, m8


def _burn(engines, size: int, seconds: float) -> None:
    """Run steps until the GPU is at its steady clocks (the first timed config of a process otherwise
    reads slow: GPU run 1's first row)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for e in engines:
            step_times(e, spec("burn", size, 3, 1.0), 0, 2)


@torch.inference_mode()
def part_fp8(args, device, dtype) -> dict:
    m16, m8 = _fp8_models(args, device, dtype)
    policies = _fp8_policies(device)
    out = {"device": device_name(device), "torch": torch.__version__, "steps": {},
           "serving_policy": str(policies["serving"])}
    w, n = args.warmup, args.steps
    e16, e8 = Engine(m16, None), Engine(m8, None)
    _burn([e16, e8], max(bench_sizes(args)), 0.0 if args.tiny else 3.0)
    for size in bench_sizes(args):
        samples = {k: [] for k in ("bf16", *policies)}
        for _ in range(1 if args.tiny else 2):  # interleaved rounds per config
            samples["bf16"] += step_times(e16, spec("b", size, w + n + 1, 1.0), w, n)
            for name, pol in policies.items():
                set_policy(m8, pol)
                samples[name] += step_times(e8, spec(name, size, w + n + 1, 1.0), w, n)
        out["steps"][size] = {k: statistics.median(v) for k, v in samples.items()}
        out["steps"][size]["rows"] = (size // 32) ** 2
    out["velocity_rel_err"] = _velocity_errors(args, m16, m8, policies, device, dtype)
    set_policy(m8, policies["serving"])
    out["gemm_shapes"] = _gemm_shapes(args, m16, device, dtype)
    out["checks"] = _fp8_checks(args, m16, device, dtype)
    _print_fp8(out)
    return out


def _velocity_errors(args, m16, m8, policies, device, dtype) -> dict:
    """Per-step relative velocity error of fp8 (accurate and fast accumulation) vs bf16 along the bf16
    trajectory of an 8-step schedule at the largest size."""
    size = max(bench_sizes(args))
    kv = prefix_kv(m16, {"cond": PREFIX["cond"]}, device, dtype)["cond"]
    x = S.initial_noise(1, size, size, 0, device, dtype, S.noise_scale(m16.cfg, (size // 32) ** 2))
    grid = S.timesteps(8, 3.0).tolist()
    errs = {"all": [], "fast": []}
    for k in range(8):
        v16 = velocity(m16, kv, x, grid[k])
        for name in errs:
            set_policy(m8, policies[name])
            errs[name].append(rel(velocity(m8, kv, x, grid[k]), v16))
        x = S.unpatchify(S.euler(S.patchify(x), v16, grid[k], grid[k + 1]), size // 32, size // 32)
    return {"size": size, **{name: {"per_step": e, "mean": statistics.mean(e), "max": max(e)}
                             for name, e in errs.items()}}


def _gemm_shapes(args, model, device, dtype) -> list[dict]:
    """Each GEMM of a layer at several row counts: bf16 vs fp8 (accurate / fast accumulation) and the
    activation quantiser alone: the data for GemmPolicy's thresholds."""
    import torch.nn.functional as F

    from kernels.fp8_quant import quant_fp8_rowwise
    from services.model.quant import scaled_mm
    llm = model.cfg.llm
    h, inter, kv = llm.hidden_size, llm.intermediate_size, llm.num_key_value_heads * llm.head_dim
    q = llm.num_attention_heads * llm.head_dim
    shapes = [("q", q, h), ("k|v", 2 * kv, h), ("o", h, q), ("gate|up", 2 * inter, h), ("down", h, inter)]
    ms = (64, 128) if args.tiny else (1024, 2048, 4096, 8192)
    g = torch.Generator(device=device).manual_seed(2)
    rows = []
    for M in ms:
        for name, N, K in shapes:
            x = torch.randn(M, K, generator=g, device=device).to(dtype)
            wt = (0.02 * torch.randn(N, K, generator=g, device=device)).to(dtype)
            qx, sx = quant_fp8_rowwise(x)
            qw, sw = quant_fp8_rowwise(wt)
            sw = sw.t().contiguous()
            r = {"name": name, "M": M, "N": N, "K": K,
                 "bf16_us": _time_us(lambda: F.linear(x, wt), device),
                 "fp8_us": _time_us(lambda: scaled_mm(qx, qw, sx, sw, dtype, False), device),
                 "fp8_fast_us": _time_us(lambda: scaled_mm(qx, qw, sx, sw, dtype, True), device),
                 "quant_us": _time_us(lambda: quant_fp8_rowwise(x), device)}
            r["tflops_bf16"] = 2 * M * N * K / r["bf16_us"] / 1e6
            r["tflops_fp8"] = 2 * M * N * K / r["fp8_us"] / 1e6
            rows.append(r)
    return rows


def _time_us(fn, device, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps * 1e6


def _kernel_us(fn, device) -> float:
    """Median us of fn's kernels on CUDA (triton's do_bench: L2 flushed before each run, CUDA events), else
    `_time_us`. A host-timed loop of a few calls measures launch overhead for ~20-90 us kernels: the first
    addnorm table read 85.7 vs 90.6 us for what do_bench times at 53.5 vs 35.9 us (2026-11-30)."""
    if device.type != "cuda":
        return _time_us(fn, device)
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _first_mismatches(x, got, want, limit: int = 5) -> list[dict]:
    """The first elements where the kernel's (q, scale) and the reference's differ."""
    (q, s), (rq, rs) = got, want
    bad = (q.view(torch.uint8) != rq.view(torch.uint8)) | (s != rs)
    out = []
    for r, c in bad.nonzero()[:limit].tolist():
        out.append({"row": r, "col": c, "input": float(x[r, c]), "kernel_scale": float(s[r, 0]),
                    "torch_scale": float(rs[r, 0]), "kernel_byte": int(q[r, c].view(torch.uint8)),
                    "torch_byte": int(rq[r, c].view(torch.uint8)),
                    "input_over_torch_scale": float(x[r, c].float() / rs[r, 0])})
    return out


def _fp8_checks(args, model, device, dtype) -> list[dict]:
    """Kernels vs torch on this device, bit for bit: the quantiser vs `quant_fp8_rowwise_ref`, the fused
    producers vs their plain kernel + the quantiser; `_scaled_mm` vs its fp32 emulation."""
    from kernels.fp8_quant import quant_fp8_rowwise, quant_fp8_rowwise_ref
    from kernels.norm_act import rms_norm, rms_norm_fp8, silu_mul, silu_mul_fp8
    from services.model.quant import scaled_mm, scaled_mm_emulated
    g = torch.Generator(device=device).manual_seed(1)
    h, inter = model.cfg.llm.hidden_size, model.cfg.llm.intermediate_size
    checks = []
    for M, N, K in [(4096, h, h), (4096, inter, h), (4096, h, inter)] if not args.tiny else [(64, 64, 64)]:
        a = torch.randn(M, K, generator=g, device=device).to(dtype)
        b = (0.02 * torch.randn(N, K, generator=g, device=device)).to(dtype)
        got, want = quant_fp8_rowwise(a), quant_fp8_rowwise_ref(a)
        (qa, sa), (qb, sb) = got, quant_fp8_rowwise(b)
        mm = scaled_mm(qa, qb, sa, sb.t().contiguous(), dtype).float()
        emu = scaled_mm_emulated(qa, qb, sa, sb.t(), torch.float32)
        checks.append({"what": f"quantiser [{M}, {K}] vs torch", "bits_equal": not _first_mismatches(a, got, want, 1),
                       "first_mismatches": _first_mismatches(a, got, want)})
        checks.append({"what": f"_scaled_mm [{M}, {N}, {K}] vs emulation", "rel": rel(mm, emu)})
    M = 4096 if not args.tiny else 64
    x = torch.randn(M, h, generator=g, device=device).to(dtype)
    w = (torch.rand(h, generator=g, device=device) + 0.5).to(dtype)
    fused, plain = rms_norm_fp8(x, w, 1e-6), quant_fp8_rowwise(rms_norm(x, w, 1e-6))
    checks.append({"what": f"RMSNorm->fp8 [{M}, {h}] vs RMSNorm + quantiser",
                   "bits_equal": not _first_mismatches(x, fused, plain, 1)})
    gu = (3 * torch.randn(M, 2 * inter, generator=g, device=device)).to(dtype)
    gate, up = gu[:, :inter], gu[:, inter:]
    fused, plain = silu_mul_fp8(gate, up), quant_fp8_rowwise(silu_mul(gate.contiguous(), up.contiguous()))
    checks.append({"what": f"silu*mul->fp8 [{M}, {inter}] vs silu*mul + quantiser",
                   "bits_equal": not _first_mismatches(gate, fused, plain, 1)})
    return checks


def _print_fp8(out: dict) -> None:
    print(f"device: {out['device']}, torch {out['torch']}; serving policy {out['serving_policy']}")
    print("\n| image | rows | bf16 s/step | fp8 serving policy | fp8 every GEMM | fp8 every GEMM, fast accum "
          "| speedup (serving) | target |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for size, r in out["steps"].items():
        print(f"| {size}² | {r['rows']} | {r['bf16']:.4f} | {r['serving']:.4f} | {r['all']:.4f} | {r['fast']:.4f} | "
              f"{r['bf16'] / r['serving']:.2f}x | {'<= 0.085 s' if size == 2048 else ''} |")
    v = out["velocity_rel_err"]
    for name, label in (("all", "fp8"), ("fast", "fp8 fast accum")):
        e = v[name]
        print(f"\n{label} vs bf16 velocity, {v['size']}², 8-step trajectory: mean {e['mean']:.4f}, max {e['max']:.4f} "
              f"(per step {', '.join(f'{x:.4f}' for x in e['per_step'])})")
    print("\n| GEMM | M | N | K | bf16 us | fp8 us | fp8 fast us | quantiser us | bf16 TFLOP/s | fp8 TFLOP/s "
          "| fp8 + quantiser vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["gemm_shapes"]:
        print(f"| {r['name']} | {r['M']} | {r['N']} | {r['K']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
              f"{r['fp8_fast_us']:.1f} | {r['quant_us']:.1f} | {r['tflops_bf16']:.0f} | {r['tflops_fp8']:.0f} | "
              f"{r['bf16_us'] / (r['fp8_us'] + r['quant_us']):.2f}x |")
    print()
    for c in out["checks"]:
        if "rel" in c:
            print(f"{c['what']}: rel {c['rel']:.2e}")
            continue
        print(f"{c['what']}: bits equal {c['bits_equal']}")
        for m in c.get("first_mismatches", []):
            print(f"  mismatch at {m['row']},{m['col']}: input {m['input']!r} (input / torch scale "
                  f"{m['input_over_torch_scale']!r}), scale kernel {m['kernel_scale']!r} torch {m['torch_scale']!r}, "
                  f"byte kernel 0x{m['kernel_byte']:02x} torch 0x{m['torch_byte']:02x}")


# ----------------------------------------------------------------------------- fp8-profile
PROFILE_CATEGORIES = [   # (category, name fragments), first match wins: our kernels by name before generic words
    ("silu*mul -> fp8", ("_silu_mul_fp8",)),              # _silu_mul_fp8_kernel, _silu_mul_fp8_twopass_kernel
    ("silu*mul (bf16)", ("_silu_mul_kernel",)),
    ("RMSNorm (bf16 and -> fp8)", ("_rms_norm",)),          # one kernel name for all (QUANT, ADD constexprs)
    ("fp8 quantiser (standalone)", ("_quant_kernel", "_quant_twopass")),
    ("Q/K norm + RoPE", ("_norm_rope",)),
    # fp8 GEMMs: cuBLASLt nvjet "qq" (e4m3 x e4m3: nvjet_sm90_qqtst_...), CUTLASS / xmma names with an fp8 type;
    # a tuple needs all its fragments (a torch elementwise kernel templated on Float8_e4m3fn is no GEMM)
    ("fp8 GEMM", ("qqtst", ("nvjet", "_qq"), *((g, t) for g in ("gemm", "cutlass", "xmma", "matmul")
                                               for t in ("e4m3", "f8")))),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("conv (embedder, head)", ("conv", "implicit", "fprop", "winograd", "cudnn")),
    ("bf16 GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "addmm", "linear", "mm")),
    ("copy / index / cat", ("memcpy", "memset", "copy", "index", "cat", "gather", "scatter")),
    ("torch elementwise / reduce", ("elementwise", "vectorized", "reduce", "unrolled", "add", "mul")),
]


def profile_category(name: str) -> str:
    """The PROFILE_CATEGORIES category of a kernel name (a fragment: a string, or a tuple of strings that
    must all occur)."""
    low = name.lower()
    for cat, frags in PROFILE_CATEGORIES:
        if any(f in low if isinstance(f, str) else all(p in low for p in f) for f in frags):
            return cat
    return "other"


def kernel_rows(prof, device) -> list[tuple[str, float, int]]:
    """(kernel name, ms, launches) of one profiled step: device kernels on CUDA, CPU ops elsewhere."""
    from torch.autograd import DeviceType
    rows = []
    for e in prof.key_averages():
        if device.type == "cuda":
            if getattr(e, "device_type", None) != DeviceType.CUDA:
                continue
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, us / 1e3, e.count))
    if device.type == "cuda" and not rows:   # no kernel events: attribute each op's own device time
        rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                if getattr(e, "self_device_time_total", 0) > 0]
    return sorted(rows, key=lambda r: -r[1])


@torch.inference_mode()
def part_fp8_profile(args, device, dtype) -> dict:
    """torch.profiler of one single-branch step, bf16 vs fp8 (serving policy): time per kernel category
    and the top kernels, to see where the fp8 step spends its time above the GEMM floor."""
    from torch.profiler import ProfilerActivity, profile
    m16, m8 = _fp8_models(args, device, dtype)
    set_policy(m8, _fp8_policies(device)["serving"])
    size = args.size
    out = {"device": device_name(device), "size": size, "models": {}}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, model in (("bf16", m16), ("fp8", m8)):
        engine = Engine(model, None)
        wall = statistics.median(step_times(engine, spec("w", size, 8, 1.0), 2, 5))
        job = admit(engine, spec("p", size, 4, 1.0))
        engine.step()
        sync(device)
        with profile(activities=acts) as prof:
            engine.step()
            sync(device)
        engine.abort(job.request_id)
        rows = kernel_rows(prof, device)
        cats: dict[str, list] = {}
        for k, ms, cnt in rows:
            c = cats.setdefault(profile_category(k), [0.0, 0])
            c[0] += ms
            c[1] += cnt
        out["models"][name] = {"wall_s": wall, "kernel_ms": sum(r[1] for r in rows),
                               "categories": {k: {"ms": v[0], "launches": v[1]} for k, v in cats.items()},
                               "top": [{"kernel": k, "ms": ms, "launches": c} for k, ms, c in rows[:15]]}
        del engine
    _print_profile(out)
    return out


def _print_profile(out: dict) -> None:
    b, f = out["models"]["bf16"], out["models"]["fp8"]
    print(f"device: {out['device']}; one single-branch step at {out['size']}², P = {PREFIX['cond']} "
          f"(torch.profiler; wall = unprofiled median step)")
    print("\n| | bf16 | fp8 |\n|---|---:|---:|")
    print(f"| step wall ms | {1e3 * b['wall_s']:.1f} | {1e3 * f['wall_s']:.1f} |")
    print(f"| kernel time ms (sum) | {b['kernel_ms']:.1f} | {f['kernel_ms']:.1f} |")
    print(f"| idle / launch-bound ms (wall - kernels) | {1e3 * b['wall_s'] - b['kernel_ms']:.1f} | "
          f"{1e3 * f['wall_s'] - f['kernel_ms']:.1f} |")
    cats = sorted(set(b["categories"]) | set(f["categories"]),
                  key=lambda c: -max(b["categories"].get(c, {"ms": 0})["ms"], f["categories"].get(c, {"ms": 0})["ms"]))
    print("\n| category | bf16 ms | bf16 launches | fp8 ms | fp8 launches | fp8 - bf16 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in cats:
        x, y = b["categories"].get(c, {"ms": 0.0, "launches": 0}), f["categories"].get(c, {"ms": 0.0, "launches": 0})
        print(f"| {c} | {x['ms']:.2f} | {x['launches']} | {y['ms']:.2f} | {y['launches']} | {y['ms'] - x['ms']:+.2f} |")
    for name, m in (("bf16", b), ("fp8", f)):
        print(f"\nTop kernels, {name}:\n\n| kernel | ms | launches | category |\n|---|---:|---:|---|")
        for r in m["top"]:
            k = r["kernel"].replace("|", "/")
            print(f"| `{k[:110]}` | {r['ms']:.2f} | {r['launches']} | {profile_category(r['kernel'])} |")


# ----------------------------------------------------------------------------- cache, preset, warm start
@torch.inference_mode()
def part_cache(args, device, dtype) -> dict:
    model = build(args, device, dtype)
    engine = Engine(model, None)
    steps_by_size = dict(x.split(":") for x in args.job_steps.split(","))
    out = {"rows": []}
    print("| image | steps | cache | job s | s/step | speedup | computed (cond, uncond) |")
    print("|---|---:|---|---:|---:|---:|---|")
    for size in bench_sizes(args):
        steps = int(steps_by_size.get(str(size), 10))
        job_seconds(engine, spec("warm", size, 2, 4.0))
        base, _ = job_seconds(engine, spec("off", size, steps, 4.0))
        rows = [("off", base, None)]
        for mode in ("first_block", "teacache"):   # random weights: the mechanism's cost and gain per skip
            for thr in (float(x) for x in args.thresholds.split(",")):
                sec, bs = job_seconds(engine, spec(f"{mode}{thr}", size, steps, 4.0,
                                                   {"mode": mode, "threshold": thr}))
                rows.append((f"{mode} {thr}", sec, bs))
        for name, sec, bs in rows:
            comp = "all" if bs is None else f"{bs['cond']['computed']}, {bs['uncond']['computed']}"
            print(f"| {size}² | {steps} | {name} | {sec:.3f} | {sec / steps:.4f} | {base / sec:.2f}x | {comp} |")
            out["rows"].append({"size": size, "steps": steps, "cache": name, "seconds": sec,
                                "branch_steps": bs})
    return out


@torch.inference_mode()
def part_preset(args, device, dtype) -> dict:
    """The 8-step preset (guidance 1): whole job, bf16, fp8 as served (GemmPolicy.for_device) and fp8
    with every GEMM in fp8 (min_tokens 0)."""
    from services.model.presets import PRESETS
    p = PRESETS["8step"]
    out = {"rows": []}
    fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    print("| image | weights | 8-step job s (incl. uint8 to host) | s/step |")
    print("|---|---|---:|---:|")
    m16, m8 = _fp8_models(args, device, dtype) if fp8_ok else (build(args, device, dtype), None)
    pols = _fp8_policies(device)
    runs = [("bf16", m16, None)] + ([("fp8 (serving policy)", m8, pols["serving"]),
                                     ("fp8 every GEMM", m8, pols["all"])] if m8 is not None else [])
    engines = {id(m): Engine(m, None) for m in (m16, m8) if m is not None}
    for size in bench_sizes(args):
        for name, model, pol in runs:
            if pol is not None:
                set_policy(model, pol)
            engine = engines[id(model)]
            sp = lambda rid: spec(rid, size, p.num_inference_steps, p.guidance_scale)  # noqa: E731
            job_seconds(engine, sp("warm"))
            sec = statistics.median(job_seconds(engine, sp(f"r{i}"))[0] for i in range(1 if args.tiny else 3))
            print(f"| {size}² | {name} | {sec:.3f} | {sec / p.num_inference_steps:.4f} |")
            out["rows"].append({"size": size, "weights": name, "job_s": sec})
    return out


def _attention_check(model, size: int, device, dtype) -> float:
    """The engine's attention (pick_denoise_attention) at a real shape (P = 365 + the image) vs the
    fp32 reference: rel error."""
    from kernels.denoise_attention import denoise_attention_ref
    from services.generation.attention import pick_denoise_attention
    attn, host_lengths = pick_denoise_attention(device)
    m = model
    scale = m.head_dim ** -0.5
    n, p = (size // 32) ** 2, PREFIX["cond"]
    g = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(n, m.num_heads, m.head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(n + p, m.num_kv_heads, m.head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(n + p, m.num_kv_heads, m.head_dim, generator=g, device=device).to(dtype)
    cu_q = torch.tensor([0, n], dtype=torch.int32)
    cu_k = torch.tensor([0, n + p], dtype=torch.int32)
    lengths = (cu_q, cu_k) if host_lengths else (cu_q.to(device), cu_k.to(device))
    got = attn(q, k, v, *lengths, n, n + p, scale)
    want = denoise_attention_ref(q, k, v, cu_q.to(device), cu_k.to(device), n, n + p, scale)
    return rel(got, want)


@torch.inference_mode()
def part_warmstart(args, device, dtype) -> dict:
    """Run in a fresh process: the first step here is the first step of a service's life. Then the
    first step of a job with a prompt length nobody used yet, and of a guidance-1 job."""
    from services.generation.attention import CUDNN_BUCKETED_PLANS
    from services.generation.warmup import run_warmup
    t0 = time.perf_counter()
    engine = Engine(build(args, device, dtype), None)
    sync(device)
    load_s = time.perf_counter() - t0
    warm = None if args.no_warmup else run_warmup(engine, [(args.size, args.size)], 2)
    times = step_times(engine, spec("first", args.size, 8, 4.0), 0, 6)
    steady = statistics.median(times[2:])
    other = step_times(engine, spec("other", args.size, 8, 4.0), 0, 4, OTHER_PREFIX)
    single = step_times(engine, spec("single", args.size, 8, 1.0), 0, 4)
    single_steady = statistics.median(single[1:])
    plans = os.environ.get(CUDNN_BUCKETED_PLANS, "unset")
    out = {"size": args.size, "warmup": warm, "build_s": load_s, "first_step_s": times[0],
           "steady_step_s": steady, "ratio": times[0] / steady, "other_prefix_first_s": other[0],
           "other_prefix_ratio": other[0] / steady, "single_first_s": single[0],
           "single_steady_s": single_steady, "single_ratio": single[0] / single_steady,
           "cudnn_bucketed_plans": plans, "attention_rel_err": _attention_check(engine.model, args.size, device, dtype)}
    label = "cold (no warm-up)" if warm is None else f"warm-up {warm['seconds']} s"
    print(f"{args.size}², {label}, {CUDNN_BUCKETED_PLANS}={plans}; engine attention vs fp32 reference "
          f"rel {out['attention_rel_err']:.2e}\n")
    print("| first step of | s | steady s | ratio (goal <= 1.2) |\n|---|---:|---:|---:|")
    print(f"| the process (CFG, P = {PREFIX['cond']} / {PREFIX['uncond']}) | {times[0]:.4f} | {steady:.4f} | "
          f"{out['ratio']:.2f} |")
    print(f"| a new prompt length (CFG, P = {OTHER_PREFIX['cond']} / {OTHER_PREFIX['uncond']}) | {other[0]:.4f} | "
          f"{steady:.4f} | {out['other_prefix_ratio']:.2f} |")
    print(f"| the first guidance-1 job | {single[0]:.4f} | {single_steady:.4f} | {out['single_ratio']:.2f} |")
    return out


# ----------------------------------------------------------------------------- CUDA graphs
def run_to_end(engine: Engine, specs: list[GenerateRequest]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Jobs admitted together and stepped to the end: ({request_id: final x}, seconds of each step)."""
    jobs = [admit(engine, sp) for sp in specs]
    times = []
    while engine.running:
        sync(engine.device)
        t0 = time.perf_counter()
        for job in engine.step()[0]:
            job.free()
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    return {j.request_id: j.x.clone() for j in jobs}, times


def _graph_counts(engine: Engine) -> dict:
    g = engine.graphs
    return {"captures": g.captures, "replays": g.replays, "failure": g.failure}


def _graphs_row(model, device, size: int, guidance: float, args) -> dict:
    """One configuration: s/step eager vs graphs (interleaved rounds, steady steps after the capture),
    and the final x of one whole job each (same seed and prefix) compared bit for bit."""
    eager, graphs = Engine(model, None, cuda_graphs="off"), Engine(model, None, cuda_graphs="on")
    w, n = max(args.warmup, 2), args.steps      # graphs capture on a composition's 2nd step
    samples: dict[str, list] = {"eager": [], "graphs": []}
    for r in range(1 if args.tiny else 2):
        for name, engine in (("eager", eager), ("graphs", graphs)):
            samples[name] += step_times(engine, spec(f"{name}{r}", size, w + n + 1, guidance), w, n)
    job = spec("equal", size, max(4, w + 2), guidance)
    want, _ = run_to_end(eager, [job])
    got, _ = run_to_end(graphs, [job])
    e, g = statistics.median(samples["eager"]), statistics.median(samples["graphs"])
    return {"size": size, "guidance": guidance, "eager_s": e, "graphs_s": g, "speedup": e / g,
            "bits_equal": torch.equal(got["equal"], want["equal"]), **_graph_counts(graphs)}


def _two_jobs(model, device, size: int, args) -> dict:
    """Two CFG jobs running together (one key: both jobs, both branches): s/step and the final x of each,
    eager vs graphs; a job that joins later changes the key (a new capture)."""
    steps = max(6, args.steps + 3)
    out = {"size": size, "steps": steps}
    xs = {}
    for name, mode in (("eager", "off"), ("graphs", "on")):
        engine = Engine(model, None, cuda_graphs=mode)
        run_to_end(engine, [spec("warm", size, 3, 4.0)])
        xs[name], times = run_to_end(engine, [spec("j1", size, steps, 4.0),
                                                spec("j2", size, steps, 4.0).model_copy(update={"seed": 1})])
        out[f"{name}_s"] = statistics.median(times[2:])
        out[f"{name}_counts"] = _graph_counts(engine)
    out["bits_equal"] = all(torch.equal(xs["graphs"][k], xs["eager"][k]) for k in xs["eager"])
    return out


def _cancel_then_new(model, device, size: int, args) -> dict:
    """A job aborted mid-way (engine.abort: its graph must go before its KV is freed), then a new job of
    the same shape (new KV addresses: a stale graph would read the freed buffer): its final x vs eager."""
    steps = 6
    xs, counts = {}, {}
    for name, mode in (("eager", "off"), ("graphs", "on")):
        engine = Engine(model, None, cuda_graphs=mode)
        first = admit(engine, spec("cancelled", size, steps, 4.0))
        for _ in range(4):                # eager, capture, replay, replay
            engine.step()
        engine.abort(first.request_id)
        xs[name], _ = run_to_end(engine, [spec("next", size, steps, 4.0)])
        counts[name] = _graph_counts(engine)
    return {"size": size, "steps": steps, "bits_equal": torch.equal(xs["graphs"]["next"], xs["eager"]["next"]),
            "graphs_counts": counts["graphs"]}


def _next_request(model, device, size: int, args) -> dict:
    """A request after another of its shape (the latency case of the 8-step targets): its whole run (every step,
    the first included) eager, with graphs keyed by job (it runs an eager and a capturing step) and keyed by shape
    (--graph-keys shape: it replays from its first step); its final x vs eager's, bit for bit."""
    steps = max(8, args.steps)
    out = {"size": size, "steps": steps}
    xs = {}
    for name, mode, keys in (("eager", "off", "job"), ("by_job", "on", "job"), ("by_shape", "on", "shape")):
        sync(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engine = Engine(model, None, cuda_graphs=mode, graph_keys=keys)
        run_to_end(engine, [spec("before", size, steps, 1.0)])
        t = []
        for r in range(1 if args.tiny else 3):
            sync(engine.device)
            t0 = time.perf_counter()
            xs[name], _ = run_to_end(engine, [spec("next", size, steps, 1.0).model_copy(update={"seed": 7 + r})])
            t.append(time.perf_counter() - t0)
        out[f"{name}_s"] = statistics.median(t)
        out[f"{name}_counts"] = _graph_counts(engine)
        sync(device)      # what the engine holds between requests (keyed by shape: the graph's KV buffer)
        held = torch.cuda.memory_allocated(device) - base if device.type == "cuda" else 0
        out[f"{name}_idle_mb"] = held / 2**20
        del engine
    out["bits_equal"] = all(torch.equal(xs[k]["next"], xs["eager"]["next"]) for k in ("by_job", "by_shape"))
    return out


@torch.inference_mode()
def part_graphs(args, device, dtype) -> dict:
    """The denoise step's layer stack replayed from a CUDA graph (services/generation/step_graph.py) vs
    eager: s/step at each size, guidance 1 (one branch) and 4 (two branches in one engine), bf16 and (at
    the largest size) fp8 as served; bit-equality of the final x; two jobs together; a cancel then a new
    job. On CPU graphs never apply ("n/a on cpu"): the same runs go through the eager path."""
    sizes = bench_sizes(args)
    fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    m16, m8 = _fp8_models(args, device, dtype) if fp8_ok else (build(args, device, dtype), None)
    if m8 is not None:
        set_policy(m8, _fp8_policies(device)["serving"])
    graphs_apply = device.type == "cuda"
    out = {"device": device_name(device), "torch": torch.__version__,
           "graphs": "cuda" if graphs_apply else "n/a on cpu", "rows": []}
    _burn([Engine(m16, None)], max(sizes), 0.0 if args.tiny else 3.0)
    for size in sizes:
        runs = [("bf16", m16)] + ([("fp8", m8)] if m8 is not None and size == max(sizes) else [])
        for weights, model in runs:
            for guidance in (1.0, 4.0):
                out["rows"].append({"weights": weights, **_graphs_row(model, device, size, guidance, args)})
    small = min(sizes)
    out["two_jobs"] = _two_jobs(m16, device, small, args)
    out["cancel"] = _cancel_then_new(m16, device, small, args)
    out["next_request"] = [_next_request(m, device, small, args) for m in ([m16, m8] if m8 is not None else [m16])]
    for row, weights in zip(out["next_request"], ("bf16", "fp8")):
        row["weights"] = weights
    _print_graphs(out)
    return out


def _print_graphs(out: dict) -> None:
    print(f"device: {out['device']}, torch {out['torch']}; CUDA graphs: {out['graphs']}")
    print("\n| image | weights | guidance (branches) | eager s/step | graphs s/step | speedup | final x equal "
          "| captures / replays | capture failure |")
    print("|---|---|---|---:|---:|---:|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['size']}² | {r['weights']} | {r['guidance']:g} ({2 if r['guidance'] > 1 else 1}) | "
              f"{r['eager_s']:.4f} | {r['graphs_s']:.4f} | {r['speedup']:.3f}x | {r['bits_equal']} | "
              f"{r['captures']} / {r['replays']} | {r['failure'] or ''} |")
    t = out["two_jobs"]
    gc = t["graphs_counts"]
    print(f"\ntwo {t['size']}² CFG jobs together, {t['steps']} steps: eager {t['eager_s']:.4f} s/step, graphs "
          f"{t['graphs_s']:.4f} s/step ({t['eager_s'] / t['graphs_s']:.3f}x); final x equal {t['bits_equal']}; "
          f"captures {gc['captures']}, replays {gc['replays']}{'; failure ' + gc['failure'] if gc['failure'] else ''}")
    c = out["cancel"]
    cc = c["graphs_counts"]
    print(f"a {c['size']}² job dropped after 4 steps, then a new one: final x of the new job equal {c['bits_equal']}; "
          f"captures {cc['captures']}, replays {cc['replays']}{'; failure ' + cc['failure'] if cc['failure'] else ''}")
    print("\n| next request of a shape | weights | steps | eager s | graphs by job s | graphs by shape s | by shape / "
          "by job | final x equal | captures by job / by shape | held between requests MiB, by job / by shape |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|---|")
    for r in out["next_request"]:
        print(f"| {r['size']}², guidance 1 | {r['weights']} | {r['steps']} | {r['eager_s']:.4f} | "
              f"{r['by_job_s']:.4f} | {r['by_shape_s']:.4f} | {r['by_shape_s'] / r['by_job_s']:.3f} | "
              f"{r['bits_equal']} | {r['by_job_counts']['captures']} / {r['by_shape_counts']['captures']} | "
              f"{r['by_job_idle_mb']:.0f} / {r['by_shape_idle_mb']:.0f} |")


# ----------------------------------------------------------------------------- fused residual add + RMSNorm
@contextlib.contextmanager
def addnorm_switch(on: bool):
    """The model's residual adds fused into the next RMSNorm (on) or run apart (U1SERVE_FUSED_ADD_NORM=0);
    read by every forward, so an engine's next eager step or capture follows it (a held graph keeps what
    it captured: each timed run below admits a new job, i.e. a new capture)."""
    from services.base.knobs import FUSED_ADD_NORM
    old = FUSED_ADD_NORM.raw()
    os.environ[FUSED_ADD_NORM.name] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(FUSED_ADD_NORM.name)
        else:
            os.environ[FUSED_ADD_NORM.name] = old


def _addnorm_row(model, size: int, graphs: str, args) -> dict:
    """Single-branch s/step unfused vs fused (rounds interleaved; with graphs the timed steps are replays)
    and the final x of one whole job each, compared bit for bit."""
    engine = Engine(model, None, cuda_graphs=graphs)
    w, n = max(args.warmup, 2), args.steps
    samples: dict[str, list] = {"unfused": [], "fused": []}
    for r in range(1 if args.tiny else 2):
        for name in samples:
            with addnorm_switch(name == "fused"):
                samples[name] += step_times(engine, spec(f"{name}{r}", size, w + n + 1, 1.0), w, n)
    xs = {}
    for name in samples:
        with addnorm_switch(name == "fused"):
            xs[name], _ = run_to_end(engine, [spec(f"equal-{name}", size, max(4, w + 2), 1.0)])
    u, f = statistics.median(samples["unfused"]), statistics.median(samples["fused"])
    return {"size": size, "graphs": graphs, "unfused_s": u, "fused_s": f, "speedup": u / f,
            "bits_equal": torch.equal(xs["fused"]["equal-fused"], xs["unfused"]["equal-unfused"]),
            **_graph_counts(engine)}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def _addnorm_kernels(args, model, device, dtype) -> list[dict]:
    """At a layer's shape [rows, hidden]: the fused kernels vs torch's add then the norm kernel, bit for bit
    (the sum, the normalised row / its fp8 q and scale) and us per call (`_kernel_us`)."""
    from kernels.norm_act import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8
    M, h = (64 if args.tiny else 4096), model.cfg.llm.hidden_size
    g = torch.Generator(device=device).manual_seed(4)
    x = (4 * torch.randn(M, h, generator=g, device=device)).to(dtype)
    d = torch.randn(M, h, generator=g, device=device).to(dtype)
    w = (torch.rand(h, generator=g, device=device) + 0.5).to(dtype)
    eps = model.cfg.llm.rms_norm_eps
    s = x + d
    s1, y1 = add_rms_norm(x, d, w, eps)
    s8, q8, sc8 = add_rms_norm_fp8(x, d, w, eps)
    q, sc = rms_norm_fp8(s, w, eps)
    return [{"kernel": f"add + RMSNorm [{M}, {h}]",
             "bits_equal": _same_bits(s1, s) and _same_bits(y1, rms_norm(s, w, eps)),
             "unfused_us": _kernel_us(lambda: rms_norm(x + d, w, eps), device),
             "fused_us": _kernel_us(lambda: add_rms_norm(x, d, w, eps), device)},
            {"kernel": f"add + RMSNorm -> fp8 [{M}, {h}]",
             "bits_equal": _same_bits(s8, s) and _same_bits(q8, q) and _same_bits(sc8, sc),
             "unfused_us": _kernel_us(lambda: rms_norm_fp8(x + d, w, eps), device),
             "fused_us": _kernel_us(lambda: add_rms_norm_fp8(x, d, w, eps), device)}]


@torch.inference_mode()
def part_addnorm(args, device, dtype) -> dict:
    """The residual add fused into the next RMSNorm (kernels/norm_act.py add_rms_norm*) vs separate (the env
    switch flipped, same engine and model): single-branch s/step at --sizes, bf16 and fp8 as served, eager and
    (CUDA) with CUDA graphs; the final x of a whole job fused vs unfused bit for bit; the kernels alone."""
    sizes = bench_sizes(args)
    fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    m16, m8 = _fp8_models(args, device, dtype) if fp8_ok else (build(args, device, dtype), None)
    if m8 is not None:
        set_policy(m8, _fp8_policies(device)["serving"])
    out = {"device": device_name(device), "torch": torch.__version__, "rows": [],
           "kernels": _addnorm_kernels(args, m16, device, dtype)}
    _burn([Engine(m16, None)], max(sizes), 0.0 if args.tiny else 3.0)
    for size in sizes:
        for weights, model in [("bf16", m16)] + ([("fp8", m8)] if m8 is not None else []):
            for graphs in ("off", "on") if device.type == "cuda" else ("off",):
                out["rows"].append({"weights": weights, **_addnorm_row(model, size, graphs, args)})
    _print_addnorm(out)
    return out


def _print_addnorm(out: dict) -> None:
    print(f"device: {out['device']}, torch {out['torch']}; residual add fused into the next RMSNorm "
          f"(U1SERVE_FUSED_ADD_NORM=1) vs apart (=0), single-branch step")
    print("\n| image | weights | CUDA graphs | unfused s/step | fused s/step | speedup | final x equal | target |")
    print("|---|---|---|---:|---:|---:|---|---|")
    for r in out["rows"]:
        target = "<= 0.085 s" if r["size"] == 2048 and r["weights"] == "fp8" else ""
        fail = f" (capture failure: {r['failure']})" if r["failure"] else ""
        print(f"| {r['size']}² | {r['weights']} | {r['graphs']}{fail} | {r['unfused_s']:.4f} | {r['fused_s']:.4f} | "
              f"{r['speedup']:.3f}x | {r['bits_equal']} | {target} |")
    print("\n| kernel | unfused us (torch add + norm kernel) | fused us | bits equal |\n|---|---:|---:|---|")
    for k in out["kernels"]:
        print(f"| {k['kernel']} | {k['unfused_us']:.1f} | {k['fused_us']:.1f} | {k['bits_equal']} |")


# ----------------------------------------------------------------------------- fp8 quantised by the producers
FUSED_CONFIGS = (("bf16", "bf16"), ("fp8-today", "fp8 as served today (bf16 GEMMs < 2,048 rows)"),
                 ("fp8-unfused", "fp8 every GEMM, quantiser in the GEMM layers"),
                 ("fp8-fused", "fp8 every GEMM, quantised by the producers"))


@torch.inference_mode()
def part_fp8_fused(args, device, dtype) -> dict:
    """Single-branch step at --sizes: bf16; fp8 as served today (GemmPolicy.for_device: model-dtype GEMMs below
    2,048 rows); fp8 on every GEMM with the activations quantised in the GEMM layers (GemmPolicy.fused False:
    U1SERVE_FP8_FUSED=0) and by their producers (RMSNorm / add + RMSNorm / silu*mul -> fp8: the default), fast
    accumulation as served; eager and (CUDA) with CUDA graphs; rounds interleaved, median s/step. Issue 25's
    targets: 1024² >= 1.3x bf16, 2048² toward the fp8-GEMM floor 0.070 s."""
    from services.model.quant import GemmPolicy
    sizes = bench_sizes(args)
    m16, m8 = _fp8_models(args, device, dtype)
    serving = _fp8_policies(device)["serving"]
    policies = {"bf16": None, "fp8-today": serving,
                "fp8-unfused": GemmPolicy(0, serving.fast_accum_min_tokens, False),
                "fp8-fused": GemmPolicy(0, serving.fast_accum_min_tokens, True)}
    modes = ("off", "on") if device.type == "cuda" else ("off",)
    engines = {(w, g): Engine(m16 if w == "bf16" else m8, None, cuda_graphs=g) for w in ("bf16", "fp8") for g in modes}
    out = {"device": device_name(device), "torch": torch.__version__, "serving_policy": str(serving), "rows": []}
    _burn([engines[("bf16", "off")], engines[("fp8", "off")]], max(sizes), 0.0 if args.tiny else 3.0)
    w, n = max(args.warmup, 2), args.steps       # graphs capture on a composition's 2nd step
    for size in sizes:
        for graphs in modes:
            samples: dict[str, list] = {name: [] for name in policies}
            for r in range(1 if args.tiny else 2):
                for name, pol in policies.items():
                    if pol is not None:
                        set_policy(m8, pol)
                    engine = engines[("bf16" if pol is None else "fp8", graphs)]
                    samples[name] += step_times(engine, spec(f"{name}-{r}", size, w + n + 1, 1.0), w, n)
            med = {name: statistics.median(ts) for name, ts in samples.items()}
            out["rows"].append({"size": size, "rows_per_gemm": (size // 32) ** 2, "graphs": graphs, "s_per_step": med,
                                "speedup_vs_bf16": {k: med["bf16"] / v for k, v in med.items()},
                                **{f"{k}_counts": _graph_counts(e) for (k, g), e in engines.items() if g == graphs}})
    set_policy(m8, serving)
    _print_fp8_fused(out)
    return out


def _print_fp8_fused(out: dict) -> None:
    print(f"device: {out['device']}, torch {out['torch']}; serving policy {out['serving_policy']}; single-branch "
          f"s/step (speedup vs bf16)")
    print("\n| image | CUDA graphs | " + " | ".join(label for _, label in FUSED_CONFIGS) + " | target |")
    print("|---|---|" + "---:|" * len(FUSED_CONFIGS) + "---|")
    for r in out["rows"]:
        cells = [f"{r['s_per_step'][k]:.4f} ({r['speedup_vs_bf16'][k]:.2f}x)" for k, _ in FUSED_CONFIGS]
        target = {1024: ">= 1.3x bf16", 2048: "toward 0.070 s (fp8-GEMM floor)"}.get(r["size"], "")
        print(f"| {r['size']}² | {r['graphs']} | " + " | ".join(cells) + f" | {target} |")
    for r in out["rows"]:   # what the policy threshold (GemmPolicy.min_tokens, 2,048 on CUDA) should say
        t = r["s_per_step"]
        if r["rows_per_gemm"] < 2048 and t["fp8-fused"] < min(t["bf16"], t["fp8-today"]):
            print(f"\n{r['size']}² with graphs {r['graphs']}: fp8 on every GEMM beats what is served today "
                  f"({t['fp8-today'] / t['fp8-fused']:.2f}x): try U1SERVE_FP8_MIN_TOKENS={r['rows_per_gemm']}")


def part_formats(args, device, dtype) -> dict:
    from bench.genperf_formats import part_formats as run   # bf16 / fp8 / int8 / gguf (its own module)
    return run(args, device, dtype)


PARTS = {"fp8": part_fp8, "fp8-profile": part_fp8_profile, "cache": part_cache, "preset": part_preset,
         "warmstart": part_warmstart, "graphs": part_graphs, "addnorm": part_addnorm, "fp8-fused": part_fp8_fused,
         "formats": part_formats}
