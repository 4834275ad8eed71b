"""Step caching for the denoiser: first-block residual reuse, decided per CFG branch.

Between two denoising steps the output of the deep layers changes slowly for most of the schedule.
Layer 0 always runs; its residual r1 = h1 - x is compared with r1 of the last step this branch
computed in full: if the relative L1 change mean|r1 - r1_prev| / mean|r1_prev| is below `threshold`,
the branch skips layers 1..L-1 and takes h_L = h1 + (h_L - h1) of that last computed step.
Each CFG branch (cond / uncond / img_cond) of each job decides on its own: in one packed forward the
rows of branches that reuse skip the remaining layers, the other rows run them.

`threshold` 0 never reuses (the output is bit-identical to running without the cache). `cfg_truncation`
lowers the upper bound of the request's `cfg_interval` (CFG only while t <= value; t = 1 is clean):
the tail of the schedule then runs the cond branch alone, through the interval rule that exists.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.contract.image import CacheMode, CacheOptions

CACHE_MODES = CacheMode.__args__


def truncated_interval(interval: tuple[float, float], options: CacheOptions) -> tuple[float, float]:
    """cfg_interval with the CFG-truncation bound applied (hi lowered, never below lo)."""
    lo, hi = interval
    if options.cfg_truncation is None:
        return (lo, hi)
    return (lo, max(lo, min(hi, float(options.cfg_truncation))))


@dataclass
class BranchState:
    """One CFG branch of one job: what its next steps reuse, and what it did so far."""
    prev_first: torch.Tensor | None = None   # r1 of the last fully computed step
    rest: torch.Tensor | None = None         # h_L - h1 of that step
    streak: int = 0                          # reused steps in a row
    last_change: float | None = None         # the last relative change measured (host copy)
    computed: int = 0
    reused: int = 0


@dataclass
class CacheGroup:
    """The rows [start, stop) of one branch in a packed forward."""
    start: int
    stop: int
    state: BranchState
    options: CacheOptions
    step: int                                # the job's step index
    key: object = None                       # the caller's handle (engine: (job, branch))
    compute: bool = field(default=True, init=False)

    def may_reuse(self) -> bool:
        o, s = self.options, self.state
        return (o.reuses and s.prev_first is not None and s.rest is not None and self.step >= o.warmup_steps
                and (o.max_consecutive == 0 or s.streak < o.max_consecutive))


def relative_change(r1: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """mean|r1 - prev| / mean|prev| as a 0-dim fp32 tensor (no host sync)."""
    num = torch.mean((r1 - prev).abs(), dtype=torch.float32)
    return num / torch.mean(prev.abs(), dtype=torch.float32).clamp_min(1e-12)


def change_sums(r1: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """[sum|r1 - prev|, sum|prev|] fp32: relative_change's parts, to be summed over ranks."""
    return torch.stack([torch.sum((r1 - prev).abs(), dtype=torch.float32),
                        torch.sum(prev.abs(), dtype=torch.float32)])


class FirstBlockCache:
    """The cache's part of one forward (see NeoModel.gen_forward): decide which groups compute the
    rest of the stack, assemble the output, remember the residuals of the groups that computed.
    `attend_for(groups)` gives the attention callback of a subset of groups' rows, packed in order.
    `reduce` (sequence parallel: each rank holds a slice of every group's rows) sums a [k, 2] tensor of
    change_sums over the ranks, identically on each, so every rank takes the same decision."""

    def __init__(self, groups: list[CacheGroup], attend_for=None, reduce=None):
        self.groups = groups
        self.attend_for = attend_for
        self.reduce = reduce
        self._r1: torch.Tensor | None = None

    def decide(self, first_residual: torch.Tensor) -> torch.Tensor | None:
        """Row indices that run layers 1.. (None: all rows). One host sync when some group may reuse."""
        self._r1 = first_residual
        cand = [g for g in self.groups if g.may_reuse()]
        for g in self.groups:
            g.compute = True
        if cand:
            for g, c in zip(cand, self._changes(cand, first_residual)):
                g.state.last_change = c
                g.compute = not c < g.options.threshold
        if all(g.compute for g in self.groups):
            return None
        dev = first_residual.device
        idx = [torch.arange(g.start, g.stop, device=dev) for g in self.groups if g.compute]
        return torch.cat(idx) if idx else torch.empty(0, dtype=torch.long, device=dev)

    def _changes(self, cand: list[CacheGroup], r1: torch.Tensor) -> list[float]:
        if self.reduce is None:
            return torch.stack([relative_change(r1[g.start:g.stop], g.state.prev_first)
                                for g in cand]).tolist()
        sums = self.reduce(torch.stack([change_sums(r1[g.start:g.stop], g.state.prev_first) for g in cand]))
        return (sums[:, 0] / sums[:, 1].clamp_min(1e-12)).tolist()

    def attend_subset(self):
        return self.attend_for([g for g in self.groups if g.compute])

    def fill(self, h1: torch.Tensor, computed: torch.Tensor | None) -> torch.Tensor:
        """The stack output: computed rows from `computed` (packed in group order), the others
        h1 + the residual of their branch's last computed step."""
        h = torch.empty_like(h1)
        off = 0
        for g in self.groups:
            n = g.stop - g.start
            if g.compute:
                h[g.start:g.stop] = computed[off:off + n]
                off += n
            else:
                torch.add(h1[g.start:g.stop], g.state.rest, out=h[g.start:g.stop])
        return h

    def store(self, h1: torch.Tensor, h: torch.Tensor) -> None:
        """Counters for every group; residuals for the groups that computed (cache on)."""
        for g in self.groups:
            s = g.state
            if not g.compute:
                s.reused += 1
                s.streak += 1
                continue
            s.computed += 1
            s.streak = 0
            if g.options.mode == "first_block":
                s.prev_first = self._r1[g.start:g.stop].clone()
                s.rest = h[g.start:g.stop] - h1[g.start:g.stop]
        self._r1 = None
