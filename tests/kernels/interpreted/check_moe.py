"""The fused MoE Triton kernels (kernels/moe.py) vs the dense reference, under TRITON_INTERPRET=1."""
import pytest
import torch
from kernel_testutil import assert_close

from kernels.moe import fused_moe, fused_moe_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])   # bf16 casts truncate when interpreted
@pytest.mark.parametrize("T,H,inter,E,k", [(1, 64, 32, 8, 2), (19, 64, 48, 8, 3), (3, 32, 16, 16, 4), (0, 64, 32, 8, 2),
                                             (60, 32, 16, 4, 2), (150, 32, 16, 4, 2)])   # 16-, 32- and 64-row tiles
def test_fused_moe_matches_reference(rng, monkeypatch, dtype, T, H, inter, E, k):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    x = torch.randn(T, H).to(dtype)
    logits = torch.randn(T, E).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter) / inter ** 0.5).to(dtype)
    out = fused_moe(x, logits, w13, w2, k, True)
    assert out.shape == (T, H) and out.dtype == dtype
    if T:
        assert_close(out, fused_moe_ref(x.double(), logits, w13.double(), w2.double(), k, True).to(dtype), dtype)
