"""Quantising while loading (services/model/layerwise_load.py): `--quantization int8 / fp8` from a float checkpoint
gives exactly what quantising after the whole load gives, and the float weights of the quantised layers alive on
the device during the load stay at about one layer's (issue 42: the whole float branch came onto the GPU first)."""
from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from services.model import memory_plan as M
from services.model.config import load_config
from services.model.loader import load_model, merge_lora
from services.model.quant import quantize_model
from services.model.quant_schemes import scheme

LAYERS = 8
# decoder Linear shapes no other module of the tiny model has (q 128 x 192, k|v 32 x 192, gate|up 768 x 192 ...),
# so a float tensor of one of them is a decoder weight or a quantiser's copy of one
GEOMETRY = dict(hidden_size=192, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    from services.model.tiny import write_tiny_checkpoint
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-deep")), "u1", seed=0, **GEOMETRY)


class FloatWeightPeak(TorchDispatchMode):
    """The most bytes of float tensors of `shapes` alive at once on `device`: every op's float outputs of those
    shapes are watched (a weak reference to their storage), and after each op the live ones are summed."""

    def __init__(self, shapes, device="cpu"):
        super().__init__()
        self.shapes, self.device, self.live, self.peak = shapes, device, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.device.type == self.device and t.is_floating_point()
                    and tuple(t.shape) in self.shapes):
                s = t.untyped_storage()
                self.live.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
    assert [type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]


def _after_load(d, branch, fmt, **kw):
    """Today's order: the whole float branch first, then quantize_model."""
    m = load_model(d, branch, **kw)
    quantize_model(m, ("und",) if branch == "und" else ("gen",), scheme=scheme(fmt))
    return m


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_layerwise_equals_quantize_after_load(tiny_dir, fmt):
    for branch in ("gen", "und"):
        _same(load_model(tiny_dir, branch, quantization=fmt), _after_load(tiny_dir, branch, fmt))


def test_layerwise_equals_quantize_after_load_with_experts(tmp_path):
    """A3B: several checkpoint keys (one per expert) fill one stacked parameter of a layer."""
    from services.model.tiny import write_tiny_checkpoint
    d = write_tiny_checkpoint(str(tmp_path), "a3b", seed=0)
    for fmt in ("int8", "fp8"):
        for branch in ("gen", "und"):
            _same(load_model(d, branch, quantization=fmt), _after_load(d, branch, fmt))


def test_layerwise_outputs_identical(tiny_dir):
    from services.contract.image import SamplerParams
    from services.model import reference as R
    from services.model import sampler as S
    from services.model.tokenizer import NeoTokenizer
    a, b = load_model(tiny_dir, "both", quantization="int8"), _after_load(tiny_dir, "both", "int8")
    pre = R.image_prefixes(a, NeoTokenizer.from_dir(tiny_dir), "t2i", "a red cat", [], SamplerParams())
    x = S.initial_noise(1, 128, 128, 0, "cpu", torch.float32, 2.0)
    t = torch.tensor(0.3)
    v = [R.gen_velocity(m, pre["cond"].kv, pre["cond"].t_offset, m.gen_embed(x, t, 2.0), S.patchify(x), t,
                        4, 4, 0.02) for m in (a, b)]
    assert torch.equal(v[0], v[1])


def test_layerwise_equals_a_converted_checkpoint(tiny_dir, tmp_path):
    from services.model.convert import convert_checkpoint
    conv = convert_checkpoint(tiny_dir, str(tmp_path / "int8"), "int8")
    served = load_model(conv, "gen")                       # as converted: the checkpoint's own int8 weights
    assert type(served.language_model.model.layers[0].mlp_mot_gen).__name__ == "Int8SwiGLU"
    _same(load_model(tiny_dir, "gen", quantization="int8"), served)


def test_layerwise_after_lora_merge(tiny_dir, tmp_path):
    """Each layer's adapters merge before that layer is quantised; weights outside the layers merge at the end."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(5)
    k = "language_model.model.layers.1.self_attn.k_proj_mot_gen"
    head = "fm_modules.fm_head.0"
    path = str(tmp_path / "lora.safetensors")
    save_file({k + ".lora_down.weight": torch.randn(2, 64, generator=g),
               k + ".lora_up.weight": torch.randn(32, 2, generator=g), k + ".alpha": torch.tensor(2.0),
               head + ".lora_down.weight": torch.randn(2, 64, generator=g),
               head + ".lora_up.weight": torch.randn(4096, 2, generator=g)}, path)
    want = load_model(tiny_dir, "gen")
    merge_lora(want, path)
    quantize_model(want, ("gen",), scheme=scheme("int8"))
    got = load_model(tiny_dir, "gen", lora=path, quantization="int8")
    _same(got, want)
    plain = load_model(tiny_dir, "gen", quantization="int8")
    kv = lambda m: m.language_model.model.layers[1].self_attn.qkv_proj_mot_gen.kv_proj.weight  # noqa: E731
    assert not torch.equal(kv(got), kv(plain))


def test_layerwise_random_weights_equal_quantize_after(tiny_dir):
    from services.model.tiny import build_random_model, tiny_config
    cfg = tiny_config("u1")
    got = build_random_model(cfg, "gen", torch.float32, quantization="int8")
    want = build_random_model(cfg, "gen", torch.float32)
    quantize_model(want, ("gen",), scheme=scheme("int8"))
    _same(got, want)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_float_weight_peak_is_one_layer(deep_dir, fmt):
    """Measured on CPU (the target device here), 8 layers, fp32: quantise-after-load peaks at all 8 layers' float
    weights (8.5 layer-equivalents with the quantiser's copies); layer by layer at 1.5 (int8) / 2.2 (fp8): one
    layer plus the CPU quantiser's temporaries of the Linear it is quantising. Random weights: 1.5."""
    w = M.branch_weights(load_config(deep_dir), "gen")
    shapes = {(rows, cols) for _, rows, cols in w.targets}
    layer = w.layer_bytes("bf16", 4)[0]           # one decoder layer's quantised Linears, in fp32
    with FloatWeightPeak(shapes) as old:
        _after_load(deep_dir, "gen", fmt)
    assert old.peak >= LAYERS * layer             # the measurement sees the whole float branch
    with FloatWeightPeak(shapes) as new:
        model = load_model(deep_dir, "gen", quantization=fmt)
    assert layer <= new.peak < 2.5 * layer, new.peak / layer
    assert not any(tuple(p.shape) in shapes for p in model.parameters())      # every one of them quantised
    with FloatWeightPeak(shapes) as rnd:
        load_model(deep_dir, "gen", quantization=fmt, random_weights=True)
    assert layer <= rnd.peak < 2.5 * layer, rnd.peak / layer
