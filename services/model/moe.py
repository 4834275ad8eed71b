"""The A3B sparse MoE block with its experts stacked, and the one map between the stacked tensors and the
checkpoint's per-expert keys.

The official checkpoint stores each expert as three Linear weights (`mlp.experts.{e}.gate_proj.weight` [I, H],
`.up_proj.weight` [I, H], `.down_proj.weight` [H, I]). Serving holds them stacked once, at load, as
`mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows) and `mlp.experts.down_proj` [E, H, I] (the names
of transformers' fused Qwen3-MoE experts), which the fused kernel (kernels/moe.py) reads directly: no Python loop
over experts, no host sync, so decode and denoise steps capture in CUDA graphs.

Everything that goes by checkpoint key (the loader, live weight updates and export in weights_io, TP sharding by
key, the tiny checkpoint writer) sees a per-expert key as a view into the stacked tensor (`checkpoint_views`):
reading a key reads the view, loading or updating it copies into the stacked storage.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

import kernels
from services.model import row_blocks

GATE_UP, DOWN = "gate_up_proj", "down_proj"
_KEY = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class StackedExperts(nn.Module):
    """E SwiGLU experts as two stacked weights (module doc)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class SparseMoE(nn.Module):
    """Qwen3-MoE block: fp32 softmax router, top-k, renormalise, weighted sum of SwiGLU experts
    (kernels.fused_moe: Triton on CUDA, the dense torch reference elsewhere)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden, inter)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = row_blocks.active_blocks(x.shape[0]) if x.dim() == 2 else None
        if blocks:   # per sequence, as its linear layers (row_blocks): the experts' GEMMs round by their row count
            return torch.cat([self._experts(part) for part in x.split(blocks)])
        return self._experts(x)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fused_moe(x, self.gate(x), self.experts.gate_up_proj, self.experts.down_proj, self.top_k,
                                 self.norm_topk_prob)


def expert_view(stacked: torch.Tensor, e: int, proj: str) -> torch.Tensor:
    """The rows of expert `e`'s `proj` (gate_proj | up_proj | down_proj) in its stacked tensor."""
    if proj == "down_proj":
        return stacked[e]
    inter = stacked.shape[1] // 2
    return stacked[e, :inter] if proj == "gate_proj" else stacked[e, inter:]


def stacked_slot(key: str) -> tuple[str, int, str] | None:
    """A per-expert checkpoint key -> (name of its stacked parameter, expert, projection); None for other keys."""
    m = _KEY.match(key)
    if m is None:
        return None
    proj = m["proj"]
    return f"{m['experts']}.{DOWN if proj == 'down_proj' else GATE_UP}", int(m["e"]), proj


def checkpoint_views(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) for named parameters (or any name -> tensor pairs in the model's layout): a
    stacked expert tensor becomes one view per expert and projection, expert by expert (gate, up, down: the
    order of the official module tree), every other tensor passes as it is."""
    named = list(named)
    stacked = {name: t for name, t in named if name.endswith(f".experts.{GATE_UP}") or
               name.endswith(f".experts.{DOWN}")}
    for name, t in named:
        if name not in stacked:
            yield name, t
        elif name.endswith(GATE_UP):
            prefix = name[: -len(GATE_UP)]
            down = stacked.get(prefix + DOWN)
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", expert_view(t, e, "gate_proj")
                yield f"{prefix}{e}.up_proj.weight", expert_view(t, e, "up_proj")
                if down is not None:
                    yield f"{prefix}{e}.down_proj.weight", expert_view(down, e, "down_proj")
        elif name[: -len(DOWN)] + GATE_UP not in stacked:     # a down_proj without its gate_up
            for e in range(t.shape[0]):
                yield f"{name[: -len(DOWN)]}{e}.down_proj.weight", expert_view(t, e, "down_proj")
