"""The memory plan's exact figures (services/model/memory_plan.py) against what the code really allocates on the tiny
checkpoint: each engine's weights loaded in every format (float, fp8 with and without its model-dtype copy, int8,
GGUF Q8_0 / Q4_K and a per-layer GGUF mix), the understanding KV pool and page table, generation's job KV buffer,
the shared KV pool's segment (host shared memory, or the fused mode's pages on the device); and `u1serve plan` on the
8B config alone (no weights), in the two-process and the fused colocate mode (the CLI in this process: a plan starts
nothing, tests/launcher/dryrun.py)."""
import json
import os
import uuid

import pytest
import torch

from services.launch.cli import plan_image_limits
from services.model import memory_plan as M
from services.model.config import load_config
from services.model.convert import convert_checkpoint
from services.model.loader import load_model
from tests.launcher.dryrun import cli

ITEMSIZE = 4      # float32 on the CPU
LIMITS = plan_image_limits()      # the API's image limits, as the launcher passes them


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
    s = M.Settings(images=LIMITS, itemsize=ITEMSIZE, kv_cache_tokens=300, max_running=5, max_model_len=200)
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
    s = M.Settings(images=LIMITS, itemsize=ITEMSIZE)
    edit = M.job_kv_bytes(cfg.llm, ITEMSIZE, M.REFERENCE_PREFIX_TOKENS + 2 * 4096, 3)
    assert M.gen_plan(cfg, weights["gen"], s, side=2048).parts["job_kv"] == edit
    small = M.gen_plan(cfg, weights["gen"], s, side=256).parts["job_kv"]     # 16 jobs of 256 rows
    assert small == 16 * M.job_kv_bytes(cfg.llm, ITEMSIZE, M.REFERENCE_PREFIX_TOKENS + 64, 2)


@pytest.mark.parametrize("jobs", [2, 16])
def test_generation_rows_and_the_int8_product(tiny, jobs):
    """A step's rows are what the running jobs can bring, at most --max-batch-tokens (2 jobs of 1024² edits: 6,144,
    not 8,192), and int8 W8A8 adds its widest GEMM's int32 product (gate|up, 4 bytes an element), made at most
    PRODUCT_BLOCK_ROWS rows at a time (kernels/int8_gemm.py: the fused 24 GiB stack ran out of memory allocating
    the 768 MiB product of an n = 4 request's 8,192 rows in one piece)."""
    import dataclasses

    from kernels.int8_gemm import PRODUCT_BLOCK_ROWS
    path, cfg, weights = tiny
    s = M.Settings(images=LIMITS, itemsize=ITEMSIZE, max_running_jobs=jobs)
    tokens = M.image_tokens(1024, s.images.block)
    rows = max(tokens * s.edit_branches, min(s.max_batch_tokens, jobs * s.edit_branches * tokens))
    assert rows == (6144 if jobs == 2 else s.max_batch_tokens)
    bf16 = M.gen_plan(cfg, weights["gen"], s, side=1024)
    int8 = M.gen_plan(cfg, weights["gen"], dataclasses.replace(s, gen_format="int8"), side=1024)
    assert f"{rows} rows a step" in bf16.notes[0]
    llm = cfg.llm
    qkv = (llm.num_attention_heads + 2 * llm.num_key_value_heads) * llm.head_dim
    widest = max(2 * llm.intermediate_size, qkv)
    assert int8.parts["activations"] - bf16.parts["activations"] == \
        min(rows, PRODUCT_BLOCK_ROWS) * widest * M.INT8_PRODUCT_BYTES


def test_int8_product_in_row_blocks_is_the_same_bits():
    """int8_mm in row blocks (bounded int32 buffer) == in one piece, bit for bit."""
    import torch

    from kernels.int8_gemm import int8_mm, quant_int8_rowwise_ref
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 64, generator=g), torch.randn(48, 64, generator=g)
    qx, sx = quant_int8_rowwise_ref(x)
    qw, sw = quant_int8_rowwise_ref(w)
    whole = int8_mm(qx, qw, sx, sw.t(), torch.float32, block_rows=1 << 20)
    for block in (1, 8, 16, 36):
        assert torch.equal(int8_mm(qx, qw, sx, sw.t(), torch.float32, block_rows=block), whole)


@pytest.mark.parametrize("transport", ["shm", "device"])
def test_shared_pool_segment(tiny, transport):
    """The pool as the understanding service creates it: with the shm transport all of it in the host segment; with
    the fused mode's device transport the pages are a tensor on the device (here the CPU) and the segment keeps the
    header and page table: the plan's host and device figures."""
    from shm_transfer import KVLayout
    from shm_transfer import device_pages
    from shm_transfer.producer import create_producer
    _, cfg, _ = tiny
    s = M.Settings(images=LIMITS, itemsize=ITEMSIZE, kv_pool_gb=0.01)
    llm = cfg.llm
    layout = KVLayout(num_layers=llm.num_hidden_layers, num_kv_heads=llm.num_key_value_heads, head_dim=llm.head_dim,
                      dtype="float32", page_tokens=s.kv_page_tokens)
    name = f"u1kv-test-plan-{uuid.uuid4().hex[:10]}"
    host, device = M.pool_bytes(cfg, s, on_device=transport == "device")
    t = create_producer(transport, name, layout, int(s.kv_pool_gb * M.GiB), "fp",
                        **({"device": "cpu"} if transport == "device" else {}))
    try:
        assert os.fstat(t.pool._seg.fd).st_size == host
        pages = device_pages.lookup(name, t.pool.generation)
        assert (0 if pages is None else pages.nbytes) == device
        assert (device > 0) == (transport == "device")
    finally:
        t.pool.unlink()
        t.close()


def test_plan_of_the_8b_config_alone(tmp_path):
    """`u1serve plan` on a full-size config without weights: the 8B branches' real parameter counts, and a 24 GiB
    colocated card that bf16 overflows and int8 fits (the flags say how)."""
    from services.model.tiny import write_full_config
    d = write_full_config(str(tmp_path / "u1-8b"), "u1-8b")
    assert not any(n.endswith((".safetensors", ".gguf")) for n in os.listdir(d))
    proc = cli("plan", "--model", d, "--gpu-memory", "24GiB", "--gpu-total", "80GiB", "--json",
               "--weight-streaming-layers", "0")                                         # every layer resident
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
    rows = out["fix"]["generation"]["step_rows"]      # one denoise step's rows the plan counts: the gateway's bound
    assert rows >= 3 * (side // 32) ** 2                # at least one edit at the largest size (3 branches)
    assert value("--gateway-args") == f"--max-pixels {side * side} --max-step-pixels {rows * 32 * 32}"
    assert value("--default-size") == f"{side}x{side}"
    fractions = float(value("--gen-memory-fraction")) + float(value("--und-memory-fraction"))
    assert fractions * 80 + 2 * M.CUDA_CONTEXT_BYTES / M.GiB <= 24 + 1e-6       # the cap, contexts included
    eng = out["fix"]["understanding"], out["fix"]["generation"]
    assert sum(e["total_bytes"] for e in eng) <= 24 * M.GiB


def test_rl_counts_the_states_waiting_for_their_segments(tmp_path):
    """`--enable-rl` (as `u1serve up --enable-rl`): generation holds RL rollouts' states on the device until the side
    thread made their trajectory segments, the engine's budget (generation config.RL_WAITING_BYTES, one tally for
    every rollout: rollout.py) or one state of a step's largest job; counted once, the plan's generation grows by it."""
    from services.generation.config import RL_WAITING_BYTES
    plain = _plan_8b(tmp_path, "--gpu-memory", "80GiB", "--json")["asked"]["generation"]
    rl = _plan_8b(tmp_path, "--gpu-memory", "80GiB", "--json", "--enable-rl")["asked"]["generation"]
    assert "rl_states" not in plain["parts"]
    state = rl["step_rows"] * 32 * 32 * 3 * 4          # n x 3 f32 a pixel, n x pixels <= a step's rows x 32²
    assert rl["parts"]["rl_states"] == max(RL_WAITING_BYTES, state) >= RL_WAITING_BYTES
    assert rl["total_bytes"] - plain["total_bytes"] == rl["parts"]["rl_states"]


def _plan_8b(tmp_path, *args) -> dict:
    from services.model.tiny import write_full_config
    d = write_full_config(str(tmp_path / "u1-8b"), "u1-8b")
    proc = cli("plan", "--model", d, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if "--json" in args else proc.stdout


def test_int8_from_a_float_checkpoint_loads_within_its_share(tmp_path):
    """The loader quantises each layer as it reads it (layerwise_load.py), so int8 from a float checkpoint peaks at
    the int8 weights + one layer's float weights: within each engine's 24 GiB colocated share, no convert step."""
    out = _plan_8b(tmp_path, "--gpu-memory", "24GiB", "--json", "--weight-streaming-layers", "0")
    fix = out["fix"]
    for engine, branch in (("understanding", "und"), ("generation", "gen")):
        e = fix[engine]
        assert e["format"] == "int8"
        sizes = {(r["branch"], r["format"]): r for r in out["weights"]}
        layer = max(sizes[(branch, "bf16")]["layer_groups"].values())     # a group is >= one layer
        int8 = sizes[(branch, "int8")]["gpu_bytes"]
        assert int8 < e["load_peak_bytes"] < int8 + layer
        assert e["load_peak_bytes"] < e["total_bytes"] - e["parts"]["cuda_context"]
    text = _plan_8b(tmp_path, "--gpu-memory", "24GiB", "--weight-streaming-layers", "0")
    assert "understanding: load peak" in text and "generation: load peak" in text, text
    assert "convert" not in text and "OVER" not in text, text


@pytest.mark.parametrize("fmt,quantization", [("bf16", "none"), ("int8", "int8")])
def test_streamed_weights_match_the_loaded_model(tiny, fmt, quantization):
    """With weight streaming generation's device holds the weights outside the decoder layers and K slots of one
    layer each (services/model/weight_streaming.py), the host every layer: the plan's figures, as allocated."""
    from services.model.weight_streaming import stream_decoder_layers
    path, _, weights = tiny
    w = weights["gen"]
    model = load_model(path, branch="gen", dtype=torch.float32, quantization=quantization, layers_to_host=True)
    streamer = stream_decoder_layers(model, 1)
    outside = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if not n.startswith("language_model.model.layers.")}
    device = sum(t.numel() * t.element_size() for t in outside.values())
    device += sum(t.numel() * t.element_size() for slot in streamer.slots for t in slot)
    assert device == w.streamed_gpu_bytes(fmt, 1, ITEMSIZE) < w.gpu_bytes(fmt, ITEMSIZE)
    assert streamer.report()["host_bytes"] == w.host_layer_bytes(fmt, ITEMSIZE)
    assert w.streamed_gpu_bytes(fmt, 1, ITEMSIZE) + w.host_layer_bytes(fmt, ITEMSIZE) - \
        w.one_layer_bytes(fmt, ITEMSIZE) == w.gpu_bytes(fmt, ITEMSIZE)


def test_weight_streaming_fits_2048_on_24_gib_in_int8(tmp_path):
    """Both engines int8 on a 24 GiB colocated card: resident, 2048² does not fit; the fit search keeps 2048² with
    generation's weight streaming (2 layers on the GPU, the rest pinned on the host) rather than shrinking the image,
    and says so in its flags; with streaming ruled out (0) it falls back to a smaller size."""
    args = ("--gpu-memory", "24GiB", "--quantization", "int8", "--und-quantization", "int8", "--json")
    out = _plan_8b(tmp_path, *args)
    assert out["asked"]["fits"] is False and out["asked"]["max_image_side"] == 2048
    fix = out["fix"]
    assert fix["max_image_side"] == 2048 and fix["weight_streaming_layers"] == M.STREAMING_LAYERS
    assert "--weight-streaming-layers 2" in fix["flags"][fix["flags"].index("--gen-args") + 1]
    gen = fix["generation"]
    assert gen["parts"]["cuda_graphs"] == 0 and gen["parts"]["weights"] < 1 * M.GiB
    assert 7 * M.GiB < fix["host_pinned_bytes"] < 8 * M.GiB           # the int8 decoder layers
    assert gen["load_peak_bytes"] < gen["total_bytes"] - gen["parts"]["cuda_context"]
    assert fix["device_total_bytes"] <= 24 * M.GiB
    resident = _plan_8b(tmp_path, *args, "--weight-streaming-layers", "0")["fix"]
    assert resident["max_image_side"] < 2048 and resident["host_pinned_bytes"] == 0
    text = _plan_8b(tmp_path, *args[:-1])
    assert "pinned host memory: generation's decoder layers" in text and "OVER" not in text, text


def test_load_peak_is_the_quantised_weights_and_one_float_layer(tiny):
    _, cfg, weights = tiny
    w = weights["gen"]
    e = M.gen_plan(cfg, w, M.Settings(images=LIMITS, itemsize=ITEMSIZE, gen_format="int8"), side=256)
    per_layer = w.layer_bytes("bf16", ITEMSIZE)
    assert M.load_peak(e, w, ITEMSIZE) == w.gpu_bytes("int8", ITEMSIZE) + max(per_layer.values())
    bf16 = M.gen_plan(cfg, w, M.Settings(images=LIMITS, itemsize=ITEMSIZE), side=256)
    assert M.load_peak(bf16, w, ITEMSIZE) is None


def test_fused_plan_puts_the_pool_on_the_device_and_one_context(tmp_path):
    """--colocate-engines fused: the engines' lines stay (without a context each), the device KV pool (3 GiB, in
    understanding's share: it is made before understanding fits its KV cache) and ONE runtime overhead are the
    process's; the fractions and that one context sum to the cap."""
    two = _plan_8b(tmp_path, "--gpu-memory", "48GiB", "--gpu-total", "80GiB", "--json")["asked"]
    small = _plan_8b(tmp_path, "--gpu-memory", "48GiB", "--gpu-total", "80GiB", "--colocate-engines", "fused",
                     "--kv-pool-gb", "2", "--json")
    # a 2 GiB device pool cannot hold a 2048² edit's prefixes (146 pages) in one request's half: the fix is 3 GiB
    assert not small["asked"]["fits"] and "cannot hold the largest image request's prefixes" in small["asked"]["why"]
    assert "--kv-pool-gb" in small["fix"]["flags"] and small["fix"]["flags"][small["fix"]["flags"].index(
        "--kv-pool-gb") + 1] == "3"
    one = _plan_8b(tmp_path, "--gpu-memory", "48GiB", "--gpu-total", "80GiB", "--colocate-engines", "fused",
                   "--json")["asked"]                                  # the fused mode's default pool holds them
    assert two["fits"] and one["fits"] and one["colocate_engines"] == "fused"
    assert two["process"] == {} and "--colocate-engines" not in two["flags"]
    assert one["process"]["cuda_context"] == M.CUDA_CONTEXT_BYTES
    pool = one["process"]["kv_pool"]
    assert 2.99 * M.GiB < pool <= 3 * M.GiB                               # DEVICE_POOL_GB's whole pages
    assert one["host_kv_pool_bytes"] < 16 * M.MiB < two["host_kv_pool_bytes"]   # the page table only
    for engine in ("understanding", "generation"):
        assert one[engine]["parts"]["cuda_context"] == 0
        assert one[engine]["parts"]["weights"] == two[engine]["parts"]["weights"]
    assert one["generation"]["total_bytes"] == two["generation"]["total_bytes"] - M.CUDA_CONTEXT_BYTES
    total = one["understanding"]["total_bytes"] + one["generation"]["total_bytes"] + pool + M.CUDA_CONTEXT_BYTES
    assert one["device_total_bytes"] == total <= 48 * M.GiB
    # one context less and the pool more than two processes: understanding's KV differs by the difference
    kv = lambda p: p["understanding"]["parts"]["kv_cache"]   # noqa: E731
    assert abs((kv(one) - kv(two)) - (M.CUDA_CONTEXT_BYTES - pool)) < 64 * M.MiB
    flags = one["flags"]
    value = lambda name: flags[flags.index(name) + 1]   # noqa: E731
    assert value("--colocate-engines") == "fused" and value("--kv-pool-gb") == "3"
    fractions = float(value("--gen-memory-fraction")) + float(value("--und-memory-fraction"))
    assert abs(fractions * 80 + M.CUDA_CONTEXT_BYTES / M.GiB - 48) <= 0.08        # two 3-digit fractions of 80
    und_share = float(value("--und-memory-fraction")) * 80 * M.GiB
    # the pool is in its share (less the 3-place rounding: generation's share up, understanding's down)
    assert und_share >= one["understanding"]["total_bytes"] + pool - 0.002 * 80 * M.GiB
    text = _plan_8b(tmp_path, "--gpu-memory", "48GiB", "--colocate-engines", "fused")
    assert "fused process" in text and "(one process)" in text, text


def test_understanding_context_holds_the_largest_image_prompt(tmp_path):
    """A plan fits only if understanding's KV cache holds the prompt of the largest image request it allows (an edit
    with a side² input): on an H100 the fused 24 GiB plan of 2026-12-06 said 1280² fits with 1,460 KV tokens, and
    every 1024² image, edit and interleaved answer was refused 400 context_length_exceeded (1,218-1,824 tokens)."""
    for engines in ("processes", "fused"):
        out = _plan_8b(tmp_path, "--gpu-memory", "24GiB", "--gpu-total", "80GiB", "--quantization", "int8",
                       "--und-quantization", "int8", "--colocate-engines", engines, "--json")
        fix = out["fix"]
        tokens = int(next(n for n in fix["understanding"]["notes"] if n.startswith("KV cache")).split()[2])
        side = fix["max_image_side"]
        assert tokens >= M.und_prompt_tokens(side, 32) >= 1824 + (side // 32) ** 2 - 1024, (engines, tokens, side)
