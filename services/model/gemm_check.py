"""A known-answer check of the GEMMs a model is about to serve, on its own device, before the first request.

Why: under an MPS client capped at 85 % of an H100's SMs (112 seen), cuBLAS returned wrong values for the generation
branch's plain bf16 GEMMs, the same wrong values every time, eager or graphed (2026-12-06, deploy/mps_probe.py run
"check": `mlp_mot_gen.gate_proj`, input (128, 4096) x weight (12288, 4096), off by 1.48 of its largest value vs
fp32; at 1024² the timestep embedder's (1024, 256) x (4096, 256)); the denoiser's state then overflowed to NaN a few
steps later and every image was answered `500 nonfinite_output`. No ordering between streams is involved (the op
rerun alone on an idle GPU is wrong), so no stream discipline can guard against it; what can is asking the device
once, at start, whether each GEMM shape the model serves comes out right.

`check_linears` runs every distinct float Linear of a model (in and out features, bias or not) at each given
row count, from a seeded input and the module's own weights, as the model runs it (`F.linear`, the served dtype and
device), and compares with the same op in fp32 on the same device. A result off by more than `TOL` of the fp32
output's largest value (bf16 rounding of a 12k-long dot product is ~1e-2), or not finite, is a failure, named with
its shape. Quantised linears (fp8, int8: other modules, their own kernels) are counted as skipped. deploy/module_check.py (the probe's in-step check) uses the same comparison.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

TOL = 0.05
MPS_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"    # set in an MPS client capped to a share of the SMs
MODES = ("auto", "on", "off")


class GemmCheckFailed(RuntimeError):
    """A GEMM the model serves came out wrong on this device (the engine must not serve)."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max |ref| (inf when out is not finite where ref is)."""
    diff = (out.float() - ref).abs().max()
    return float(diff / ref.abs().max().clamp_min(1e-12))


def fp32_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The Linear's op in fp32 on the same device: the reference."""
    return F.linear(x.float(), module.weight.float(), None if module.bias is None else module.bias.float())


def wanted(mode: str, device: torch.device, green_sm_percent: int = 0) -> bool:
    """Whether to check: `on` always, `off` never, `auto` on CUDA where the engine sees part of the GPU (an MPS
    client with an SM cap, or a green context): the settings where a library picks kernels full-GPU runs never
    exercise, and where the wrong GEMMs were found."""
    if mode not in MODES:
        raise ValueError(f"gemm check must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return device.type == "cuda" and bool(os.environ.get(MPS_PERCENT_ENV) or green_sm_percent)


def distinct_linears(model: nn.Module) -> tuple[dict[tuple, tuple[str, nn.Linear]], int]:
    """({(in, out, bias, dtype): (first name, module)} of the float Linears that run as served here (torch's, and
    ours with the skinny GEMM for few rows), the count of other linear modules (quantised: their own kernels)."""
    from .modules import Linear
    found: dict[tuple, tuple[str, nn.Linear]] = {}
    skipped = 0
    for name, m in model.named_modules():
        if type(m) not in (nn.Linear, Linear) or m.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            skipped += isinstance(m, nn.Linear) or "linear" in type(m).__name__.lower()
            continue
        key = (m.in_features, m.out_features, m.bias is not None, m.weight.dtype)
        found.setdefault(key, (name, m))
    return found, skipped


@torch.inference_mode()       # as the engine's steps run (a Linear's kernel choice can depend on grad mode)
def check_linears(model: nn.Module, rows: tuple[int, ...], tol: float = TOL, seed: int = 0) -> dict:
    """Every distinct plain Linear of `model` at each row count in `rows` against fp32 (module doc). Returns
    {"checked": N, "skipped": M, "failures": [{"module", "shape", "rows", "rel_err"}, ...]}."""
    linears, skipped = distinct_linears(model)
    g = torch.Generator(device="cpu").manual_seed(seed)
    failures, checked = [], 0
    for (n_in, n_out, bias, dtype), (name, module) in linears.items():
        for r in sorted(set(rows)):
            x = torch.randn(r, n_in, generator=g).to(module.weight.device, dtype)
            err = rel_err(module(x), fp32_linear(module, x))
            checked += 1
            if not err <= tol:          # NaN compares false: a non-finite output fails too
                failures.append({"module": name, "shape": f"({r}, {n_in}) x ({n_out}, {n_in})"
                                 + (" + bias" if bias else ""), "rows": r, "rel_err": err})
    return {"checked": checked, "skipped": skipped, "failures": failures}


def require_right_gemms(model: nn.Module, rows: tuple[int, ...], where: str, tol: float = TOL) -> dict:
    """check_linears, raising GemmCheckFailed (naming each wrong shape and the device setting) when any is off."""
    result = check_linears(model, rows, tol)
    if result["failures"]:
        worst = "; ".join(f"{f['module']} {f['shape']}: off by {f['rel_err']:.3g}" for f in result["failures"][:4])
        mps = os.environ.get(MPS_PERCENT_ENV)
        raise GemmCheckFailed(
            f"{where}: {len(result['failures'])} of {result['checked']} GEMMs came out wrong on this device against "
            f"fp32 ({worst})" + (f", under an MPS client capped at {mps} % of the SMs" if mps else "")
            + ": the engine would serve wrong (then NaN) images. Run without the cap (--gpu-sharing time-slice, or "
            "--colocate-engines fused) or with another --gen-sm-percent (docs/benchmarks/generation.md, NaN images "
            "under MPS); --gemm-check off skips this check")
    return result


def rows_for_sizes(sizes: list[tuple[int, int]], block: int, extra: tuple[int, ...] = (128,)) -> tuple[int, ...]:
    """The row counts a denoise step's GEMMs see at these sizes: an image's tokens, once (guidance 1) and twice
    (both CFG branches in one forward), plus `extra` (the probe's first wrong shape had 128 rows)."""
    rows = set(extra)
    for w, h in sizes:
        tokens = (w // block) * (h // block)
        rows.update((tokens, 2 * tokens))
    return tuple(sorted(rows))
