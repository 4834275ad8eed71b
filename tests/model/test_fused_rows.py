"""q|k|v and gate|up of the und (decode) branch as one weight each (services/model/fused_rows.py), forced on the CPU
with U1SERVE_FUSED_PROJ=1: the layers' Parameters are views of the fused weight (no second copy), loading / live
updates / LoRA merges / TP shards land in it, `.to()` and load_state_dict(assign=True) re-fuse, and the fused GEMMs give the separate
layers' outputs. The CUDA comparison (the skinny kernels on the fused weights, bf16): test_fused_rows_cuda.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from services.model import weights_io as W
from services.model.fused_rows import FusedRows, fuse_projections, fused_bytes, fusion_wanted
from services.model.loader import load_model, merge_lora
from services.model.lora_registry import LoraRegistry
from services.model.parallel import TPContext
from services.model.tiny_lora import write_tiny_lora
from tests.model.stack_forward import stack_forward


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("U1SERVE_FUSED_PROJ", "1")


def _groups(model):
    for layer in model.language_model.model.layers:
        yield from layer.self_attn.fused.values()
        for name in ("mlp", "mlp_mot_gen"):
            mlp = getattr(layer, name, None)
            if mlp is not None:
                yield from mlp.fused.values()


def _aliased(rows: FusedRows) -> bool:
    r0, es = 0, rows.weight.element_size()
    for lin, n in zip(rows.linears, rows.splits):
        if lin.weight.data_ptr() != rows.weight.data_ptr() + r0 * rows.weight.shape[1] * es:
            return False
        if not torch.equal(lin.weight, rows.weight[r0:r0 + n]):
            return False
        r0 += n
    return True


def _storage_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_cpu_default_keeps_the_separate_layers(tiny_dir, monkeypatch):
    monkeypatch.delenv("U1SERVE_FUSED_PROJ", raising=False)
    assert fusion_wanted("cuda") and not fusion_wanted("cpu")
    monkeypatch.setenv("U1SERVE_FUSED_PROJ", "0")
    assert not fusion_wanted("cuda")
    monkeypatch.setenv("U1SERVE_FUSED_PROJ", "bogus")
    with pytest.raises(ValueError, match="U1SERVE_FUSED_PROJ"):
        fusion_wanted("cpu")
    monkeypatch.delenv("U1SERVE_FUSED_PROJ")
    assert fused_bytes(load_model(tiny_dir, "both")) == 0       # CPU: today's layers, today's bits


def test_fused_layout_views_memory_and_outputs(tiny_dir, forced):
    plain = load_model(tiny_dir, "both", lora=[])
    fused = load_model(tiny_dir, "both", lora=[])
    fuse_projections(plain, on=False)
    groups = list(_groups(fused))
    layers = fused.cfg.llm.num_hidden_layers
    assert len(groups) == 2 * layers                           # q|k|v and gate|up of the und (decode) branch
    assert all(_aliased(r) for r in groups)
    assert _storage_bytes(fused) == _storage_bytes(plain)      # views: not a second copy
    assert W.checkpoint_state(fused).keys() == W.checkpoint_state(plain).keys()
    assert all(torch.equal(a, b) for a, b in zip(W.checkpoint_state(fused).values(),
                                                 W.checkpoint_state(plain).values()))
    for branch in ("und", "gen"):
        torch.testing.assert_close(stack_forward(fused, branch), stack_forward(plain, branch), rtol=1e-5, atol=1e-5)
    want = stack_forward(fused, "und", rows=1)
    for m in fused.modules():
        if hasattr(m, "gated_down"):
            m.gated_down = True                     # CUDA's one-launch silu*mul + down: the CPU runs the two
    assert torch.equal(stack_forward(fused, "und", rows=1), want)
    # the fused GEMM ran (not the layers): a layer's output from it is its rows of the one result
    attn = fused.language_model.model.layers[0].self_attn
    x = torch.randn(3, fused.cfg.llm.hidden_size)
    with torch.no_grad():
        q, k, v = attn.fused[""](x)
        torch.testing.assert_close(k, attn.k_proj(x))
        assert q.shape[1] == attn.q_proj.out_features and q.stride(0) == sum(attn.fused[""].splits)
        assert attn.fused[""](torch.randn(17, x.shape[1])) is None           # more rows than decode: the layers
    assert attn.fused[""](x) is None                                          # autograd on: the layers


def test_weight_update_and_lora_merge_land_in_the_fused_weight(tiny_dir, forced, tmp_path):
    model = load_model(tiny_dir, "und", lora=[])
    base = W.checkpoint_state(model)
    key = "language_model.model.layers.1.self_attn.k_proj.weight"
    new = (0.05 * torch.randn(base[key].shape)).to(torch.bfloat16)
    save_file({key: new}, str(tmp_path / "upd.safetensors"))
    live = W.LiveWeights(model)
    live.stage("2", str(tmp_path / "upd.safetensors"))
    live.commit()
    rows = model.language_model.model.layers[1].self_attn.fused[""]
    assert _aliased(rows) and torch.equal(rows.weight[rows.splits[0]:sum(rows.splits[:2])], new.float())
    adapter = write_tiny_lora(str(tmp_path / "lora"), tiny_dir, rank=4)
    want = load_model(tiny_dir, "und", lora=[(adapter, 0.7)])
    fuse_projections(want, on=False)
    merge_lora(model, adapter, 0.7)
    model_state, want_state = W.checkpoint_state(model), W.checkpoint_state(want)
    torch.testing.assert_close(model_state["language_model.model.layers.0.mlp.up_proj.weight"],
                               want_state["language_model.model.layers.0.mlp.up_proj.weight"])
    assert all(_aliased(r) for r in _groups(model))


def test_lora_hooks_run_the_separate_layers(tiny_dir, forced):
    model = load_model(tiny_dir, "und", lora=[])
    x = torch.randn(2, model.cfg.llm.hidden_size)
    rows = model.language_model.model.layers[0].self_attn.fused[""]
    with torch.no_grad():
        assert rows(x) is not None
        LoraRegistry(model, 1, 4)          # a forward hook on every target layer
        assert rows(x) is None


def test_to_and_assign_load_refuse(tiny_dir, forced):
    model = load_model(tiny_dir, "und", lora=[])
    want = stack_forward(model, "und").to(torch.bfloat16)
    model.to(torch.bfloat16)
    assert all(_aliased(r) and r.weight.dtype == torch.bfloat16 for r in _groups(model))
    torch.testing.assert_close(stack_forward(model, "und"), want, rtol=2e-2, atol=2e-2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert all(_aliased(r) for r in _groups(model)) and len(list(_groups(model))) == 2 * model.num_layers


@pytest.mark.parametrize("world", [1, 2])
def test_tp_shards_fuse_per_rank(tiny_dir, forced, world):
    for rank in range(world):
        tp = TPContext(rank, world)
        fused = load_model(tiny_dir, "und", tp=tp, lora=[])
        plain = load_model(tiny_dir, "und", tp=tp, lora=[])
        fuse_projections(plain, on=False)
        a, b = fused.language_model.model.layers[1], plain.language_model.model.layers[1]
        assert _aliased(a.self_attn.fused[""]) and _aliased(a.mlp.fused["gate_up"])
        for n in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(a.self_attn, n).weight, getattr(b.self_attn, n).weight)
        x = torch.randn(4, fused.cfg.llm.hidden_size)
        with torch.no_grad():
            for got, lin in zip(a.mlp.fused["gate_up"](x), (b.mlp.gate_proj, b.mlp.up_proj)):
                torch.testing.assert_close(got, lin(x))


def test_quantised_layers_keep_their_own_layout(tiny_dir, forced):
    model = load_model(tiny_dir, "und", lora=[], quantization="fp8")
    layer = model.language_model.model.layers[0]
    assert "" not in layer.self_attn.fused and hasattr(layer.self_attn, "qkv_proj")
    assert not hasattr(layer.mlp, "fused")                      # Fp8SwiGLU: its own gate|up GEMM
    stack_forward(model, "und")
    from services.model.quant import quantize_model
    und = load_model(tiny_dir, "und", lora=[])
    quantize_model(und, ("und",))                                # quantising a fused model drops its fusion
    assert "" not in und.language_model.model.layers[0].self_attn.fused
    stack_forward(und, "und")
