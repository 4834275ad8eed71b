"""The fused fp8 producers (kernels/fp8_quant.py, kernels/norm_act.py): every launch variant timed and
checked bit for bit, at the 8B geometry (hidden 4096, intermediate 12288).

Usage (CUDA, < 90 s on an H200): python -m bench.bench_fp8_kernels [--json PATH] [--variants a,b,..]
CPU smoke (Triton interpreter, tiny shapes): python -m bench.bench_fp8_kernels --smoke
Kernels: `quant` (the standalone quantiser [rows, n]), `rms` (RMSNorm -> fp8 [rows, n]), `silu` (silu(gate)*up
-> fp8 on the two halves of one [rows, 2n] gate|up output). Each variant's median time (triton.testing.do_bench:
L2 flushed before every run) becomes GB/s from its compulsory traffic (read once, write once), next to the plain
bf16 kernels (rms_norm, silu_mul on contiguous operands), the torch references and a bf16 copy of the input.
Fused vs unfused (the activation written in bf16 by the plain kernel, then the standalone quantiser: two
launches and a bf16 round trip, vs the producer quantising what it computes): RMSNorm, add + RMSNorm (n = 4096)
and silu*mul (n = 12288; unfused on contiguous gate / up) per row count: GPU us (do_bench), host us per call
(the launch path's CPU time: 100 calls queued without a sync; what an eager step pays per launch where the host,
not the GPU, is the bottleneck, e.g. 1024²), and bits (fused vs unfused: equal, else the largest distance in
e4m3 codes).
Bit checks, on inputs with zeros, -0, tiny negatives, huge values, all-zero rows, rows whose scale is a power of
two (so that e4m3 ties occur) and n not a power of two: the quantiser vs `quant_fp8_rowwise_ref` (torch on the
same device); the fused producers vs their plain kernel + the quantiser (the same bits by design; vs the torch
references they differ where the plain kernels do, a few ULPs of exp / rsqrt, reported as counts).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:   # before triton is imported: the interpreter runs the kernels on CPU
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["U1SERVE_KERNELS"] = "triton"
os.environ.pop("U1SERVE_FP8_VARIANT", None)

import torch  # noqa: E402

from kernels.fp8_quant import ROUND_ENV, fp8_launch, quant_fp8_rowwise, quant_fp8_rowwise_ref  # noqa: E402
from kernels.norm_act import (add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8, rms_norm_fp8_ref,  # noqa: E402
                              silu_mul, silu_mul_fp8, silu_mul_fp8_ref)

DT = torch.bfloat16
EPS = 1e-6
# variant specs (kernels/fp8_quant.py fp8_launch); "+explicit": the same launch rounding in fp32 before the cast
GPU_VARIANTS = ["auto", "legacy", "row", "pieces", "pieces+explicit", "twopass-1024", "twopass-2048"]
SMOKE_VARIANTS = ["auto", "legacy", "row", "pieces-32", "twopass-32"]
RMS_VARIANTS = ("auto", "legacy", "row", "pieces")   # RMSNorm keeps its row layout: only the arithmetic differs


def run_variant(fn, spec: str):
    """fn(variant) with the rounding of `spec` (a `+explicit` suffix: fp32 rounding before the cast)."""
    name, _, extra = spec.partition("+")
    old = os.environ.pop(ROUND_ENV, None)
    if extra == "explicit":
        os.environ[ROUND_ENV] = "explicit"
    try:
        return fn(name)
    finally:
        os.environ.pop(ROUND_ENV, None)
        if old is not None:
            os.environ[ROUND_ENV] = old


def bench_ms(fn, dev) -> float:
    if dev == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


# ---- inputs -------------------------------------------------------------------------------------------------
def tricky(rows: int, n: int, dev, gen, scale: float = 1.0, huge: float = 3.0e38) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes over 1e-6..1e6, plus: an all-zero row, zeros and -0 inside rows,
    tiny negatives, huge values, and rows with amax 448 * 2^j (scale 2^j: x / s is exact, e4m3 ties occur).
    (Rows with inf / NaN are not compared: their bits are unspecified.)"""
    x = torch.randn(rows, n, generator=gen, device=dev) * scale
    x *= torch.logspace(-6, 6, rows, device=dev)[:, None] if rows > 8 else 1.0
    x = x.to(DT)
    if rows >= 8:
        x[0] = 0.0
        x[1, ::7] = -0.0
        x[1, 1::7] = -1e-30
        x[2, : n // 2] = -1e-30                         # a row of tiny negatives and one normal value
        x[3, ::5] = huge                                # huge (bf16 max 3.39e38)
        x[3, 1::5] = -huge / 3
        for r, j in ((4, 0), (5, -7), (6, 5)):          # power-of-two scales: every e4m3 tie in range
            grid = torch.arange(n, device=dev) % 512    # 9 significant bits at most -> exact in bf16 after scaling
            v = (grid.float() / 511.0 * 448.0).to(DT).float()
            v[0] = 448.0
            x[r] = (v * (-1.0) ** torch.arange(n, device=dev) * 2.0 ** j).to(DT)
        x[7, 0::2] = 0.0
    return x


def mismatches(got, want, inp, k: int = 5) -> list[dict]:
    (q, s), (rq, rs) = got, want
    out = []
    rows = (s != rs).reshape(-1).nonzero().reshape(-1).tolist()[:k]
    for r in rows:
        out.append({"row": r, "kernel_scale": float(s[r, 0]), "ref_scale": float(rs[r, 0])})
    bad = (q.view(torch.uint8) != rq.view(torch.uint8)).nonzero()[:k].tolist()
    for r, c in bad:
        out.append({"row": r, "col": c, "input": float(inp[r, c]), "kernel_byte": f"0x{int(q[r, c].view(torch.uint8)):02x}",
                    "ref_byte": f"0x{int(rq[r, c].view(torch.uint8)):02x}", "ref_scale": float(rs[r, 0])})
    return out


def n_bad(got, want) -> int:
    return int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()) + int((got[1] != want[1]).sum())


def producer_runs(variants, x, xr, w, gate, up):
    """(kernel, variant spec, fn(variant)) for each producer and variant: the quantiser on x, RMSNorm -> fp8
    on xr with weight w, silu*mul -> fp8 on gate / up (RMSNorm only where the variant changes it)."""
    for kern in ("quant", "rms", "silu"):
        for spec in variants:
            if kern == "rms" and spec.split("-")[0].split("+")[0] not in RMS_VARIANTS:
                continue
            yield kern, spec, {"quant": lambda v: quant_fp8_rowwise(x, v),
                               "rms": lambda v: rms_norm_fp8(xr, w, EPS, v),
                               "silu": lambda v: silu_mul_fp8(gate, up, v)}[kern]


def check_bits(variants, dev, gen, shapes) -> list[dict]:
    res = []
    for rows, n in shapes:
        x = tricky(rows, n, dev, gen)
        gu = tricky(rows, 2 * n, dev, gen, 3.0, 1e18)   # silu*mul of huge values stays finite
        gate, up = gu[:, :n], gu[:, n:]
        xr = tricky(rows, n, dev, gen)
        w = (torch.rand(n, generator=gen, device=dev) + 0.5).to(DT)
        w[: n // 8] *= -1                                # negative weights: -0 from zero inputs
        want = {"quant": quant_fp8_rowwise_ref(x),
                "rms": quant_fp8_rowwise_ref(rms_norm(xr, w, EPS)),
                "silu": quant_fp8_rowwise_ref(silu_mul(gate.contiguous(), up.contiguous()))}
        torch_ref = {"rms": rms_norm_fp8_ref(xr, w, EPS), "silu": silu_mul_fp8_ref(gate, up)}
        inputs = {"quant": x, "rms": xr, "silu": gate}
        for kern, spec, fn in producer_runs(variants, x, xr, w, gate, up):
                got = run_variant(fn, spec)
                if dev != "cpu":
                    torch.cuda.synchronize()
                bad = mismatches(got, want[kern], inputs[kern])
                row = {"kernel": kern, "variant": spec, "rows": rows, "n": n, "bits_equal": not bad,
                       "vs": "torch quantiser" if kern == "quant" else "plain kernel + torch quantiser",
                       "first_mismatches": bad}
                if kern in torch_ref:
                    row["differ_from_torch_reference"] = n_bad(got, torch_ref[kern])
                res.append(row)
    return res


# ---- timing -------------------------------------------------------------------------------------------------
def time_all(variants, dev, gen, row_list, col_list) -> list[dict]:
    res = []
    for n in col_list:
        for rows in row_list:
            x = torch.randn(rows, n, generator=gen, device=dev).to(DT)
            gu = (3 * torch.randn(rows, 2 * n, generator=gen, device=dev)).to(DT)
            gate, up = gu[:, :n], gu[:, n:]
            gc, uc = gate.contiguous(), up.contiguous()
            w = (torch.rand(n, generator=gen, device=dev) + 0.5).to(DT)
            e = rows * n
            io = {"quant": 3 * e, "rms": 3 * e, "silu": 5 * e}          # bytes: bf16 in, fp8 out
            base = {"bf16 copy": (lambda: x.clone(), 4 * e),
                    "rms_norm bf16": (lambda: rms_norm(x, w, EPS), 4 * e),
                    "silu_mul bf16": (lambda: silu_mul(gc, uc), 6 * e),
                    "torch quant_fp8_rowwise_ref": (lambda: quant_fp8_rowwise_ref(x), 3 * e),
                    "torch rms_norm_fp8_ref": (lambda: rms_norm_fp8_ref(x, w, EPS), 3 * e),
                    "torch silu_mul_fp8_ref": (lambda: silu_mul_fp8_ref(gate, up), 5 * e)}
            for name, (fn, nbytes) in base.items():
                ms = bench_ms(fn, dev)
                res.append({"kernel": "baseline", "variant": name, "rows": rows, "n": n, "ms": ms,
                            "GBps": nbytes / ms / 1e6})
            for kern, spec, fn in producer_runs(variants, x, x, w, gate, up):
                ms = bench_ms(lambda: run_variant(fn, spec), dev)
                launch = fp8_launch(n, spec.partition("+")[0], rows)
                res.append({"kernel": kern, "variant": spec, "launch": launch.spec(), "rows": rows, "n": n,
                            "ms": ms, "GBps": io[kern] / ms / 1e6})
    return res


def host_us(fn, dev, calls: int = 100) -> float:
    """CPU time of one call's launch path: `calls` calls queued without a sync (the GPU catches up after)."""
    fn()
    if dev != "cpu":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    if dev != "cpu":
        torch.cuda.synchronize()
    return us


def code_distance(got, want) -> int:
    """The largest distance in e4m3 codes between two quantised rows sets (0: the same values; +-0 alike)."""
    def ordinal(q):
        c = q.view(torch.uint8).to(torch.int16)
        return torch.where(c >= 128, -(c - 128), c)
    return int((ordinal(got[0]) - ordinal(want[0])).abs().max())


def fused_vs_unfused(dev, gen, row_list, hidden: int, inter: int, calls: int) -> list[dict]:
    """Per producer and row count: unfused (plain kernel in bf16, then the quantiser) vs fused."""
    res = []
    for rows in row_list:
        x = torch.randn(rows, hidden, generator=gen, device=dev).to(DT)
        d = torch.randn(rows, hidden, generator=gen, device=dev).to(DT)
        w = (torch.rand(hidden, generator=gen, device=dev) + 0.5).to(DT)
        gu = (3 * torch.randn(rows, 2 * inter, generator=gen, device=dev)).to(DT)
        gate, up = gu[:, :inter], gu[:, inter:]
        gc, uc = gate.contiguous(), up.contiguous()
        pairs = [("RMSNorm -> fp8", hidden, lambda: quant_fp8_rowwise(rms_norm(x, w, EPS)),
                  lambda: rms_norm_fp8(x, w, EPS)),
                 ("add + RMSNorm -> fp8", hidden, lambda: quant_fp8_rowwise(add_rms_norm(x, d, w, EPS)[1]),
                  lambda: add_rms_norm_fp8(x, d, w, EPS)[1:]),
                 ("silu*mul -> fp8", inter, lambda: quant_fp8_rowwise(silu_mul(gc, uc)),
                  lambda: silu_mul_fp8(gate, up))]
        for name, n, unfused, fused in pairs:
            u, f = unfused(), fused()
            row = {"producer": name, "rows": rows, "n": n, "launch": fp8_launch(n, None, rows).spec(),
                   "unfused_us": bench_ms(unfused, dev) * 1e3, "fused_us": bench_ms(fused, dev) * 1e3,
                   "unfused_host_us": host_us(unfused, dev, calls), "fused_host_us": host_us(fused, dev, calls),
                   "bits_equal": n_bad(f, u) == 0, "max_code_distance": code_distance(f, u)}
            res.append(row)
    return res


def print_fused(rows: list[dict]) -> None:
    print("\n## fused vs unfused producers (GPU us: do_bench median; host us: launch path per call)\n")
    print("| producer | rows | n | launch | unfused GPU us | fused GPU us | saved | unfused host us | fused host us "
          "| bits equal (max code distance) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['producer']} | {r['rows']} | {r['n']} | {r['launch']} | {r['unfused_us']:.1f} | "
              f"{r['fused_us']:.1f} | {r['unfused_us'] - r['fused_us']:.1f} | {r['unfused_host_us']:.1f} | "
              f"{r['fused_host_us']:.1f} | {r['bits_equal']} ({r['max_code_distance']}) |")


def print_tables(timings, checks, peak_note) -> None:
    print(f"\n## timings (median, L2 flushed; GB/s of compulsory traffic; {peak_note})\n")
    cols = sorted({r["n"] for r in timings})
    for n in cols:
        rowsets = sorted({r["rows"] for r in timings if r["n"] == n})
        names = []
        for r in timings:
            if r["n"] == n and (r["kernel"], r["variant"]) not in names:
                names.append((r["kernel"], r["variant"]))
        print(f"### n = {n}\n")
        print("| kernel | variant | " + " | ".join(f"{m} rows us (GB/s)" for m in rowsets) + " |")
        print("|---|---|" + "---:|" * len(rowsets))
        for kern, var in names:
            cells = []
            for m in rowsets:
                r = next(r for r in timings if r["n"] == n and r["rows"] == m and r["kernel"] == kern
                         and r["variant"] == var)
                cells.append(f"{r['ms'] * 1e3:.1f} ({r['GBps']:.0f})")
            print(f"| {kern} | {var} | " + " | ".join(cells) + " |")
        print()
    print("## bit checks\n")
    for c in checks:
        extra = f", vs torch reference: {c['differ_from_torch_reference']} value(s) differ" \
            if "differ_from_torch_reference" in c else ""
        print(f"{c['kernel']:5s} {c['variant']:16s} [{c['rows']}, {c['n']}] vs {c['vs']}: bits equal "
              f"{c['bits_equal']}{extra}")
        for m in c["first_mismatches"]:
            print(f"    mismatch {m}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--variants", default=None, help="comma list of variant specs (default: the GPU set)")
    ap.add_argument("--rows", default="1024,2048,4096,8192")
    ap.add_argument("--cols", default="4096,12288")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke for the CPU (interpreter) run")
        return 2
    t0 = time.time()
    variants = args.variants.split(",") if args.variants else SMOKE_VARIANTS if args.smoke else GPU_VARIANTS
    rows = [4, 8] if args.smoke else [int(r) for r in args.rows.split(",")]
    cols = [64, 96] if args.smoke else [int(c) for c in args.cols.split(",")]
    check_shapes = [(12, 96), (9, 37)] if args.smoke else [(512, 4096), (512, 12288), (64, 333)]
    gen = torch.Generator(device=dev).manual_seed(1234)
    import triton
    env = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "CPU (Triton interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "variants": variants,
           "default": {n: fp8_launch(n).spec() for n in cols}}
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}; default launch per n: {env['default']}")
    checks = check_bits(variants, dev, gen, check_shapes)
    timings = [] if args.skip_timing else time_all(variants, dev, gen, rows, cols)
    hidden, inter = (64, 96) if args.smoke else (4096, 12288)
    fused = fused_vs_unfused(dev, gen, rows[:1] if args.smoke else rows, hidden, inter, 1 if args.smoke else 100)
    peak = "H200 HBM3e peak 4.8 TB/s" if dev == "cuda" else "CPU interpreter: timings meaningless"
    print_tables(timings, checks, peak)
    print_fused(fused)
    ok = all(c["bits_equal"] for c in checks)
    print(f"\nall bit checks equal: {ok}; {time.time() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "timings": timings, "checks": checks, "all_bits_equal": ok, "fused": fused,
                       "seconds": time.time() - t0}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
