"""int8 W8A8 for the dense Linear layers of a decoder branch: the fp8 path's layout on int8 tensor cores.

For GPUs without fp8 (Ampere: A100, A10, L4 has fp8 but older parts do not; int8 tensor cores run at twice
bf16's rate there). The same policy of what is quantised as fp8 (services/model/quant.py: q|k|v as a q GEMM
and a k|v GEMM, o, gate|up, down of each branch's dense MLPs; attention, norms, embedders, the fm_head, MoE
experts and routers stay in the model dtype) and the same module structure: these classes subclass the fp8
ones and change only the number format:
- weights: int8 with one fp32 scale per output channel (computed at load, or read from an int8 checkpoint:
  `X.weight` int8 + `X.weight_scale`, written by `u1serve convert --to int8`);
- activations: int8 with one scale per token, computed on the fly (`kernels.int8_gemm.quant_int8_rowwise`);
  the RMSNorms stay plain (the GEMM that reads their output quantises it, once for q and k|v);
- GEMM: `kernels.int8_gemm.int8_mm` (`torch._int_mm` on CUDA, exact int32 elsewhere; same bits).
Every row count runs int8 (no model-dtype copy of the weights is kept: half the bf16 weight memory).
"""
from __future__ import annotations

import torch

from kernels.int8_gemm import int8_mm, int8_mm_ref, quant_int8_rowwise
from kernels.norm_act import silu_mul

from .quant import Fp8Activation, Fp8Linear, Fp8QKV, Fp8SwiGLU, Fp8Unsupported, GemmPolicy, Scheme


class Int8Linear(Fp8Linear):
    """Fp8Linear's layer with int8 weights and activations (per-channel / per-token fp32 scales)."""
    WEIGHT_DTYPE = torch.int8
    quantize_rows = staticmethod(quant_int8_rowwise)

    def gemm(self, x: Fp8Activation) -> torch.Tensor:
        return int8_mm(x.q, self.weight, x.scale, self.weight_scale, x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr().replace("fp8 e4m3", "int8")


class Int8QKV(Fp8QKV):
    """q and k|v GEMMs on one int8-quantised activation."""


class Int8SwiGLU(Fp8SwiGLU):
    """gate|up as one int8 GEMM; silu(gate) * up then quantised per token for the down GEMM."""

    def silu_mul_quantized(self, gate: torch.Tensor, up: torch.Tensor):
        return quant_int8_rowwise(silu_mul(gate, up))


def int8_policy(device) -> GemmPolicy:
    """int8 at every row count (`int8_mm` pads short row counts itself)."""
    return GemmPolicy(0, None)


INT8_SCHEME = Scheme(Int8Linear, Int8QKV, Int8SwiGLU, None, int8_policy)


def check_int8_device(device: torch.device) -> None:
    """On CUDA run one tiny `torch._int_mm` GEMM (a short M, padded) against the exact int32 reference:
    a GPU or torch without int8 GEMMs fails here, at load, with a clear message."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    g = torch.Generator(device=device).manual_seed(0)
    qx, sx = quant_int8_rowwise(torch.randn(5, 64, device=device, generator=g))
    qw, sw = quant_int8_rowwise(torch.randn(48, 64, device=device, generator=g))
    try:
        got = int8_mm(qx, qw, sx, sw.t(), torch.float32)
    except Exception as e:
        raise Fp8Unsupported(f"--quantization int8: torch._int_mm failed on {torch.cuda.get_device_name(device)} "
                             f"with torch {torch.__version__}: {e}") from e
    if not torch.equal(got, int8_mm_ref(qx, qw, sx, sw.t(), torch.float32)):
        raise Fp8Unsupported(f"torch._int_mm disagrees with the exact int32 product with torch {torch.__version__}")
