"""Checkpoint loading: all families, branch-selective keys, clear errors, parameter counts, LoRA."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model.config import ConfigError, load_config, parse_config
from services.model.checkpoint_files import LoadError
from services.model.loader import load_model, merge_lora
from services.model.model import NeoModel
from services.model.tiny import full_config, tiny_config


@pytest.mark.parametrize("variant", ["u1", "u1.5", "a3b"])
def test_tiny_checkpoints_load_every_branch(tiny_checkpoint, variant):
    d = tiny_checkpoint(variant)
    cfg = load_config(d)
    assert cfg.family == variant
    both = load_model(d, "both")
    und = load_model(d, "und")
    gen = load_model(d, "gen")
    und_keys = set(dict(und.named_parameters()))
    gen_keys = set(dict(gen.named_parameters()))
    assert und_keys | gen_keys == set(dict(both.named_parameters()))
    assert not und_keys & gen_keys
    assert all("_mot_gen" not in k and not k.startswith("fm_modules") for k in und_keys)
    assert all("_mot_gen" in k or k.startswith("fm_modules") for k in gen_keys)
    assert "language_model.lm_head.weight" in und_keys and "language_model.model.embed_tokens.weight" in und_keys
    for k, p in und.named_parameters():
        assert torch.equal(p, dict(both.named_parameters())[k])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _first_shard(d):
    wm = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    name = sorted(set(wm.values()))[0]
    return os.path.join(d, name), wm


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("u1"), tmp_path / "c")
    path, _ = _first_shard(d)
    sd = load_file(path)
    victim = sorted(k for k in sd if "_mot_gen" in k)[0]
    del sd[victim]
    save_file(sd, path)
    idx = os.path.join(d, "model.safetensors.index.json")
    j = json.load(open(idx))
    del j["weight_map"][victim]
    json.dump(j, open(idx, "w"))
    with pytest.raises(LoadError, match=victim.replace(".", r"\.")):
        load_model(d, "gen")
    load_model(d, "und")  # the und branch does not need it


def test_unexpected_and_misshaped_tensors_are_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("u1"), tmp_path / "c")
    path, _ = _first_shard(d)
    sd = load_file(path)
    key = sorted(sd)[0]
    sd2 = dict(sd)
    sd2[key] = torch.zeros(*[s + 1 for s in sd[key].shape], dtype=sd[key].dtype)
    save_file(sd2, path)
    with pytest.raises(LoadError, match=rf"{key.replace('.', '[.]')}.*shape"):
        load_model(d, "both")
    sd["language_model.model.layers.0.bogus.weight"] = torch.zeros(2)
    save_file(sd, path)
    idx = os.path.join(d, "model.safetensors.index.json")
    j = json.load(open(idx))
    j["weight_map"]["language_model.model.layers.0.bogus.weight"] = os.path.basename(path)
    json.dump(j, open(idx, "w"))
    with pytest.raises(LoadError, match="unexpected tensor 'language_model.model.layers.0.bogus.weight'"):
        load_model(d, "both")


def test_corrupt_and_missing_files(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("u1"), tmp_path / "c")
    path, _ = _first_shard(d)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(LoadError, match="corrupt or unreadable"):
        load_model(d, "both")
    os.remove(path)
    with pytest.raises(LoadError, match="missing"):
        load_model(d, "both")
    d2 = _copy(tiny_checkpoint("u1"), tmp_path / "d")
    open(os.path.join(d2, "model.safetensors.index.json"), "w").write("{not json")
    with pytest.raises(LoadError, match="not a valid safetensors index"):
        load_model(d2, "both")


def test_single_file_checkpoint(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("u1.5")
    d = tmp_path / "single"
    d.mkdir()
    sd = {}
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(src, name)))
        elif not name.endswith("index.json"):
            shutil.copy(os.path.join(src, name), d / name)
    save_file(sd, str(d / "model.safetensors"))
    a, b = load_model(str(d), "gen"), load_model(src, "gen")
    for (k, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), k


def test_config_quirks_and_errors():
    c = tiny_config("u1")
    c["vision_config"]["llm_hidden_size"] = [64]  # 1-tuple quirk
    c["vision_config"]["downsample_ratio"] = [0.5]
    assert parse_config(c).vision.llm_hidden_size == 64
    del c["vision_config"]["llm_hidden_size"]  # missing -> LLM width, never 2048
    assert parse_config(c).vision.llm_hidden_size == 64
    c["llm_config"]["rope_parameters"] = {"rope_theta": 123.0}
    del c["llm_config"]["rope_theta"]  # transformers-5 layout
    assert parse_config(c).llm.rope_theta == 123.0
    bad = tiny_config("u1")
    del bad["noise_scale_max_value"]
    with pytest.raises(ConfigError, match="noise_scale_max_value"):
        parse_config(bad)
    moe = tiny_config("u1")
    moe["llm_config"]["num_experts"] = 4  # MoE detected by expert count alone
    assert parse_config(moe).llm.is_moe


def test_full_size_parameter_counts():
    with torch.device("meta"):
        n8 = sum(p.numel() for p in NeoModel(parse_config(full_config("u1-8b"))).parameters())
        na3 = sum(p.numel() for p in NeoModel(parse_config(full_config("a3b-full"))).parameters())
    assert abs(n8 / 17.55e9 - 1) < 0.01
    # A3B: 48 x (attention 2 branches + 128 und + 32 gen experts + routers) + embeddings (computed).
    h, layers, d = 2048, 48, 128
    attn = h * 32 * d * 2 + h * 4 * d * 2
    expert = 3 * h * 768
    per_layer = 2 * attn + (128 + 32) * expert + (128 + 32) * h
    assert abs(na3 - (layers * per_layer + 2 * 151936 * h)) / na3 < 0.01


def _write_lora(path, model, prefix="", rank=4, alpha=2.0, gen_only=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.dim() != 2 or ".layers." not in name or (gen_only and "_mot_gen" not in name):
            continue
        base = prefix + name[:-len(".weight")]
        out[base + ".lora_down.weight"] = torch.randn(rank, p.shape[1], generator=g)
        out[base + ".lora_up.weight"] = torch.randn(p.shape[0], rank, generator=g)
        out[base + ".alpha"] = torch.tensor(alpha)
    save_file(out, path)
    return out


@pytest.mark.parametrize("prefix", ["", "diffusion_model."])
def test_lora_merge(tiny_checkpoint, tmp_path, prefix):
    d = tiny_checkpoint("u1")
    base = load_model(d, "gen")
    lora = _write_lora(str(tmp_path / "l.safetensors"), base, prefix)
    merged = load_model(d, "gen", lora=str(tmp_path / "l.safetensors"), lora_strength=0.5)
    name = "language_model.model.layers.1.self_attn.q_proj_mot_gen.weight"
    b = prefix + name[:-len(".weight")]
    expect = base.state_dict()[name] + 0.5 * (2.0 / 4) * (lora[b + ".lora_up.weight"] @ lora[b + ".lora_down.weight"])
    torch.testing.assert_close(merged.state_dict()[name], expect)
    und = load_model(d, "und")  # gen-only LoRA matches nothing in the und branch
    with pytest.raises(LoadError, match="matched no weight"):
        merge_lora(und, str(tmp_path / "l.safetensors"))


def test_config_only_dir_serves_random_weights(tmp_path, monkeypatch):
    """Full-size geometries are benchmarked from a config-only dir with U1SERVE_RANDOM_WEIGHTS=1."""
    from services.model.tiny import write_full_config, write_tokenizer

    d = str(tmp_path / "cfg")
    write_full_config(d, "u1-8b")
    assert sorted(os.listdir(d)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    small = str(tmp_path / "small")
    os.makedirs(small)
    json.dump(tiny_config("u1.5"), open(os.path.join(small, "config.json"), "w"))
    write_tokenizer(small)
    with pytest.raises(LoadError, match="no model.safetensors"):
        load_model(small, "gen")
    monkeypatch.setenv("U1SERVE_RANDOM_WEIGHTS", "1")
    m = load_model(small, "gen")
    assert m.branch == "gen" and m.fingerprint and all(torch.isfinite(p).all() for p in m.parameters())


def test_tiny_checkpoint_is_deterministic_per_seed(tmp_path):
    from services.model.tiny import write_tiny_checkpoint

    a = write_tiny_checkpoint(str(tmp_path / "a"), "u1.5", seed=3)
    b = write_tiny_checkpoint(str(tmp_path / "b"), "u1.5", seed=3)
    c = write_tiny_checkpoint(str(tmp_path / "c"), "u1.5", seed=4)
    for name in sorted(os.listdir(a)):
        assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read(), name
    sa, sc = load_model(a, "gen").state_dict(), load_model(c, "gen").state_dict()
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
