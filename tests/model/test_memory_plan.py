"""The memory plan's exact figures (services/model/memory_plan.py) against what the code really allocates on the tiny
checkpoint: each engine's weights loaded in every format (float, fp8 with and without its model-dtype copy, int8,
GGUF Q8_0 / Q4_K and a per-layer GGUF mix), the understanding KV pool and page table, generation's job KV buffer,
the shared KV pool's segment; and `u1serve plan` on the 8B config alone (no weights)."""
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from services.model import memory_plan as M
from services.model.config import load_config
from services.model.convert import convert_checkpoint
from services.model.loader import load_model

ITEMSIZE = 4      # float32 on the CPU


def _device_bytes(model) -> int:
    """Every distinct tensor the model holds (parameters and buffers, shared ones once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path = tiny_checkpoint("u1")
    cfg = load_config(path)
    return path, cfg, {b: M.branch_weights(cfg, b) for b in ("und", "gen")}


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    made = {}

    def get(to: str) -> str:
        if to not in made:
            made[to] = convert_checkpoint(tiny[0], str(tmp_path_factory.mktemp("c")), to)
        return made[to]
    return get


@pytest.mark.parametrize("branch", ["und", "gen"])
@pytest.mark.parametrize("fmt,quantization", [("bf16", "none"), ("int8", "int8"), ("fp8-only", "fp8")])
def test_weights_match_the_loaded_model(tiny, branch, fmt, quantization):
    path, _, weights = tiny
    model = load_model(path, branch=branch, dtype=torch.float32, quantization=quantization)
    assert _device_bytes(model) == weights[branch].gpu_bytes(fmt, ITEMSIZE)


def test_fp8_with_its_model_dtype_copy(tiny):
    """fp8 as served on CUDA (GemmPolicy min_tokens > 0) keeps the float weights beside the fp8 ones."""
    from services.model.quant import GemmPolicy, quantize_model
    path, _, weights = tiny
    model = load_model(path, branch="gen", dtype=torch.float32)
    quantize_model(model, ("gen",), policy=GemmPolicy(min_tokens=1024))
    assert _device_bytes(model) == weights["gen"].gpu_bytes("fp8", ITEMSIZE)


@pytest.mark.parametrize("to", ["gguf:q8_0", "gguf:q4_k", "gguf:q8_0:0,q4_k:1-"])
def test_gguf_is_float_on_the_device_and_its_file_is_what_the_plan_says(tiny, converted, to):
    import gguf
    _, _, weights = tiny
    out = converted(to)
    for branch in ("und", "gen"):
        model = load_model(out, branch=branch, dtype=torch.float32)
        assert _device_bytes(model) == weights[branch].gpu_bytes("q4_k", ITEMSIZE) == \
            weights[branch].gpu_bytes("bf16", ITEMSIZE)
    reader = gguf.GGUFReader(os.path.join(out, "model.gguf"))
    got = sum(int(t.n_bytes) for t in reader.tensors)
    from services.model.convert import parse_target
    _, layer_types = parse_target(to)
    # the file holds both branches; the parts both share (norm weights of shared layers: none) are counted once
    both = M.BranchWeights("both", weights["und"].plain_numel + weights["gen"].plain_numel,
                           weights["und"].targets + weights["gen"].targets)
    assert got == both.file_bytes(layer_types.per_layer(len({t[0] for t in both.targets})), itemsize=2)


def test_understanding_kv_pool_and_page_table(tiny):
    from services.understanding.model_runner import ModelRunner
    path, cfg, weights = tiny
    model = load_model(path, branch="und", dtype=torch.float32)
    s = M.Settings(itemsize=ITEMSIZE, kv_cache_tokens=300, max_running=5, max_model_len=200)
    runner = ModelRunner(model, s.kv_cache_tokens, s.max_running, s.max_model_len, "cpu", torch.float32, warmup=False)
    plan = M.und_plan(cfg, weights["und"], s)
    assert runner.kv_pool.nbytes == plan.parts["kv_cache"]
    assert runner.req_to_token.nbytes == plan.parts["page_table"]


def test_generation_job_kv_is_capacity_s_reference_job(tiny):
    """The plan's job KV buffer is the one generation sizes its queue by (capacity.py: 1024², CFG, 512 prefix
    tokens); the plan's worst case is the larger of an edit at the largest size and a full batch of small jobs."""
    from services.generation import capacity
    path, cfg, weights = tiny
    model = load_model(path, branch="gen", dtype=torch.float32)
    measured = capacity.measure(model, torch.device("cpu"), world=1)
    assert M.job_kv_bytes(cfg.llm, ITEMSIZE, M.REFERENCE_PREFIX_TOKENS + 1024, 2) == measured["job_kv_bytes"]
    s = M.Settings(itemsize=ITEMSIZE)
    edit = M.job_kv_bytes(cfg.llm, ITEMSIZE, M.REFERENCE_PREFIX_TOKENS + 2 * 4096, 3)
    assert M.gen_plan(cfg, weights["gen"], s, side=2048).parts["job_kv"] == edit
    small = M.gen_plan(cfg, weights["gen"], s, side=256).parts["job_kv"]     # 16 jobs of 256 rows
    assert small == 16 * M.job_kv_bytes(cfg.llm, ITEMSIZE, M.REFERENCE_PREFIX_TOKENS + 64, 2)


def test_shared_pool_segment(tiny):
    from shm_transfer import KVLayout
    from shm_transfer.pool import ShmKVPool
    _, cfg, _ = tiny
    s = M.Settings(itemsize=ITEMSIZE, kv_pool_gb=0.01)
    llm = cfg.llm
    layout = KVLayout(num_layers=llm.num_hidden_layers, num_kv_heads=llm.num_key_value_heads, head_dim=llm.head_dim,
                      dtype="float32", page_tokens=s.kv_page_tokens)
    name = f"u1kv-test-plan-{uuid.uuid4().hex[:10]}"
    with ShmKVPool.create(name, layout, int(s.kv_pool_gb * M.GiB), "fp") as pool:
        try:
            assert os.fstat(pool._seg.fd).st_size == M.host_pool_bytes(cfg, s)
        finally:
            pool.unlink()


def test_plan_of_the_8b_config_alone(tmp_path):
    """`u1serve plan` on a full-size config without weights: the 8B branches' real parameter counts, and a 24 GiB
    colocated card that bf16 overflows and int8 fits (the flags say how)."""
    from services.model.tiny import write_full_config
    d = write_full_config(str(tmp_path / "u1-8b"), "u1-8b")
    assert not any(n.endswith((".safetensors", ".gguf")) for n in os.listdir(d))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-m", "services.launch.cli", "plan", "--model", d, "--gpu-memory", "24GiB",
                           "--gpu-total", "80GiB", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    sizes = {(r["branch"], r["format"]): r["gpu_bytes"] for r in out["weights"]}
    assert sizes[("und", "bf16")] == 9_365_982_720 * 2 and sizes[("gen", "bf16")] == 8_186_358_272 * 2
    assert sizes[("gen", "q4_k")] == sizes[("gen", "bf16")]          # GGUF is dequantised at load
    assert sizes[("gen", "int8")] < sizes[("gen", "bf16")] * 0.55 < sizes[("gen", "fp8")]
    assert out["asked"]["fits"] is False and out["fix"]["fits"] is True
    flags = out["fix"]["flags"]
    value = lambda name: flags[flags.index(name) + 1]   # noqa: E731
    assert value("--quantization") == "int8" and value("--und-args").startswith("--quantization int8")
    side = out["fix"]["max_image_side"]
    assert value("--gateway-args") == f"--max-pixels {side * side}" and value("--default-size") == f"{side}x{side}"
    fractions = float(value("--gen-memory-fraction")) + float(value("--und-memory-fraction"))
    assert fractions * 80 + 2 * M.CUDA_CONTEXT_BYTES / M.GiB <= 24 + 1e-6       # the cap, contexts included
    eng = out["fix"]["understanding"], out["fix"]["generation"]
    assert sum(e["total_bytes"] for e in eng) <= 24 * M.GiB


def test_a_format_quantised_at_load_says_when_the_float_load_is_over_the_cap(tmp_path):
    """int8 from a float checkpoint loads the float weights first: under a 24 GiB colocated cap that is over each
    engine's share (an H100 run ran out of memory there at load), so the plan says to convert first; bf16 at 48 GiB
    needs no such step."""
    from services.model.tiny import write_full_config
    d = write_full_config(str(tmp_path / "u1-8b"), "u1-8b")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = lambda cap: subprocess.run([sys.executable, "-m", "services.launch.cli", "plan", "--model", d,  # noqa: E731
                                      "--gpu-memory", cap], capture_output=True, text=True, env=env, timeout=120)
    out24, out48 = run("24GiB"), run("48GiB")
    assert out24.returncode == 0 and out48.returncode == 0, out24.stderr + out48.stderr
    for engine in ("understanding", "generation"):
        assert f"{engine}: loading a float checkpoint peaks at" in out24.stdout, out24.stdout
    assert "u1serve convert MODEL OUT --to int8" in out24.stdout
    assert "loading a float checkpoint" not in out48.stdout, out48.stdout
