"""fp8 (e4m3, row-wise scales) quantisation: the CPU emulation is the GPU path's numerics.

Bound used below (why it holds): a value quantised with scale s is x^ = s * rne_e4m3(x / s) with
|x / s| <= 448, so |x^ - x| <= 2^-4 |x| (half an e4m3 ulp in the normal range, 3 mantissa bits)
+ 2^-10 s (half the subnormal spacing 2^-9, below 2^-6). For a dot product of K such pairs the error
is at most sum_k [(|x_k| (1 + 2^-4) + 2^-10 s_x)(2^-4 |w_k| + 2^-10 s_w) + |w_k| (2^-4 |x_k| + 2^-10 s_x)],
plus the fp32 summation (K * 2^-24 of sum |x^ w^|) and the final rounding to the output dtype.
On Gaussian data the typical relative error of a GEMM output is ~4% (each operand ~2^-4 / sqrt(3)
RMS relative error), which the statistical check bounds at 6%.

The Triton kernels (quantiser, RMSNorm -> fp8, silu*mul -> fp8) are checked against these references
under the interpreter in tests/kernels/interpreted/check_fp8.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from services.contract.image import SamplerParams
from kernels.fp8_quant import FP8_DTYPE, INV_FP8_MAX, quant_fp8_rowwise, quant_fp8_rowwise_ref
from kernels.row_quant import AMAX_FLOOR
from kernels.norm_act import rms_norm_ref, silu_mul_ref
from services.model.modules import RMSNorm, SwiGLU
from services.model.quant import (Fp8Activation, Fp8Linear, Fp8QKV, Fp8RMSNorm, Fp8SwiGLU, Fp8Unsupported,
                                  GemmPolicy, require_fp8, scaled_mm_emulated)


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


def _deq(q, s):
    return q.float() * s


def test_rowwise_quantisation_definition():
    """scale = max(amax, floor) * fl32(1/448) (a product: what torch's CUDA `amax / 448.0` computes,
    and what the kernel computes), q = RNE(x / scale) on the e4m3 grid."""
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-6, 4, 64)[:, None]
    x[3] = 0.0
    q, s = quant_fp8_rowwise_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (64, 1) and s.dtype == torch.float32
    assert torch.tensor(INV_FP8_MAX, dtype=torch.float32).item() == INV_FP8_MAX            # fp32-exact
    assert INV_FP8_MAX == (torch.tensor(1.0) / torch.tensor(448.0)).item()                   # fl32(1/448)
    amax = x.abs().amax(1, keepdim=True)
    assert torch.equal(s, amax.clamp_min(AMAX_FLOOR) * torch.tensor(INV_FP8_MAX))
    assert not torch.equal(s, amax.clamp_min(AMAX_FLOOR) / 448.0)   # the division differs in some rows
    assert torch.equal(q.view(torch.uint8), (x / s).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))
    assert q[3].float().eq(0).all()
    assert (q.float().abs().amax(1)[torch.arange(64) != 3] >= 447).all()   # every row uses the range
    err = (q.float() * s - x).abs()
    assert (err <= 2 ** -4 * x.abs() + 2 ** -10 * s).all()


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


def test_fused_layers_compute_what_the_separate_ones_do():
    """q | k|v, gate|up and the quantising producers are one GEMM / one kernel each, with the operands
    of the separate layers: RMSNorm -> fp8 is quant(rms_norm), silu*mul -> fp8 is quant(silu_mul), the
    fused GEMM's columns are the separate layers' outputs."""
    torch.manual_seed(3)
    h, inter = 64, 96
    norm = RMSNorm(h)
    norm.weight.data = torch.rand(h) + 0.5
    x = torch.randn(24, h)
    a = Fp8RMSNorm(norm, GemmPolicy())(x)
    assert isinstance(a, Fp8Activation) and a.shape == x.shape and a.dtype == x.dtype
    rq, rs = quant_fp8_rowwise_ref(rms_norm_ref(x, norm.weight, norm.eps))
    assert torch.equal(a.q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(a.scale, rs)

    q, k, v = (nn.Linear(h, n, bias=False) for n in (64, 32, 32))
    qkv = Fp8QKV(Fp8Linear.from_linears([q]), Fp8Linear.from_linears([k, v]))
    assert qkv.kv_proj.splits == (32, 32)
    for got, lin in zip(qkv(a), (q, k, v)):
        want = Fp8Linear.from_linear(lin)(a)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)   # fp32 sums in another order only
    # the same with a plain tensor input: quantised once, the same result
    for got, want in zip(qkv(x), qkv(Fp8Activation(*quant_fp8_rowwise_ref(x), x.dtype))):
        assert torch.equal(got, want)

    mlp = SwiGLU(h, inter)
    f = Fp8SwiGLU(Fp8Linear.from_linears([mlp.gate_proj, mlp.up_proj]), Fp8Linear.from_linear(mlp.down_proj))
    gate, up = Fp8Linear.from_linear(mlp.gate_proj)(a), Fp8Linear.from_linear(mlp.up_proj)(a)
    act = quant_fp8_rowwise_ref(silu_mul_ref(gate, up))
    want = Fp8Linear.from_linear(mlp.down_proj)(Fp8Activation(*act, x.dtype))
    torch.testing.assert_close(f(a), want, rtol=1e-5, atol=1e-5)
    rel = ((f(a) - mlp(norm(x))).norm() / mlp(norm(x)).norm()).item()
    assert rel < 0.1, rel     # three fp8 GEMMs in a row vs fp32


def test_small_row_counts_run_the_model_dtype_weights():
    """GemmPolicy(min_tokens=M0): fewer rows than M0 compute exactly what the unquantised layers do
    (their kept weights, one GEMM per part); M0 rows and more are fp8."""
    torch.manual_seed(4)
    pol = GemmPolicy(min_tokens=16)
    h = 64
    norm, mlp = RMSNorm(h), SwiGLU(h, 96)
    q, k, v = (nn.Linear(h, n, bias=False) for n in (64, 32, 32))
    fnorm = Fp8RMSNorm(norm, pol)
    qkv = Fp8QKV(Fp8Linear.from_linears([q], policy=pol), Fp8Linear.from_linears([k, v], policy=pol))
    fmlp = Fp8SwiGLU(Fp8Linear.from_linears([mlp.gate_proj, mlp.up_proj], policy=pol),
                     Fp8Linear.from_linear(mlp.down_proj, pol))
    small, big = torch.randn(15, h), torch.randn(16, h)
    assert torch.equal(fnorm(small), norm(small))
    for got, lin in zip(qkv(fnorm(small)), (q, k, v)):
        assert torch.equal(got, lin(norm(small)))
    assert torch.equal(fmlp(fnorm(small)), mlp(norm(small)))
    assert isinstance(fnorm(big), Fp8Activation)
    assert not torch.equal(fmlp(fnorm(big)), mlp(norm(big)))
    with pytest.raises(ValueError, match="min_tokens"):
        Fp8Linear(*quant_fp8_rowwise(q.weight), policy=pol)        # nothing to run small row counts with


def test_gemm_policy_defaults_and_env(monkeypatch):
    monkeypatch.delenv("U1SERVE_FP8_MIN_TOKENS", raising=False)
    monkeypatch.delenv("U1SERVE_FP8_FAST_ACCUM", raising=False)
    assert GemmPolicy.for_device("cpu") == GemmPolicy(0, None)               # the emulation: always fp8
    cuda = GemmPolicy.for_device("cuda")
    assert (cuda.min_tokens, cuda.fast_accum_min_tokens) == (2048, 4096)
    assert not cuda.fp8(1024) and cuda.fp8(2048) and not cuda.fast_accum(2048) and cuda.fast_accum(8192)
    monkeypatch.setenv("U1SERVE_FP8_MIN_TOKENS", "0")
    monkeypatch.setenv("U1SERVE_FP8_FAST_ACCUM", "0")
    assert GemmPolicy.for_device("cuda") == GemmPolicy(0, None)
    monkeypatch.setenv("U1SERVE_FP8_FAST_ACCUM", "1")
    assert GemmPolicy.for_device("cuda").fast_accum(1)
    monkeypatch.setenv("U1SERVE_FP8_FAST_ACCUM", "yes")
    with pytest.raises(ValueError, match="0, 1 or auto"):
        GemmPolicy.for_device("cuda")


def test_quantize_model_gen_branch_only(tiny_checkpoint):
    from services.model.loader import load_model
    d = tiny_checkpoint("u1")
    both = load_model(d, "both", quantization="fp8")
    kinds = {n: type(m).__name__ for n, m in both.named_modules()}
    attn = "language_model.model.layers.0.self_attn."
    assert kinds[attn + "qkv_proj_mot_gen"] == "Fp8QKV"
    assert kinds[attn + "qkv_proj_mot_gen.kv_proj"] == "Fp8Linear"
    assert attn + "q_proj_mot_gen" not in kinds                                   # fused away
    assert kinds[attn + "o_proj_mot_gen"] == "Fp8Linear"
    assert kinds["language_model.model.layers.1.mlp_mot_gen"] == "Fp8SwiGLU"
    assert kinds["language_model.model.layers.1.input_layernorm_mot_gen"] == "Fp8RMSNorm"
    assert kinds["language_model.model.layers.1.post_attention_layernorm_mot_gen"] == "Fp8RMSNorm"
    assert kinds[attn + "q_proj"] == "Linear" and kinds["language_model.model.layers.0.input_layernorm"] == "RMSNorm"
    assert kinds["fm_modules.fm_head.0"] == "Linear"                                # head stays
    assert kinds[attn + "q_norm_mot_gen"] == "RMSNorm"                              # Q/K norms stay
    und = load_model(d, "und", quantization="fp8")   # understanding (optional): its own branch
    assert type(und.language_model.model.layers[0].mlp).__name__ == "Fp8SwiGLU"
    a3b = load_model(tiny_checkpoint("a3b"), "gen", quantization="fp8")
    layer = a3b.language_model.model.layers[0]
    assert type(layer.self_attn.o_proj_mot_gen).__name__ == "Fp8Linear"
    assert layer.mlp_mot_gen.experts.gate_up_proj.dtype == torch.float32           # MoE experts stay
    assert type(layer.post_attention_layernorm_mot_gen).__name__ == "RMSNorm"      # it feeds the MoE


def test_fp8_velocity_close_to_fp32(tiny_checkpoint):
    """Measured on the tiny model: 0.25% relative velocity error (bf16: 0.32%); bound 2%."""
    from services.model import reference as R
    from services.model import sampler as S
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    d = tiny_checkpoint("u1")
    m32, m8 = load_model(d, "both"), load_model(d, "both", quantization="fp8")
    pre = R.image_prefixes(m32, NeoTokenizer.from_dir(d), "t2i", "a red cat", [], SamplerParams())
    x = S.initial_noise(1, 128, 128, 0, "cpu", torch.float32, 2.0)
    t = torch.tensor(0.3)
    v = [R.gen_velocity(m, pre["cond"].kv, pre["cond"].t_offset, m.gen_embed(x, t, 2.0), S.patchify(x), t,
                        4, 4, 0.02) for m in (m32, m8)]
    rel = ((v[1] - v[0]).norm() / v[0].norm()).item()
    assert 0 < rel < 0.02, rel


def test_fp8_after_lora_merge(tiny_checkpoint, tmp_path):
    """LoRA merges into the model-dtype weights, then the merged weights are quantised."""
    from safetensors.torch import save_file

    from services.model.loader import load_model, merge_lora
    from services.model.quant import quantize_model
    d = tiny_checkpoint("u1")
    g = torch.Generator().manual_seed(5)
    name = "language_model.model.layers.0.self_attn.k_proj_mot_gen"
    path = str(tmp_path / "lora.safetensors")
    save_file({name + ".lora_down.weight": torch.randn(2, 64, generator=g),
               name + ".lora_up.weight": torch.randn(32, 2, generator=g), name + ".alpha": torch.tensor(2.0)}, path)
    got = load_model(d, "gen", lora=path, quantization="fp8")
    want = load_model(d, "gen")
    merge_lora(want, path)
    quantize_model(want, ("gen",))
    ka = got.language_model.model.layers[0].self_attn.qkv_proj_mot_gen.kv_proj
    kb = want.language_model.model.layers[0].self_attn.qkv_proj_mot_gen.kv_proj
    assert torch.equal(ka.weight.view(torch.uint8), kb.weight.view(torch.uint8))
    plain = load_model(d, "gen", quantization="fp8").language_model.model.layers[0].self_attn.qkv_proj_mot_gen
    assert not torch.equal(ka.weight.view(torch.uint8), plain.kv_proj.weight.view(torch.uint8))


def _tp_rank(rank, world, ckpt, init_file, out_dir):
    from services.model import reference as R
    from services.model import sampler as S
    from services.model.loader import load_model
    from services.model.parallel import TPContext
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = load_model(ckpt, "gen", tp=TPContext(rank, world), quantization="fp8")
        L, P = model.num_layers, 12
        kv = torch.randn(L, 2, P, model.num_kv_heads * world, model.head_dim, generator=torch.Generator().manual_seed(1))
        kv = kv[:, :, :, rank * model.num_kv_heads:(rank + 1) * model.num_kv_heads]   # this rank's heads
        x = S.initial_noise(1, 128, 128, 0, "cpu", torch.float32, 2.0)
        t = torch.tensor(0.4)
        v = R.gen_velocity(model, kv, P, model.gen_embed(x, t, 2.0), S.patchify(x), t, 4, 4, 0.02)
        if rank == 0:
            torch.save(v, os.path.join(out_dir, "v.pt"))
    finally:
        dist.destroy_process_group()


def test_fp8_under_tensor_parallelism(tiny_checkpoint, tmp_path):
    """TP 2 shards the fused layers per rank (q and k|v heads, gate|up columns; o and down rows with
    their own per-token activation scales): the velocity stays within fp8 error of TP 1's."""
    from services.model import reference as R
    from services.model import sampler as S
    from services.model.loader import load_model
    ckpt = tiny_checkpoint("u1")
    mp.spawn(_tp_rank, args=(2, ckpt, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "v.pt", weights_only=True)
    m8, m32 = load_model(ckpt, "gen", quantization="fp8"), load_model(ckpt, "gen")
    P = 12
    kv = torch.randn(m8.num_layers, 2, P, m8.num_kv_heads, m8.head_dim, generator=torch.Generator().manual_seed(1))
    x = S.initial_noise(1, 128, 128, 0, "cpu", torch.float32, 2.0)
    t = torch.tensor(0.4)
    v8, v32 = (R.gen_velocity(m, kv, P, m.gen_embed(x, t, 2.0), S.patchify(x), t, 4, 4, 0.02) for m in (m8, m32))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(got, v32) < 0.02 and rel(got, v8) < 0.02, (rel(got, v32), rel(got, v8))


def test_clear_error_without_fp8_tensor_cores():
    require_fp8((9, 0), "H200")
    require_fp8((8, 9), "L40S")
    with pytest.raises(Fp8Unsupported, match=r"compute capability >= 8.9.*A100 has 8.0"):
        require_fp8((8, 0), "A100")


def test_only_gemm_friendly_dims_are_quantised():
    from services.model.quant import fp8_eligible
    assert fp8_eligible(nn.Linear(64, 32)) and not fp8_eligible(nn.Linear(20, 32))
    assert not fp8_eligible(nn.Linear(64, 40)) and not fp8_eligible(nn.Conv2d(3, 16, 2))
