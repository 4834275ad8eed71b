"""A branch's decoder stack on a few causal random tokens (the fused-projection tests' forward)."""
from __future__ import annotations

import torch

from services.model import reference as R


def stack_forward(model, branch: str, rows: int = 5, seed: int = 0) -> torch.Tensor:
    """The und stack + final norm, or the gen stack + norm_mot_gen, on `rows` causal tokens (<= 16 rows: the
    fused q|k|v and gate|up GEMMs run), under no_grad."""
    g = torch.Generator().manual_seed(seed)
    dev = model.device
    x = torch.randn(rows, model.cfg.llm.hidden_size, generator=g).to(dev, model.dtype)
    t = torch.arange(rows)
    rope = model.rope(torch.stack([t, t % 3, t % 2]))
    causal = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=dev))
    attend = lambda i, q, k, v: R.masked_attention(q, k, v, causal, model.head_dim ** -0.5)  # noqa: E731
    with torch.no_grad():
        if branch == "und":
            return model.und_forward(x, rope, attend)
        return model.gen_layers(x, rope, attend, final_norm=True)
