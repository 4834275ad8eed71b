"""int8 W8A8, `u1serve convert` (fp8 / int8 safetensors, GGUF Q8_0 / Q4_K) and loading converted checkpoints.

int8 bound used below: a value quantised with scale s = amax / 127 is off by at most s / 2, so one operand's
RMS relative error on Gaussian data is ~ (amax / 127) / sqrt(12) / sigma ~ 0.9% (amax ~ 4 sigma); a GEMM output
of two such operands ~1.3% RMS, checked at 3%.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from kernels.int8_gemm import INV_INT8_MAX, float_in_place, int8_mm, int8_mm_ref, quant_int8_rowwise
from services.model.convert import ConvertError, convert_checkpoint
from services.model.loader import LoadError, load_model
from services.model.modules import SwiGLU
from services.model.quant import Fp8Activation, Fp8Linear, quantize_model
from services.model.quant_schemes import scheme
from services.model.quant_int8 import Int8Linear, Int8QKV, Int8SwiGLU

gguf = pytest.importorskip("gguf")   # the [gguf] extra, installed by the test extra (pyproject)

GEN_KV = "language_model.model.layers.0.self_attn.qkv_proj_mot_gen.kv_proj"


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ----------------------------------------------------------------------------- int8 numerics
def test_int8_rowwise_definition_and_exact_gemm():
    torch.manual_seed(0)
    x = torch.randn(40, 96) * torch.logspace(-4, 3, 40)[:, None]
    x[5] = 0.0
    q, s = quant_int8_rowwise(x)
    assert q.dtype == torch.int8 and s.shape == (40, 1) and int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(s[0], x[0].abs().max().float().reshape(1) * INV_INT8_MAX)   # a product, as on CUDA
    assert torch.equal(q, torch.round(x / s).to(torch.int8)) and not q[5].any()
    w = torch.randn(48, 96)
    qw, sw = quant_int8_rowwise(w)
    y = int8_mm(q[:3], qw, s[:3], sw.t(), torch.float32)        # short M: the CUDA path pads, CPU is exact
    exact = (q[:3].double() @ qw.double().t()) * s[:3].double() * sw.t().double()
    assert torch.allclose(y.double(), exact, rtol=2e-7, atol=0)     # the int32 sum is exact, 2 fp32 products
    xs, ws = torch.randn(256, 512), torch.randn(128, 512)
    (qx, sx), (qw, sw) = quant_int8_rowwise(xs), quant_int8_rowwise(ws)
    rel = (int8_mm_ref(qx, qw, sx, sw.t(), torch.float32) - xs @ ws.t()).norm() / (xs @ ws.t()).norm()
    assert 0 < rel < 0.03, rel


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_int32_product_becomes_fp32_in_its_own_buffer(device):
    """int8_mm's epilogue converts the int32 product in place (4 bytes an element beside the output, not 8): the
    same values as a fresh `.to(torch.float32)`, from extremes through rounding (|x| > 2**24), also for the row
    prefix of a padded product (int8_mm pads short M), and no new buffer."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randint(-2**31, 2**31 - 1, (24, 40), generator=g, dtype=torch.int32)
    acc[0, :4] = torch.tensor([-2**31, 2**31 - 1, 2**24 + 1, -(2**24 + 3)], dtype=torch.int32)
    acc = acc.to(device)
    for part in (acc.clone(), acc.clone()[:17]):
        want = part.to(torch.float32)
        got = float_in_place(part)
        assert got.data_ptr() == part.data_ptr() and torch.equal(got, want)


def test_int8_layers_are_the_fp8_structure_in_int8():
    torch.manual_seed(1)
    lin = nn.Linear(64, 48, bias=False)
    x = torch.randn(7, 64)
    layer = Int8Linear.from_linear(lin)
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.int8 and layer.weight_hp is None
    qx, sx = quant_int8_rowwise(x)
    assert torch.equal(layer(x), int8_mm_ref(qx, layer.weight, sx, layer.weight_scale, torch.float32))
    assert isinstance(layer.quantize_input(x), Fp8Activation)
    mlp = SwiGLU(64, 128)
    f = Int8SwiGLU(Int8Linear.from_linears([mlp.gate_proj, mlp.up_proj]), Int8Linear.from_linear(mlp.down_proj))
    rel = (f(x) - mlp(x)).norm() / mlp(x).norm()
    assert 0 < rel < 0.05, rel


def test_int8_quantize_model_swaps_both_branches(tiny_checkpoint):
    m = load_model(tiny_checkpoint("u1"), "both")
    assert quantize_model(m, ("gen", "und"), scheme=scheme("int8")) == 2 * 2 * 7
    layer = m.language_model.model.layers[1]
    assert type(layer.self_attn.qkv_proj_mot_gen) is Int8QKV and type(layer.mlp) is Int8SwiGLU
    assert type(layer.input_layernorm_mot_gen).__name__ == "RMSNorm"    # int8: the GEMM quantises its input
    assert type(m.fm_modules.fm_head[0]) is nn.Linear


# ----------------------------------------------------------------------------- convert -> load
@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("u1")
    made = {}

    def get(to: str) -> str:
        if to not in made:
            made[to] = convert_checkpoint(src, str(tmp_path_factory.mktemp(to.replace(":", "_"))), to)
        return made[to]
    return get


class _CountWeightQuantisation:
    """Counts the quantiser's calls (weights only: nothing runs a forward while loading)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for cls in (Fp8Linear, Int8Linear):
            real = cls.quantize_rows

            def spy(x, _real=real):
                self.calls += 1
                return _real(x)
            monkeypatch.setattr(cls, "quantize_rows", staticmethod(spy))


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_converted_checkpoint_loads_without_requantising(tiny_checkpoint, converted, monkeypatch, scheme):
    src, out = tiny_checkpoint("u1"), converted(scheme)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] == {"fp8": "float",
                                                                                           "int8": "int"}[scheme]
    online = load_model(src, "gen", quantization=scheme)
    count = _CountWeightQuantisation(monkeypatch)
    served = load_model(out, "gen")                      # none: served in the checkpoint's own format
    und = load_model(out, "und")
    assert count.calls == 0
    sa, sb = online.state_dict(), served.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:                                         # the bits of quantising at load
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k
    gen_kv = dict(served.named_modules())[GEN_KV]
    und_kv = dict(und.named_modules())[GEN_KV.replace("_mot_gen", "")]
    assert gen_kv.weight.dtype == und_kv.weight.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[scheme]
    assert not torch.equal(gen_kv.weight_scale, und_kv.weight_scale)   # each branch its own scales
    load_model(src, "gen", quantization=scheme)
    assert count.calls > 0                               # the spy sees quantisation at load


@pytest.mark.parametrize("typ,bound", [("q8_0", 0.006), ("q4_k", 0.12)])
def test_gguf_round_trip(tiny_checkpoint, converted, typ, bound):
    src, out = tiny_checkpoint("u1"), converted("gguf:" + typ)
    reader = gguf.GGUFReader(os.path.join(out, "model.gguf"))
    ref = load_model(src, "both").state_dict()
    assert {t.name for t in reader.tensors} == set(ref)                      # official names, one to one
    assert json.loads(reader.get_field("u1serve.config_json").contents()) == json.load(
        open(os.path.join(src, "config.json")))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["language_model.model.layers.0.mlp_mot_gen.down_proj.weight"] == typ.upper()
    assert types["language_model.model.layers.0.self_attn.q_proj.weight"] == typ.upper()    # both branches
    assert types["fm_modules.fm_head.0.weight"] == "BF16" and types["language_model.model.norm.weight"] == "BF16"
    got = load_model(out, "both").state_dict()
    for k in ref:
        if types[k] == "BF16":
            assert torch.equal(got[k], ref[k]), k
        else:
            err = ((got[k] - ref[k]).norm() / ref[k].norm()).item()
            assert 0 < err < bound, (k, err)


def test_q4_k_blocks_read_back_by_gguf():
    from services.model.gguf_io import quantize_q4_k
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.02
    q = quantize_q4_k(x)
    assert q.shape == (8, 2 * 144) and q.dtype == np.uint8
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_K)
    rel = np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean())
    assert 0 < rel < 0.09, rel      # 4-bit, 32-value sub-blocks with a min: ~7% RMS on Gaussian data


# ----------------------------------------------------------------------------- refusals
def test_unsupported_gguf_type_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(ConvertError, match="unsupported GGUF type 'q2_k'.*q4_k, q8_0"):
        convert_checkpoint(tiny_checkpoint("u1"), str(tmp_path / "x"), "gguf:q2_k")
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", "convert", tiny_checkpoint("u1"), str(tmp_path / "y"),
                        "--to", "int4"], capture_output=True, text=True)
    assert r.returncode == 2 and "--to must be fp8, int8, gguf[:TYPE] or gguf:TYPE:LAYERS" in r.stderr


def test_gguf_tensor_of_an_unread_type_is_refused(converted, tmp_path):
    """A GGUF whose tensor is Q4_0 (gguf can write it; u1serve does not read it) is refused by name."""
    src = converted("gguf:q8_0")
    reader = gguf.GGUFReader(os.path.join(src, "model.gguf"))
    out = tmp_path / "q4_0"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes(open(os.path.join(src, name), "rb").read())
    w = gguf.GGUFWriter(str(out / "model.gguf"), "neo_chat")
    bad = "language_model.model.layers.0.mlp_mot_gen.up_proj.weight"
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name == bad:
            w.add_tensor(t.name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(t.name, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match=f"'{bad}'.*GGUF type Q4_0, which u1serve does not read"):
        load_model(str(out), "gen")


def _with_config(src: str, dst, edit) -> str:
    import shutil
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    return str(dst)


def test_config_that_disagrees_with_the_tensors_is_refused(converted, tmp_path):
    src = converted("int8")

    def to_float(c):
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
        c["quantization_config"]["config_groups"]["group_0"]["input_activations"]["type"] = "float"
    with pytest.raises(LoadError, match="declares fp8 for 'language_model.*' but its weight is torch.int8"):
        load_model(_with_config(src, tmp_path / "a", to_float), "gen")
    with pytest.raises(LoadError, match="is torch.int8 but config.json declares no quantization_config"):
        load_model(_with_config(src, tmp_path / "b", lambda c: c.pop("quantization_config")), "gen")
    with pytest.raises(LoadError, match="quant_method 'gptq' is not supported"):
        load_model(_with_config(src, tmp_path / "c",
                                lambda c: c["quantization_config"].update(quant_method="gptq")), "gen")
    with pytest.raises(ConvertError, match="already quantised"):
        convert_checkpoint(src, str(tmp_path / "d"), "fp8")


# ----------------------------------------------------------------------------- tensor parallelism
def _tp_rank(rank, world, ckpt, init_file, out_dir):
    import torch.distributed as dist

    from services.model.parallel import TPContext
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = load_model(ckpt, "gen", tp=TPContext(rank, world))
        assert type(model.language_model.model.layers[0].self_attn.o_proj_mot_gen) is Int8Linear
        torch.save(_velocity(model, rank, world), os.path.join(out_dir, f"v{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _velocity(model, rank: int = 0, world: int = 1):
    from services.model import reference as R
    from services.model import sampler as S
    L, P, heads = model.num_layers, 12, model.num_kv_heads * world
    kv = torch.randn(L, 2, P, heads, model.head_dim, generator=torch.Generator().manual_seed(1))
    kv = kv[:, :, :, rank * model.num_kv_heads:(rank + 1) * model.num_kv_heads]    # this rank's heads
    x = S.initial_noise(1, 128, 128, 0, "cpu", torch.float32, 2.0)
    t = torch.tensor(0.4)
    return R.gen_velocity(model, kv, P, model.gen_embed(x, t, 2.0), S.patchify(x), t, 4, 4, 0.02)


def test_int8_checkpoint_under_tensor_parallelism(converted, tmp_path):
    """TP 2 on an int8-converted checkpoint: column shards take their rows' scales, row shards (o, down) keep every
    output channel's scale and quantise their own activation slice: within int8 error of TP 1."""
    import torch.multiprocessing as mp
    ckpt = converted("int8")
    mp.spawn(_tp_rank, args=(2, ckpt, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got, want = torch.load(tmp_path / "v0.pt", weights_only=True), _velocity(load_model(ckpt, "gen"))
    assert ((got - want).norm() / want.norm()).item() < 0.02
