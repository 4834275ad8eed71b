"""The batched multi-LoRA Triton kernels (kernels/lora.py) on the GPU, at serving shapes: rows of up to 16 adapters
and of none in one launch equal the torch reference (fp32 accumulation; the kernel rounds the fp32 shrink result to
the weights' dtype before the expand, as bf16 serving does). CUDA only: the same kernels run under the Triton
interpreter in CI (tests/kernels/interpreted/check_lora.py).

    python -m pytest -q tests/kernels/test_lora.py        # on a GPU machine
"""
import pytest
import torch

from kernels.lora import lora_apply_, lora_apply_ref_, slot_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (interpreted check runs in CI)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,K,N,S,R", [(1, 4096, 4096, 1, 16), (7, 4096, 1024, 4, 16), (3000, 4096, 12288, 16, 16),
                                       (513, 12288, 4096, 16, 64), (8192, 4096, 4096, 4, 32)])
def test_lora_apply_matches_reference_on_gpu(dtype, T, K, N, S, R):
    g = torch.Generator(device="cuda").manual_seed(T + K + S)
    dev = "cuda"
    x = torch.randn(T, K, generator=g, device=dev).to(dtype)
    a = (torch.randn(S, R, K, generator=g, device=dev) / K ** 0.5).to(dtype)
    b = (torch.randn(S, N, R, generator=g, device=dev) / R ** 0.5).to(dtype)
    runs = torch.randint(-1, S, (max(1, T // 64),), generator=g, device=dev)       # contiguous runs, as engines pack
    slots = runs.repeat_interleave(64)[:T]
    slots = torch.cat([slots, runs[-1:].expand(T - slots.numel())]).to(torch.int32)
    slots[::97] = -1                                                                  # and a few stray base rows
    y0 = torch.randn(T, N, generator=g, device=dev).to(dtype)
    got = lora_apply_(y0.clone(), x, a, b, slots)
    want = lora_apply_ref_(y0.clone(), x, a, b, slot_groups(slots))
    tol = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]   # fp32: ieee dots
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    base = slots < 0
    assert torch.equal(got[base], y0[base])


def test_lora_apply_runs_in_a_cuda_graph():
    """The slots live on the device and no host sync happens in the launch: capturable (and replayable with new
    slot values in the same buffer)."""
    dev, T, K, N, S, R = "cuda", 256, 1024, 2048, 4, 16
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    a = torch.randn(S, R, K, device=dev, dtype=torch.bfloat16) / 32
    b = torch.randn(S, N, R, device=dev, dtype=torch.bfloat16) / 4
    slots = torch.zeros(T, dtype=torch.int32, device=dev)
    y = torch.zeros(T, N, device=dev, dtype=torch.bfloat16)
    lora_apply_(y, x, a, b, slots)            # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply_(y, x, a, b, slots)
    slots.copy_(torch.arange(T, device=dev, dtype=torch.int32) % S)
    y.zero_()
    graph.replay()
    want = lora_apply_ref_(torch.zeros_like(y), x, a, b, slot_groups(slots))
    torch.testing.assert_close(y.float(), want.float(), rtol=5e-2, atol=5e-2)
