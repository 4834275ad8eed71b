"""fp8 (e4m3, row-wise scales) quantisation: the CPU emulation is the GPU path's numerics.

Bound used below (why it holds): a value quantised with scale s is x^ = s * rne_e4m3(x / s) with
|x / s| <= 448, so |x^ - x| <= 2^-4 |x| (half an e4m3 ulp in the normal range, 3 mantissa bits)
+ 2^-10 s (half the subnormal spacing 2^-9, below 2^-6). For a dot product of K such pairs the error
is at most sum_k [(|x_k| (1 + 2^-4) + 2^-10 s_x)(2^-4 |w_k| + 2^-10 s_w) + |w_k| (2^-4 |x_k| + 2^-10 s_x)],
plus the fp32 summation (K * 2^-24 of sum |x^ w^|) and the final rounding to the output dtype.
On Gaussian data the typical relative error of a GEMM output is ~4% (each operand ~2^-4 / sqrt(3)
RMS relative error), which the statistical check bounds at 6%.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kernels.fp8_quant import FP8_DTYPE, quant_fp8_rowwise, quant_fp8_rowwise_ref
from services.model.quant import Fp8Linear, Fp8Unsupported, require_fp8, scaled_mm_emulated

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bound(x, w, sx, sw, out_dtype):
    """Elementwise worst-case |y8 - x @ w^T| of the emulated fp8 GEMM (module doc), in fp64."""
    a, b = x.double().abs(), w.double().abs()
    sx, sw = sx.double(), sw.double().reshape(1, -1)
    u, t = 2.0 ** -4, 2.0 ** -10
    # sum_k (|x|(1+u) + t sx)(u|w| + t sw) + |w|(u|x| + t sx), expanded into matrix products
    K = x.shape[1]
    e = (1 + u) * u * (a @ b.t()) + (1 + u) * t * (a.sum(1, keepdim=True) * sw) \
        + t * u * (sx * b.sum(1).reshape(1, -1)) + t * t * K * (sx * sw) \
        + u * (a @ b.t()) + t * (sx * b.sum(1).reshape(1, -1))
    mag = (a @ b.t()) + e
    fp32_sum = K * 2.0 ** -24 * mag
    out_round = (2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -23) * mag
    return e + fp32_sum + out_round


def test_rowwise_quantisation_is_the_torch_cast():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-6, 4, 64)[:, None]
    x[3] = 0.0
    q, s = quant_fp8_rowwise_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (64, 1) and s.dtype == torch.float32
    assert torch.equal(s[:, 0], (x.abs().amax(1).clamp_min(1e-12) / 448.0))
    assert torch.equal(q.view(torch.uint8), (x / s).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))
    assert q.float().abs().amax(1)[torch.arange(64) != 3].eq(448).all()   # every row uses the range
    assert q[3].float().eq(0).all()
    err = (q.float() * s - x).abs()
    assert (err <= 2 ** -4 * x.abs() + 2 ** -10 * s).all()


def test_triton_kernel_rounds_like_the_reference():
    """The Triton kernel under the interpreter gives the reference's bits (it rounds to the e4m3 grid
    itself, so its cast is exact on any backend)."""
    code = (
        "import torch\n"
        "from kernels.fp8_quant import quant_fp8_rowwise, quant_fp8_rowwise_ref\n"
        "torch.manual_seed(1)\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    x = (torch.randn(48, 200) * torch.logspace(-9, 5, 48)[:, None]).to(dt)\n"
        "    x[5] = 0; x[7, :20] = 1e-30\n"
        "    q, s = quant_fp8_rowwise(x)\n"
        "    rq, rs = quant_fp8_rowwise_ref(x)\n"
        "    assert torch.equal(s, rs), dt\n"
        "    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), dt\n"
        "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", U1SERVE_KERNELS="triton", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_within_the_stated_bound(dtype):
    torch.manual_seed(2)
    lin = nn.Linear(256, 96, bias=False).to(dtype)
    x = torch.randn(40, 256).to(dtype)
    x[0] *= 1e-3                                  # a quiet token: its own scale
    x[1, :8] *= 50                                # an outlier token
    f8 = Fp8Linear.from_linear(lin)
    y8 = f8(x)
    assert y8.dtype == dtype and y8.shape == (40, 96)
    exact = x.double() @ lin.weight.double().t()
    qx, sx = quant_fp8_rowwise(x)
    bound = _bound(x, lin.weight, sx, f8.weight_scale, dtype)
    assert ((y8.double() - exact).abs() <= bound).all()
    # the emulation is exactly "fp8 operands, fp32 products and sum, scales, round once"
    assert torch.equal(y8, scaled_mm_emulated(qx, f8.weight, sx, f8.weight_scale, dtype))
    rel = ((y8.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.06, rel
    # vs the same layer in bf16 (what fp8 replaces on the GPU): the same order of error
    if dtype == torch.bfloat16:
        yb = lin(x).double()
        assert ((y8.double() - yb).norm() / yb.norm()).item() < 0.06


def test_quantize_model_gen_branch_only(tiny_checkpoint):
    from services.model.loader import load_model
    d = tiny_checkpoint("u1")
    both = load_model(d, "both", quantization="fp8")
    kinds = {n: type(m).__name__ for n, m in both.named_modules()}
    assert kinds["language_model.model.layers.0.self_attn.q_proj_mot_gen"] == "Fp8Linear"
    assert kinds["language_model.model.layers.1.mlp_mot_gen.down_proj"] == "Fp8Linear"
    assert kinds["language_model.model.layers.0.self_attn.q_proj"] == "Linear"      # und stays
    assert kinds["fm_modules.fm_head.0"] == "Linear"                                # head stays
    und = load_model(d, "und", quantization="fp8")   # understanding (optional): its own branch
    assert type(und.language_model.model.layers[0].mlp.up_proj).__name__ == "Fp8Linear"
    a3b = load_model(tiny_checkpoint("a3b"), "gen", quantization="fp8")
    layer = a3b.language_model.model.layers[0]
    assert type(layer.self_attn.o_proj_mot_gen).__name__ == "Fp8Linear"
    assert type(layer.mlp_mot_gen.experts[0].up_proj).__name__ == "Linear"         # MoE experts stay


def test_fp8_velocity_close_to_fp32(tiny_checkpoint):
    """Measured on the tiny model: 0.25% relative velocity error (bf16: 0.32%); bound 2%."""
    from services.model import reference as R
    from services.model import sampler as S
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    d = tiny_checkpoint("u1")
    m32, m8 = load_model(d, "both"), load_model(d, "both", quantization="fp8")
    pre = R.image_prefixes(m32, NeoTokenizer.from_dir(d), "t2i", "a red cat", [], S.SamplerParams())
    x = S.initial_noise(1, 128, 128, 0, "cpu", torch.float32, 2.0)
    t = torch.tensor(0.3)
    v = [R.gen_velocity(m, pre["cond"].kv, pre["cond"].t_offset, m.gen_embed(x, t, 2.0), S.patchify(x), t,
                        4, 4, 0.02) for m in (m32, m8)]
    rel = ((v[1] - v[0]).norm() / v[0].norm()).item()
    assert 0 < rel < 0.02, rel


def test_fp8_checkpoint_loads_its_scales(tiny_checkpoint, tmp_path):
    """An fp8 checkpoint (X.weight e4m3 + X.weight_scale) loads to the same fp8 layers as quantising
    at load; without --quantization it dequantises."""
    from services.model.loader import load_model
    from services.model.quant import write_fp8_checkpoint
    d = tiny_checkpoint("u1")
    out = write_fp8_checkpoint(d, str(tmp_path / "fp8"))
    a = load_model(d, "gen", quantization="fp8")
    b = load_model(out, "gen", quantization="fp8")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype == FP8_DTYPE else sa[k],
                           sb[k].view(torch.uint8) if sb[k].dtype == FP8_DTYPE else sb[k]), k
    plain = load_model(out, "gen")
    w = plain.language_model.model.layers[0].self_attn.q_proj_mot_gen.weight
    lin = a.language_model.model.layers[0].self_attn.q_proj_mot_gen
    assert torch.equal(w, lin.dequantized_weight())


def test_clear_error_without_fp8_tensor_cores():
    require_fp8((9, 0), "H200")
    require_fp8((8, 9), "L40S")
    with pytest.raises(Fp8Unsupported, match=r"compute capability >= 8.9.*A100 has 8.0"):
        require_fp8((8, 0), "A100")


def test_only_gemm_friendly_dims_are_quantised():
    from services.model.quant import fp8_eligible
    assert fp8_eligible(nn.Linear(64, 32)) and not fp8_eligible(nn.Linear(20, 32))
    assert not fp8_eligible(nn.Linear(64, 40)) and not fp8_eligible(nn.Conv2d(3, 16, 2))
