"""The batched multi-LoRA Triton kernels (shrink + expand) vs the torch reference, under TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.lora import lora_apply_, lora_apply_ref_, slot_groups


@pytest.mark.parametrize("T,K,N,S,R", [(1, 64, 96, 2, 16), (40, 80, 150, 3, 32)])
def test_lora_apply_matches_reference(rng, monkeypatch, T, K, N, S, R):
    """Rows of several slots and of none (-1), in runs and interleaved; empty slots; ragged K / N."""
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    g = torch.Generator().manual_seed(rng)
    x = torch.randn(T, K, generator=g)
    a = torch.randn(S, R, K, generator=g) / K ** 0.5
    b = torch.randn(S, N, R, generator=g) / R ** 0.5
    slots = torch.randint(-1, S - 1, (T,), generator=g, dtype=torch.int32)   # slot S-1 stays unused
    y0 = torch.randn(T, N, generator=g)
    got = lora_apply_(y0.clone(), x, a, b, slots)
    want = lora_apply_ref_(y0.clone(), x, a, b, slot_groups(slots))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = slots < 0
    assert torch.equal(got[base], y0[base])          # rows without an adapter are untouched
