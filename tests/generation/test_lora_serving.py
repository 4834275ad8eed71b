"""LoRA adapters merged at load (`--lora PATH[:STRENGTH]`), the 8-step preset, fp8 serving on CPU.

Real generation server processes; a small LoRA file written by the test; images compared with the
reference pipeline on a model loaded the same way.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.model.loader import lora_branches, load_model

from .genhelp import GenServer, body, errors_of, generate, images_of, prefixes, publish, reference_pixels

MODULES = ("self_attn.q_proj_mot_gen", "self_attn.o_proj_mot_gen", "mlp_mot_gen.down_proj",
           "self_attn.v_proj")   # the last one is an und weight: the gen service skips it


def write_lora(path: str, model, rank: int = 4, alpha: float = 8.0) -> str:
    g = torch.Generator().manual_seed(7)
    params = dict(model.named_parameters())
    out = {}
    for i in range(model.num_layers):
        for mod in MODULES:
            w = params[f"language_model.model.layers.{i}.{mod}.weight"]
            base = f"language_model.model.layers.{i}.{mod}"
            out[base + ".lora_down.weight"] = 0.5 * torch.randn(rank, w.shape[1], generator=g)
            out[base + ".lora_up.weight"] = 0.5 * torch.randn(w.shape[0], rank, generator=g)
            out[base + ".alpha"] = torch.tensor(alpha)
    save_file(out, path)
    return path


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory, ref_model):
    return write_lora(str(tmp_path_factory.mktemp("lora") / "adapter.safetensors"), ref_model[0])


def _serve_and_compare(tiny_dir, pool, ref_model, flags, want_model, rid, cmp_with=None):
    pre = prefixes(ref_model, guidance_scale=4.0)
    b = body(rid, None, num_inference_steps=3)
    server = GenServer(tiny_dir, pool.name, *flags).start()
    try:
        status, events = generate(server.url, {**b, "handles": publish(pool, pre)})
    finally:
        server.stop()
    assert status == 200 and not errors_of(events), events
    got = images_of(events)[0]
    assert np.array_equal(got, reference_pixels(want_model, pre, b)[0])
    return got, b, pre


def test_lora_flag_merges_into_the_gen_branch(tiny_dir, pool, ref_model, gen_server, lora_file):
    assert lora_branches(lora_file) == {"gen", "und"}
    merged = load_model(tiny_dir, "both", lora=[(lora_file, 0.7)])
    got, b, pre = _serve_and_compare(tiny_dir, pool, ref_model, ["--lora", f"{lora_file}:0.7"], merged,
                                     "lora-on")
    status, events = generate(gen_server.url, {**b, "request_id": "lora-off",
                                               "handles": publish(pool, pre)})
    assert status == 200
    assert not np.array_equal(got, images_of(events)[0])   # the adapter changed the image


def test_fp8_serving_on_cpu_is_the_emulated_reference(tiny_dir, pool, ref_model):
    fp8 = load_model(tiny_dir, "both", quantization="fp8")
    got, b, pre = _serve_and_compare(tiny_dir, pool, ref_model, ["--quantization", "fp8"], fp8, "fp8")
    exact = reference_pixels(ref_model[0], pre, b)[0]
    diff = np.abs(got.astype(int) - exact.astype(int))
    assert 0 < diff.max() and diff.mean() < 2.0   # close to fp32, not equal


def test_preset_and_flags_reach_the_services(tmp_path, lora_file):
    from services.model.presets import PRESETS
    p = PRESETS["8step"]   # OpenSenseNova/SenseNova-U1 docs/base_vs_distill.md
    assert (p.num_inference_steps, p.guidance_scale, p.timestep_shift, p.cfg_norm) == (8, 1.0, 3.0, "none")
    out = subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "tiny", "--device", "cpu",
                          "--preset", "8step", "--lora", f"{lora_file}:0.5", "--quantization", "fp8",
                          "--dry-run"], check=True, capture_output=True, text=True).stdout
    lines = {ln.split(":", 1)[0]: ln for ln in out.splitlines() if ln.startswith(("und:", "gen:", "gateway:"))}
    assert f"U1SERVE_LORA={lora_file}:0.5" in lines["und"]
    assert f"--lora {lora_file}:0.5" in lines["gen"] and "--quantization fp8" in lines["gen"]
    assert "--default-size 64x64" in lines["gen"]
    assert "--default-steps 8 --default-guidance 1.0 --default-timestep-shift 3.0" in lines["gateway"]
    bad = subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "tiny", "--device", "cpu",
                          "--lora", str(tmp_path / "missing.safetensors"), "--dry-run"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no such file" in bad.stderr + bad.stdout


def test_gateway_takes_the_preset_defaults():
    from services.gateway.config import build_arg_parser, config_from_args
    cfg = config_from_args(build_arg_parser().parse_args(
        ["--default-steps", "8", "--default-guidance", "1.0", "--default-timestep-shift", "3.0"]))
    s = cfg.sampler
    assert (s.num_inference_steps, s.guidance_scale, s.timestep_shift) == (8, 1.0, 3.0)


def test_und_loader_merges_only_adapters_that_name_it(tiny_dir, lora_file, monkeypatch):
    base = load_model(tiny_dir, "und")
    monkeypatch.setenv("U1SERVE_LORA", f"{lora_file}:0.5")
    und = load_model(tiny_dir, "und")   # what the understanding service loads under `up --lora`
    k = "language_model.model.layers.0.self_attn.v_proj.weight"
    assert not torch.equal(und.state_dict()[k], base.state_dict()[k])
    k = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(und.state_dict()[k], base.state_dict()[k])
