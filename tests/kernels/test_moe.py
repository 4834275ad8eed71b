"""Fused MoE (kernels/moe.py). On CPU: the dense reference equals the official per-expert loop, and the
token -> expert layout holds every (token, slot) pair once, sorted and padded per expert. On CUDA (the lead's
GPU run: `python -m pytest tests/kernels/test_moe.py`): the Triton kernels match the reference at the A3B
geometry, make no host sync, and replay from a CUDA graph. Interpreted Triton on CPU: interpreted/check_moe.py."""
import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import assert_close

from kernels.moe import aligned_len, fused_moe, fused_moe_ref, moe_align, moe_route

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="CUDA only (run on the GPU box)")


def official_moe(x, logits, w13, w2, top_k, renormalize):
    """The official Qwen3MoeSparseMoeBlock.forward: a loop over the experts present, index_add in x's dtype."""
    weights, ids = moe_route(logits, top_k, renormalize, x.dtype)
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for e in range(w13.shape[0]):
        slot, rows = torch.where(mask[e])
        if rows.numel() == 0:
            continue
        h = x.index_select(0, rows) @ w13[e].t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].t()
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out


def moe_inputs(T, H, inter, E, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(T, H).to(device, dtype)
    logits = r(T, E).to(device, dtype)
    w13 = (r(E, 2 * inter, H) / H ** 0.5).to(device, dtype)
    w2 = (r(E, H, inter) / inter ** 0.5).to(device, dtype)
    return x, logits, w13, w2


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 8, 2), (64, 16, 4), (5, 4, 4)])
def test_reference_is_the_official_loop(T, E, k, renormalize):
    x, logits, w13, w2 = moe_inputs(T, 64, 32, E, torch.float32)
    torch.testing.assert_close(fused_moe_ref(x, logits, w13, w2, k, renormalize),
                               official_moe(x, logits, w13, w2, k, renormalize), rtol=1e-6, atol=1e-6)
    xb, lb, w13b, w2b = (t.bfloat16() for t in (x, logits, w13, w2))
    assert_close(fused_moe_ref(xb, lb, w13b, w2b, k, renormalize), official_moe(x, lb.float(), w13, w2, k,
                                                                              renormalize), torch.bfloat16)


@pytest.mark.parametrize("T,E,k,block", [(1, 128, 8, 16), (3, 4, 2, 4), (50, 8, 2, 16), (200, 32, 8, 64),
                                         (0, 8, 2, 16)])
def test_layout_holds_each_pair_once_sorted_and_padded(T, E, k, block):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    pairs, block_expert = moe_align(ids, E, block)
    n = T * k
    assert pairs.numel() == aligned_len(n, E, block) and pairs.numel() % block == 0
    assert block_expert.numel() == pairs.numel() // block
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))                           # every pair once
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        chunk = pairs[b * block:(b + 1) * block]
        chunk = chunk[chunk < n].long()
        if e < 0:
            assert chunk.numel() == 0
        else:
            assert (flat[chunk] == e).all() and torch.equal(chunk, chunk.sort().values)  # token order inside
    used = block_expert[block_expert >= 0]
    assert torch.equal(used, used.sort().values)                              # expert runs in order


@pytest.mark.parametrize("bad", ["x", "w2", "top_k"])
def test_bad_shapes_are_refused(bad):
    x, logits, w13, w2 = moe_inputs(3, 64, 32, 8, torch.float32)
    args = {"x": x[:, :60] if bad == "x" else x, "w2": w2[:, :, :16] if bad == "w2" else w2,
            "top_k": 9 if bad == "top_k" else 2}
    with pytest.raises(ValueError):
        fused_moe(args["x"], logits, w13, args["w2"], args["top_k"], True)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tiles", [(16, 32), (64, 64)])
def test_kernels_compile_for_hopper(dtype, tiles):
    """No GPU needed: Triton compiles both kernels to sm_90 cubins with its bundled ptxas (the interpreter does not
    type-check what the compiler does)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import moe
    for lazy in (moe._up, moe._down):
        kernel = lazy._get()
        names = inspect.signature(lazy.fn).parameters
        const = {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "BLOCK_K": 64, "IEEE": dtype == "fp32"}
        sig = {n: "constexpr" if n in const else "*i32" if n in ("PAIRS", "BLOCK_EXPERT") else
               "i32" if n in ("H", "I") or not n.isupper() else f"*{dtype}" for n in names}
        compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4})
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 228 * 1024


# ----------------------------------------------------------------------------- CUDA
GEOMETRY = {"und": (2048, 768, 128, 8), "gen": (2048, 768, 32, 8), "small": (256, 96, 16, 4)}


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("geometry", sorted(GEOMETRY))
def test_triton_matches_reference(monkeypatch, geometry, T, dtype):
    monkeypatch.delenv("U1SERVE_KERNELS", raising=False)
    H, inter, E, k = GEOMETRY[geometry]
    x, logits, w13, w2 = moe_inputs(T, H, inter, E, dtype, "cuda")
    out = fused_moe(x, logits, w13, w2, k, True)
    ref = fused_moe_ref(x.double(), logits, w13.double(), w2.double(), k, True)
    assert_close(out, ref.to(dtype), dtype)


@cuda_only
def test_no_host_sync_and_a_cuda_graph_replays_it(monkeypatch):
    monkeypatch.delenv("U1SERVE_KERNELS", raising=False)
    H, inter, E, k = GEOMETRY["und"]
    x, logits, w13, w2 = moe_inputs(64, H, inter, E, torch.bfloat16, "cuda")
    fused_moe(x, logits, w13, w2, k, True)                  # JIT outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, logits, w13, w2, k, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, logits, w13, w2, k, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, logits, w13, w2, k, True)
    for seed in (1, 2):
        x2, logits2, _, _ = moe_inputs(64, H, inter, E, torch.bfloat16, "cuda", seed=seed)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(x2, logits2, w13, w2, k, True))


@cuda_only
def test_a3b_decode_steps_capture_in_the_understanding_engines_graphs(tiny_checkpoint, monkeypatch):
    """The exclusion is gone: the tiny A3B model's decode steps are captured (every padded batch size) and the
    replay-vs-eager self-check passes (services/understanding/cuda_graphs.py)."""
    from services.model.loader import load_model
    from services.understanding.model_runner import ModelRunner
    monkeypatch.delenv("U1SERVE_KERNELS", raising=False)
    model = load_model(tiny_checkpoint("a3b"), "und", dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(model, num_slots=256, max_running=16, max_model_len=128, device="cuda",
                         dtype=torch.bfloat16, cuda_graph_max_bs=16)
    assert runner.graphs is not None and runner.graphs.sizes[-1] == 16
