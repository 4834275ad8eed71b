"""`python -m bench.bench_generation --part formats`: the weight formats side by side on the random 8B
geometry (gen branch): CFG step time (guidance 4, P = 365 / 9) at --sizes and the GPU memory the branch's
weights take, for
    bf16        the model dtype
    fp8         `--quantization fp8` as served (GemmPolicy.for_device: below 2,048 rows the kept bf16 weights run,
                so the bf16 copy stays resident) and fp8-only (every row count fp8, no bf16 copy)
    int8        `--quantization int8` (every row count int8, no bf16 copy)
    gguf:TYPE   dequantised at load (services/model/gguf_io.py): step time and memory are bf16's by construction;
                what is measured is the load-time dequantisation of one 1024 x 12288 weight (s and GB/s of bf16
                written) and the file bytes per weight
Each model is built, measured and freed in turn (one 8B gen branch resident at a time).
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from services.generation.engine import Engine

from bench.genperf_common import bench_sizes, build, device_name, spec, step_times


def _weights_gb(model) -> float:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 2 ** 30


def _row(args, device, dtype, name: str, scheme: str | None, policy=None) -> dict:
    from services.model.quant import quantize_model
    from services.model.quant_schemes import scheme as quant_scheme
    args.quantization = "none"
    model = build(args, device, dtype)
    if scheme:
        if scheme == "int8":
            from services.model.quant_int8 import check_int8_device
            check_int8_device(device)
        else:
            from services.model.quant import check_fp8_device
            check_fp8_device(device, dtype)
        quantize_model(model, ("gen",), policy=policy, scheme=quant_scheme(scheme))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row = {"format": name, "weights_gib": _weights_gb(model), "step_s": {}}
    engine = Engine(model, None)
    for size in bench_sizes(args):
        t = step_times(engine, spec(f"{name}-{size}", size, args.warmup + args.steps + 1, 4.0), args.warmup,
                       args.steps)
        row["step_s"][size] = statistics.median(t)
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _gguf_rows(args) -> list[dict]:
    import numpy as np

    from services.model.gguf_io import quantize, write_types
    import gguf
    shape = (128, 256) if args.tiny else (1024, 12288)
    x = (np.random.default_rng(0).standard_normal(shape) * 0.02).astype(np.float32)
    out = []
    for name, typ in write_types().items():
        blocks = quantize(x, typ)
        t0 = time.perf_counter()
        back = torch.from_numpy(gguf.quants.dequantize(blocks, typ)).to(torch.bfloat16)
        sec = time.perf_counter() - t0
        rel = float(np.linalg.norm(back.float().numpy() - x) / np.linalg.norm(x))
        out.append({"format": f"gguf:{name}", "bytes_per_weight": blocks.nbytes / x.size, "dequant_s": sec,
                    "dequant_gbps": back.numel() * 2 / sec / 1e9, "weight_rel_err": rel, "shape": shape})
    return out


def _int8_checks(device) -> dict:
    """The int8 kernels on this device vs their references: the quantiser's bits, `int8_mm`'s bits (the
    `_int_mm` product is exact, the epilogue the same fp32 code), at a short (padded) and a long row count."""
    from kernels.int8_gemm import int8_mm, int8_mm_ref, quant_int8_rowwise, quant_int8_rowwise_ref
    g = torch.Generator(device=device).manual_seed(0)
    k = 4096 if device.type == "cuda" else 256          # the reference's int32 product runs on the host CPU
    x = torch.randn(512, k, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(1024, k, generator=g, device=device).to(torch.bfloat16)
    (q, s), (qr, sr) = quant_int8_rowwise(x), quant_int8_rowwise_ref(x)
    qw, sw = quant_int8_rowwise(w)
    out = {"quantiser_bit_equal": bool(torch.equal(q, qr) and torch.equal(s, sr))}
    for m in (5, 512):
        got = int8_mm(q[:m], qw, s[:m], sw.t(), torch.bfloat16)
        out[f"gemm_m{m}_bit_equal"] = bool(torch.equal(got, int8_mm_ref(q[:m], qw, s[:m], sw.t(), torch.bfloat16)))
    return out


def part_formats(args, device, dtype) -> dict:
    from services.model.quant import GemmPolicy
    checks = _int8_checks(device)
    print(f"int8 kernels vs references on {device.type}: {checks}")
    rows = [_row(args, device, dtype, "bf16", None)]
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        rows.append(_row(args, device, dtype, "fp8 (served)", "fp8"))
        rows.append(_row(args, device, dtype, "fp8 (all rows)", "fp8", GemmPolicy(0, None)))
    rows.append(_row(args, device, dtype, "int8", "int8"))
    out = {"device": device_name(device), "torch": torch.__version__, "sizes": bench_sizes(args), "rows": rows,
           "gguf": _gguf_rows(args), "int8_checks": checks}
    _print(out)
    return out


def _print(out: dict) -> None:
    sizes = out["sizes"]
    print(f"device: {out['device']}, torch {out['torch']}; CFG step (guidance 4), gen branch weights")
    print("| format | weights GiB | " + " | ".join(f"s/step {s}²" for s in sizes) + " |")
    print("|---|---:|" + "---:|" * len(sizes))
    base = out["rows"][0]
    for r in out["rows"]:
        cells = " | ".join(f"{r['step_s'][s]:.4f} ({base['step_s'][s] / r['step_s'][s]:.2f}x)" for s in sizes)
        print(f"| {r['format']} | {r['weights_gib']:.2f} | {cells} |")
    for g in out["gguf"]:
        print(f"| {g['format']} (dequantised at load) | = bf16 | = bf16 |"
              + " = bf16 |" * (len(sizes) - 1))
    print("\n| GGUF type | file bytes / weight | dequantise one {}x{} weight (CPU, numpy) | bf16 GB/s | "
          "weight rel. error |".format(*out["gguf"][0]["shape"]))
    print("|---|---:|---:|---:|---:|")
    for g in out["gguf"]:
        print(f"| {g['format']} | {g['bytes_per_weight']:.4f} | {g['dequant_s']:.3f} s | {g['dequant_gbps']:.2f} | "
              f"{g['weight_rel_err']:.4f} |")
