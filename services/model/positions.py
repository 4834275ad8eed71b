"""(t, h, w) position indexes and the hybrid prefill mask (model_spec.md sections 3.2 and 4)."""
from __future__ import annotations

import torch


def _runs(is_ctx: torch.Tensor):
    """Start/end (exclusive) index of every run of <IMG_CONTEXT> tokens."""
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), is_ctx.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    diff = padded[1:] - padded[:-1]
    starts = (diff == 1).nonzero().flatten()
    ends = (diff == -1).nonzero().flatten()
    return starts.tolist(), ends.tolist()


def thw_indexes(input_ids: torch.Tensor, img_context_id: int, grids=(), t_start: int = 0) -> torch.Tensor:
    """LongTensor [3, T]. Text tokens count up in t; all tokens of one image share one t;
    h/w are the row/col of the token in the merged (gh/2, gw/2) grid of its image."""
    ids = torch.as_tensor(input_ids).flatten().cpu()
    is_ctx = ids == img_context_id
    starts, ends = _runs(is_ctx)
    if len(starts) != len(grids):
        raise ValueError(f"{len(starts)} image spans in the prompt but {len(grids)} image grids")
    step = (~is_ctx).long()
    if starts:
        step[torch.tensor(starts)] = 1
    t = torch.cumsum(step, 0) - 1 + t_start
    h = torch.zeros_like(t)
    w = torch.zeros_like(t)
    for s, e, (gh, gw) in zip(starts, ends, grids):
        th, tw = gh // 2, gw // 2
        if e - s != th * tw:
            raise ValueError(f"image span of {e - s} tokens does not match grid {gh}x{gw}")
        idx = torch.arange(e - s)
        h[s:e] = idx // tw
        w[s:e] = idx % tw
    return torch.stack([t, h, w])


def image_end(input_ids: torch.Tensor, img_context_id: int, offset: int = 0) -> torch.Tensor:
    """IntTensor [T]: for an image row, the (absolute, +offset) end of its image span; 0 for other rows.
    Row i may attend key j iff j <= i or j < image_end[i] — the rule "j <= i or t_j == t_i"."""
    ids = torch.as_tensor(input_ids).flatten().cpu()
    out = torch.zeros(ids.numel(), dtype=torch.int32)
    starts, ends = _runs(ids == img_context_id)
    for s, e in zip(starts, ends):
        out[s:e] = e + offset
    return out


def prefill_mask(positions: torch.Tensor) -> torch.Tensor:
    """Dense bool [T, T] mask of the reference: j <= i or t_j == t_i."""
    t = positions[0]
    n = t.numel()
    ar = torch.arange(n, device=t.device)
    return (ar[None, :] <= ar[:, None]) | (t[None, :] == t[:, None])


def image_token_positions(th: int, tw: int, t_offset: int, device=None) -> torch.Tensor:
    """Positions of N = th*tw generated image tokens: all at t_offset, (h, w) row-major."""
    idx = torch.arange(th * tw, device=device)
    return torch.stack([torch.full_like(idx, t_offset), idx // tw, idx % tw])
