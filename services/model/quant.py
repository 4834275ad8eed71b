"""fp8 (e4m3) weights and activations for the dense Linear layers of a decoder branch.

Scheme (W8A8, dynamic): each weight row (output channel) has its own fp32 scale, computed at load
or read from an fp8 checkpoint; each activation row (token) is quantised on the fly with its own
scale (`kernels.fp8_quant`). On CUDA the GEMM is `torch._scaled_mm` with row-wise scales (fp32
accumulate, bf16 out); elsewhere the same fp8 values are multiplied in fp32 and scaled the same way
(emulation: same quantised operands, only the summation order differs), so the path runs and is
tested on CPU.

What stays in bf16: attention itself (softmax(QK^T)V), norms, RoPE, the gen embedder convs, the time
embedders, the output head (fm_head: it writes the pixels), and MoE experts and routers (A3B: only the
attention projections of a MoE layer are quantised).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kernels.fp8_quant import FP8_DTYPE, quant_fp8_rowwise

from .modules import BRANCH_SUFFIX, SwiGLU

QUANTIZATIONS = ("none", "fp8")
MIN_CAPABILITY = (8, 9)           # fp8 tensor cores: Ada (8.9) and Hopper (9.0)
FAST_ACCUM_ENV = "U1SERVE_FP8_FAST_ACCUM"
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class Fp8Unsupported(RuntimeError):
    """fp8 was asked for where it cannot run (GPU generation, dtype, torch)."""


def scaled_mm_emulated(q_x, q_w, scale_x, scale_w, out_dtype) -> torch.Tensor:
    """What `_scaled_mm` computes, in fp32 on any device: (q_x @ q_w^T) * scale_x * scale_w.
    q_x [M, K] / q_w [N, K] fp8; scale_x [M, 1], scale_w [1, N] fp32. Products of two e4m3 values are
    exact in fp32, so only the accumulation order can differ from the tensor-core result."""
    acc = q_x.float() @ q_w.float().t()
    return (acc * scale_x * scale_w).to(out_dtype)


def scaled_mm(q_x, q_w, scale_x, scale_w, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    if q_x.is_cuda:
        # mat2 column-major: the transpose of the row-major [N, K] weight; row-wise scales
        # scale_a [M, 1] and scale_b [1, N], both fp32 (the torch >= 2.5 row-wise contract)
        return torch._scaled_mm(q_x, q_w.t(), scale_a=scale_x, scale_b=scale_w, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return scaled_mm_emulated(q_x, q_w, scale_x, scale_w, out_dtype)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and one fp32 scale per output channel."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 fast_accum: bool = False):
        super().__init__()
        if weight_q.dtype != FP8_DTYPE:
            raise ValueError(f"weight must be {FP8_DTYPE}, got {weight_q.dtype}")
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.fast_accum = fast_accum

    @classmethod
    def from_linear(cls, linear: nn.Linear, fast_accum: bool = False) -> "Fp8Linear":
        q, s = quant_fp8_rowwise(linear.weight.detach())
        return cls(q, s, linear.bias, fast_accum)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q_x, s_x = quant_fp8_rowwise(x.reshape(-1, self.in_features))
        y = scaled_mm(q_x, self.weight, s_x, self.weight_scale, x.dtype, self.fast_accum)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 row-wise"


def require_fp8(capability: tuple[int, int], name: str) -> None:
    """Raise Fp8Unsupported on a GPU without fp8 tensor cores."""
    if tuple(capability) < MIN_CAPABILITY:
        raise Fp8Unsupported(
            f"--quantization fp8 needs an fp8 GPU (compute capability >= 8.9: Ada, Hopper or newer); "
            f"{name} has {capability[0]}.{capability[1]}. Serve it in bf16 (--quantization none).")


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """Fail early and clearly where the fp8 path cannot run; on CUDA also run one tiny GEMM
    against the emulation (catches a torch whose `_scaled_mm` contract moved)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    require_fp8(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    if dtype != torch.bfloat16:
        raise Fp8Unsupported(f"--quantization fp8 on CUDA needs --dtype bfloat16 (row-wise _scaled_mm "
                             f"writes bf16), got {dtype}")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(32, 64, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 64, device=device, generator=g).to(torch.bfloat16)
    qx, sx = quant_fp8_rowwise(x)
    qw, sw = quant_fp8_rowwise(w)
    try:
        got = scaled_mm(qx, qw, sx, sw.t().contiguous(), torch.bfloat16).float()
    except Exception as e:
        raise Fp8Unsupported(f"torch._scaled_mm with row-wise scales failed on "
                             f"{torch.cuda.get_device_name(device)} with torch {torch.__version__}: {e}") from e
    want = scaled_mm_emulated(qx, qw, sx, sw.t(), torch.float32)
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    if not err < 2e-2:
        raise Fp8Unsupported(f"torch._scaled_mm disagrees with its emulation (max rel err {err:.3g}) "
                             f"with torch {torch.__version__}")


def fast_accum_default() -> bool:
    return os.environ.get(FAST_ACCUM_ENV, "0") == "1"


def target_linears(model, branches=("gen",)):
    """(owner module, attribute name, full parameter name) of every dense Linear to quantise."""
    out = []
    for i, layer in enumerate(model.language_model.model.layers):
        prefix = f"language_model.model.layers.{i}."
        for b in branches:
            sfx = BRANCH_SUFFIX[b]
            attn = layer.self_attn
            if hasattr(attn, "q_proj" + sfx):
                out += [(attn, n + sfx, f"{prefix}self_attn.{n}{sfx}") for n in _ATTN]
            mlp = getattr(layer, "mlp" + sfx, None)
            if isinstance(mlp, SwiGLU):  # MoE experts stay bf16 (see module doc)
                out += [(mlp, n, f"{prefix}mlp{sfx}.{n}") for n in _MLP]
    return out


def fp8_eligible(lin) -> bool:
    """A Linear the fp8 GEMM takes: both dims multiples of 16 (`_scaled_mm`'s rule)."""
    return isinstance(lin, nn.Linear) and lin.in_features % 16 == 0 and lin.out_features % 16 == 0


def quantize_model(model, branches=("gen",), prequantized: dict | None = None,
                   fast_accum: bool | None = None) -> int:
    """Swap the branch's dense Linear layers for Fp8Linear in place. `prequantized`: {param name
    without '.weight': (q, scale)} from an fp8 checkpoint (used as is). Returns layers swapped;
    a layer whose dims are not multiples of 16 (the fp8 GEMM's rule) stays in the model dtype."""
    fast = fast_accum_default() if fast_accum is None else fast_accum
    prequantized = prequantized or {}
    n = 0
    for owner, attr, name in target_linears(model, branches):
        lin = getattr(owner, attr)
        if not fp8_eligible(lin):
            continue
        if name in prequantized:
            q, s = prequantized[name]
            new = Fp8Linear(q.to(lin.weight.device), s.to(lin.weight.device), lin.bias, fast)
        else:
            new = Fp8Linear.from_linear(lin, fast)
        setattr(owner, attr, new)
        n += 1
    return n


def write_fp8_checkpoint(src_dir: str, out_dir: str, branches=("gen",)) -> str:
    """A copy of a checkpoint whose branch's dense Linear weights are stored as e4m3 with their
    per-output-channel fp32 scales (`X.weight` + `X.weight_scale`): what `load_model` reads as an
    fp8 checkpoint (half the bytes of the gen branch on disk and at load)."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from .config import load_config
    from .loader import FP8_SCALE_SUFFIX, INDEX_FILE, weight_map
    from .model import NeoModel
    with torch.device("meta"):
        meta = NeoModel(load_config(src_dir), "both")
    targets = {name + ".weight" for owner, attr, name in target_linears(meta, branches)
               if fp8_eligible(getattr(owner, attr))}
    os.makedirs(out_dir, exist_ok=True)
    wm = weight_map(src_dir)
    new_map = {}
    for path in sorted(set(wm.values())):
        out = {}
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key in targets:
                    q, scale = quant_fp8_rowwise(t.float())
                    out[key], out[key[: -len(".weight")] + FP8_SCALE_SUFFIX] = q, scale.reshape(-1)
                else:
                    out[key] = t
        name = os.path.basename(path)
        save_file(out, os.path.join(out_dir, name), metadata={"format": "pt"})
        new_map.update({k: name for k in out})
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": new_map}, f, indent=2)
    for name in os.listdir(src_dir):
        if not name.endswith(".safetensors") and name != INDEX_FILE:
            src = os.path.join(src_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(out_dir, name))
    return out_dir
