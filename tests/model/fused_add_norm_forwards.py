"""Every forward of a model whose residual adds the fusion rewires (kernels.add_rms_norm, modules.add_norm), on
one seeded input: shared by tests/model/test_fused_add_norm.py (torch references) and
tests/kernels/interpreted/check_fused_add_norm_model.py (the Triton kernels, interpreted)."""
from __future__ import annotations

import torch

from services.model.reference import masked_attention
from services.model.step_cache import BranchState, CacheGroup, StepCache, StepCacheOptions

ROWS = 12


def inputs(model, seed: int = 0):
    """(x [ROWS, hidden] in the model's dtype, rope, attend: plain self-attention over the rows given)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, model.cfg.llm.hidden_size, generator=g).to(model.dtype)
    pos = torch.stack([torch.full((ROWS,), 7), torch.arange(ROWS) // 4, torch.arange(ROWS) % 4])
    scale = model.head_dim ** -0.5

    def attend(i, q, k, v):
        return masked_attention(q, k, v, None, scale)

    return x, model.rope(pos), attend


def forwards(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """{what: output} for und_forward, gen_forward, gen_layers over several [start, stop) (the first-block
    step cache's split, a middle slice, none), with no rows (the sequence-parallel ghost row), and two steps
    through the step cache (the second: one group reuses while the other computes layers 1..)."""
    x, rope, attend = inputs(model, seed)
    out = {}
    if model.branch in ("und", "both"):
        out["und_forward"] = model.und_forward(x, rope, attend)
    if model.branch in ("gen", "both"):
        n = model.num_layers
        out["gen_forward"] = model.gen_forward(x, rope, attend)
        for start, stop in ((0, None), (0, 1), (1, None), (1, n - 1), (1, 1)):
            out[f"gen_layers[{start}:{stop}]"] = model.gen_layers(x, rope, attend, start, stop)
        out["gen_layers, no rows"] = model.gen_layers(x[:0], rope, attend)
        out["step cache 0"], out["step cache 1"] = _two_cached_steps(model, x, rope, attend)
    return out


def _two_cached_steps(model, x, rope, attend):
    half = ROWS // 2
    groups = [CacheGroup(0, half, BranchState(), StepCacheOptions("first_block", 10.0, 1, 0, None), step=0),
              CacheGroup(half, ROWS, BranchState(), StepCacheOptions("first_block", 0.0, 1, 0, None), step=0)]
    first = model.gen_forward(x, rope, attend, StepCache(groups, lambda gs: attend))
    for grp in groups:
        grp.step = 1
    second = model.gen_forward(x * 0.9, rope, attend, StepCache(groups, lambda gs: attend))
    assert [grp.compute for grp in groups] == [False, True], "step 1: the first group reuses, the other computes"
    return first, second
