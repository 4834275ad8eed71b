"""services/model/weights_io.py: the model <-> checkpoint-key mapping both ways, and staged live updates
compared with a fresh load of the updated checkpoint (plain, fp8 rows, a TP shard, LoRA deltas)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from services.model import weights_io as W
from services.model.loader import load_model
from services.model.parallel import TPContext

GEN_KEYS = ("language_model.model.layers.0.self_attn.k_proj_mot_gen.weight",
            "language_model.model.layers.1.mlp_mot_gen.up_proj.weight",
            "language_model.model.layers.0.self_attn.o_proj_mot_gen.weight",
            "fm_modules.timestep_embedder.mlp.0.weight")
UND_KEYS = ("language_model.model.layers.1.self_attn.q_proj.weight",
            "language_model.model.layers.0.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def base_state(tiny_dir):
    return W.checkpoint_state(load_model(tiny_dir, "both"))


def new_values(base_state, keys, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (0.05 * torch.randn(base_state[k].shape, generator=g)).to(torch.bfloat16) for k in keys}


def updated_checkpoint(tiny_dir: str, base_state: dict, new: dict, out: str) -> str:
    """The tiny checkpoint with `new` replacing its tensors (bf16, as the original)."""
    shutil.copytree(tiny_dir, out)
    for name in os.listdir(out):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(out, name))
    W.write_tensors({**{k: v.to(torch.bfloat16) for k, v in base_state.items()}, **new}, out, max_shard_bytes=200_000)
    return out


def same_model(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_round_trips_through_the_loader(tiny_dir, tmp_path):
    model = load_model(tiny_dir, "both")
    out = W.write_checkpoint_weights(model, str(tmp_path / "w"), max_shard_bytes=300_000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))     # sharded as the loader reads
    shutil.copy(os.path.join(tiny_dir, "config.json"), out)
    assert same_model(load_model(out, "both"), model)
    gen = W.checkpoint_state(model, "gen")
    assert gen and all(W.key_branch(k) == "gen" for k in gen)
    assert set(gen) | set(W.checkpoint_state(model, "und")) == set(W.checkpoint_shapes(model))


@pytest.mark.parametrize("quantization", ["none", "fp8", "int8"])
def test_staged_update_equals_a_fresh_load(tiny_dir, base_state, tmp_path, quantization):
    new = new_values(base_state, GEN_KEYS + UND_KEYS)
    W.write_tensors(new, str(tmp_path / "update"))
    model = load_model(tiny_dir, "gen", quantization=quantization)
    staged = W.stage_update(model, str(tmp_path / "update"))
    assert sorted(staged.keys) == sorted(GEN_KEYS) and sorted(staged.skipped) == sorted(UND_KEYS)
    assert staged.commit() == len(GEN_KEYS)
    fresh = load_model(updated_checkpoint(tiny_dir, base_state, new, str(tmp_path / "ckpt")), "gen",
                       quantization=quantization)
    assert same_model(model, fresh)
    if quantization == "fp8":     # the export reads fp8 rows back (dequantised where no model-dtype copy is kept)
        got = W.checkpoint_state(model, "gen")[GEN_KEYS[0]]
        assert torch.allclose(got, new[GEN_KEYS[0]].float(), rtol=0.07, atol=1e-3)   # e4m3: 3 mantissa bits


def test_a_tensor_parallel_rank_takes_its_shard(tiny_dir, base_state, tmp_path):
    new = new_values(base_state, UND_KEYS + ("language_model.model.layers.0.self_attn.o_proj.weight",))
    W.write_tensors(new, str(tmp_path / "update"))
    ckpt = updated_checkpoint(tiny_dir, base_state, new, str(tmp_path / "ckpt"))
    for rank in (0, 1):
        tp = TPContext(rank, 2)      # loading and staging need no collective
        model = load_model(tiny_dir, "und", tp=tp)
        W.stage_update(model, str(tmp_path / "update")).commit()
        assert same_model(model, load_model(ckpt, "und", tp=tp))


def test_bad_updates_are_refused_and_change_nothing(tiny_dir, base_state, tmp_path):
    model = load_model(tiny_dir, "gen")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    k0, k1, k2 = GEN_KEYS[:3]
    cases = {
        "unknown": ({"language_model.model.layers.9.nope.weight": torch.zeros(2)}, ["unknown", "layers.9.nope"]),
        "shape": ({k0: torch.zeros(3, 3)}, ["wrong shape", k0, "(3, 3)"]),
        "nan": ({k1: torch.full(base_state[k1].shape, float("nan"))}, ["NaN or Inf", k1]),
        "inf_after_cast": ({k2: torch.full(base_state[k2].shape, 1e39, dtype=torch.float64)}, ["NaN or Inf", k2]),
        "int": ({k2: torch.zeros(base_state[k2].shape, dtype=torch.int32)}, ["not a float dtype", k2]),
    }
    for name, (tensors, words) in cases.items():
        good = new_values(base_state, GEN_KEYS[3:])       # valid tensors in the same update: not applied either
        d = W.write_tensors({**good, **tensors}, str(tmp_path / name))
        with pytest.raises(W.UpdateError) as e:
            W.stage_update(model, d)
        assert all(w in str(e.value) for w in words), (name, str(e.value))
    live = W.LiveWeights(model)
    with pytest.raises(W.UpdateError):
        live.stage("1", str(tmp_path / "nan"))
    assert live.staged is None and live.version == "0"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _official_lora(path: str, params: dict, modules, rank=4, alpha=8.0) -> str:
    g = torch.Generator().manual_seed(3)
    out = {}
    for m in modules:
        w = params[m + ".weight"]
        out[m + ".lora_down.weight"] = 0.3 * torch.randn(rank, w.shape[1], generator=g)
        out[m + ".lora_up.weight"] = 0.3 * torch.randn(w.shape[0], rank, generator=g)
        out[m + ".alpha"] = torch.tensor(alpha)
    save_file(out, path)
    return path


def _peft_from_official(official: str, out_dir: str, alpha: float, r: int) -> str:
    from safetensors import safe_open
    os.makedirs(out_dir)
    tensors = {}
    with safe_open(official, "pt") as f:
        for k in f.keys():
            if k.endswith(".lora_down.weight"):
                m = k[: -len(".lora_down.weight")]
                tensors[f"base_model.model.{m}.lora_A.weight"] = f.get_tensor(k)
                tensors[f"base_model.model.{m}.lora_B.weight"] = f.get_tensor(m + ".lora_up.weight")
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    return out_dir


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_lora_delta_equals_the_merge_at_load(tiny_dir, tmp_path, quantization):
    params = {k: torch.empty(s) for k, s in W.checkpoint_shapes(load_model(tiny_dir, "gen")).items()}
    mods = [k[: -len(".weight")] for k in GEN_KEYS] + ["language_model.model.layers.0.self_attn.v_proj"]
    official = _official_lora(str(tmp_path / "a.safetensors"), params, mods)
    peft = _peft_from_official(official, str(tmp_path / "peft"), alpha=8.0, r=4)
    want = load_model(tiny_dir, "gen", lora=[(official, 0.7)], quantization=quantization)
    for adapter in (official, peft):
        model = load_model(tiny_dir, "gen", quantization=quantization)
        W.stage_update(model, lora=adapter, lora_strength=0.7).commit()
        if quantization == "none":
            assert same_model(model, want), adapter
        else:   # CPU fp8 keeps no model-dtype rows: the delta lands on the dequantised weights
            a, b = W.checkpoint_state(model, "gen"), W.checkpoint_state(want, "gen")
            assert all(torch.allclose(a[k], b[k], atol=0.02, rtol=0.1) for k in a)


def test_a3b_expert_keys_export_update_and_shard(tiny_checkpoint, tmp_path):
    """A3B experts are stacked in the model (model/moe.py); export, live updates and TP shards still go by the
    official per-expert keys, each a view of its rows."""
    from services.model.checkpoint_files import weight_map
    a3b = tiny_checkpoint("a3b")
    state = W.checkpoint_state(load_model(a3b, "both"))
    assert set(state) == set(weight_map(a3b))
    layer = "language_model.model.layers.1."
    keys = (layer + "mlp.experts.3.up_proj.weight", layer + "mlp.experts.0.down_proj.weight",
            layer + "mlp.experts.5.gate_proj.weight")
    new = new_values(state, keys)
    W.write_tensors(new, str(tmp_path / "update"))
    ckpt = updated_checkpoint(a3b, state, new, str(tmp_path / "ckpt"))
    for tp in (None, TPContext(1, 2)):
        model = load_model(a3b, "und", tp=tp)
        assert W.stage_update(model, str(tmp_path / "update")).commit() == len(keys)
        assert same_model(model, load_model(ckpt, "und", tp=tp))
