"""Step caching for the denoiser, decided per CFG branch: two policies, one mechanism.

Between two denoising steps the output of the deep layers changes slowly for most of the schedule, so a
branch may skip layers and reuse a residual it computed at an earlier step:

- `first_block`: layer 0 always runs; its residual r1 = h1 - x is compared with r1 of the last step this
  branch computed in full: if the relative L1 change mean|r1 - r1_prev| / mean|r1_prev| is below
  `threshold`, the branch skips layers 1..L-1 and takes h_L = h1 + (h_L - h1) of that last computed step.
- `teacache` (TeaCache, "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model", Liu et al.
  2024): the decision needs no layer at all. The stack's input x (the patch tokens plus the additive
  time embedding: this model's "timestep-embedding modulated input"; it has no AdaLN) is compared with the
  previous step's input (every step, computed or not); the relative L1 change is rescaled by a polynomial
  that predicts the relative change of the stack's residual from it (calibrated per resolution bucket:
  `rescaled_change`, bench/calibrate_teacache.py) and accumulated: while the sum stays below
  `threshold` the branch skips every layer and takes h_L = x + (h_L - x) of its last computed step; a step
  that computes resets the sum.

Each CFG branch (cond / uncond / img_cond) of each job decides on its own: in one packed forward the rows of
branches that reuse skip the layers, the other rows run them (`StepCache.forward`); jobs with either policy
or none share a forward. `threshold` 0 never reuses (the output is bit-identical to running without the
cache). `cfg_truncation` lowers the upper bound of the request's `cfg_interval` (CFG only while t <= value;
t = 1 is clean): the tail of the schedule then runs the cond branch alone, through the interval rule that
exists.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import torch

from services.base import knobs

from .lora_batched import lora_subset

CACHE_MODES = ("off", "first_block", "teacache")   # the contract's CacheMode names the same (tests/model/test_math.py)
COEFFICIENTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "teacache_coefficients.json")


@dataclass(frozen=True)
class StepCacheOptions:
    """A job's step caching as the denoiser reads it (the contract's CacheOptions, converted at the engine
    boundary by `of`)."""
    mode: str                          # one of CACHE_MODES
    threshold: float
    warmup_steps: int
    max_consecutive: int               # 0: no limit
    cfg_truncation: float | None

    @classmethod
    def of(cls, options) -> "StepCacheOptions":
        """From an object with these fields (the contract's CacheOptions); None: no caching."""
        if options is None:
            return NO_CACHE
        if isinstance(options, cls):
            return options
        return cls(options.mode, float(options.threshold), int(options.warmup_steps), int(options.max_consecutive),
                   options.cfg_truncation)

    @property
    def reuses(self) -> bool:
        return self.mode != "off" and self.threshold > 0


NO_CACHE = StepCacheOptions("off", 0.0, 0, 0, None)


def truncated_interval(interval: tuple[float, float], options: StepCacheOptions) -> tuple[float, float]:
    """cfg_interval with the CFG-truncation bound applied (hi lowered, never below lo)."""
    lo, hi = interval
    if options.cfg_truncation is None:
        return (lo, hi)
    return (lo, max(lo, min(hi, float(options.cfg_truncation))))


# ----------------------------------------------------------------------------- TeaCache coefficients
@functools.lru_cache(maxsize=8)
def load_coefficients(path: str) -> dict:
    """A coefficients file: {"buckets": [{"max_tokens": int, "coefficients": [c_d, .., c_0]}, ...], ...}
    (numpy.polyfit order: highest power first), buckets sorted here by max_tokens."""
    with open(path) as f:
        data = json.load(f)
    buckets = sorted(data.get("buckets") or [], key=lambda b: int(b["max_tokens"]))
    if not buckets or not all(b.get("coefficients") for b in buckets):
        raise ValueError(f"{path}: no TeaCache buckets with coefficients")
    return {**data, "buckets": buckets}


def teacache_bucket(tokens: int, path: str | None = None) -> dict:
    """The bucket of an image of `tokens` tokens: the first whose max_tokens holds it, else the largest.
    File: `path`, else $U1SERVE_TEACACHE_COEFFICIENTS, else the packaged one."""
    data = load_coefficients(path or knobs.TEACACHE_COEFFICIENTS.get() or COEFFICIENTS_FILE)
    return next((b for b in data["buckets"] if tokens <= int(b["max_tokens"])), data["buckets"][-1])


def rescaled_change(change: float, tokens: int, path: str | None = None) -> float:
    """The input's relative change mapped to the predicted change of the stack's residual by the bucket's
    polynomial. Outside the input range the bucket was calibrated on (`input_change` [lo, hi], if given)
    the prediction scales in proportion from the range's edge (a degree-4 fit extrapolates wildly); never
    below 0, so the accumulated sum only grows."""
    b = teacache_bucket(tokens, path)
    coefficients = tuple(float(c) for c in b["coefficients"])
    lo, hi = b.get("input_change") or (change, change)
    edge = min(max(change, lo), hi)
    y = polyval(coefficients, edge) * (change / edge if edge > 0 else 1.0)
    return max(0.0, y)


def polyval(coefficients: tuple[float, ...], x: float) -> float:
    """coefficients (highest power first) at x, Horner."""
    y = 0.0
    for c in coefficients:
        y = y * x + c
    return y


# ----------------------------------------------------------------------------- per-branch state
@dataclass
class BranchState:
    """One CFG branch of one job: what its next steps reuse, and what it did so far."""
    prev: torch.Tensor | None = None         # first_block: r1 of the last computed step; teacache: last input
    rest: torch.Tensor | None = None         # the skipped layers' residual at the last computed step
    streak: int = 0                          # reused steps in a row
    last_change: float | None = None         # the last relative change measured (host copy)
    change_range: tuple[float, float] | None = None   # (min, max) of the changes measured (the job's log line)
    accumulated: float = 0.0                 # teacache: rescaled change summed since the last computed step
    computed: int = 0
    reused: int = 0


@dataclass
class CacheGroup:
    """The rows [start, stop) of one branch in a packed forward. `tokens`: tokens per image (picks the
    TeaCache bucket; None: the group's rows)."""
    start: int
    stop: int
    state: BranchState
    options: StepCacheOptions
    step: int                                # the job's step index
    key: object = None                       # the caller's handle (engine: (job, branch))
    tokens: int | None = None
    compute: bool = field(default=True, init=False)

    @property
    def mode(self) -> str:
        return self.options.mode

    def may_reuse(self) -> bool:
        o, s = self.options, self.state
        return (o.reuses and s.prev is not None and s.rest is not None and self.step >= o.warmup_steps
                and (o.max_consecutive == 0 or s.streak < o.max_consecutive))


def relative_change(r1: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """mean|r1 - prev| / mean|prev| as a 0-dim fp32 tensor (no host sync)."""
    num = torch.mean((r1 - prev).abs(), dtype=torch.float32)
    return num / torch.mean(prev.abs(), dtype=torch.float32).clamp_min(1e-12)


def change_sums(r1: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """[sum|r1 - prev|, sum|prev|] fp32: relative_change's parts, to be summed over ranks."""
    return torch.stack([torch.sum((r1 - prev).abs(), dtype=torch.float32),
                        torch.sum(prev.abs(), dtype=torch.float32)])


class StepCache:
    """The cache's part of one forward (`forward`, called by NeoModel.gen_forward): decide which groups
    compute, run the layers on their rows, assemble the output, remember what the next steps compare and
    reuse. `attend_for(groups)` gives the attention callback of a subset of groups' rows, packed in order.
    `reduce` (sequence parallel: each rank holds a slice of every group's rows) sums a [k, 2] tensor of
    change_sums over the ranks, identically on each, so every rank takes the same decision."""

    def __init__(self, groups: list[CacheGroup], attend_for=None, reduce=None, layers=None):
        """layers(h, start, stop): runs layers [start, stop) on every row (None: model.gen_layers with the
        forward's rope and attend); the generation engine passes its CUDA-graph segments."""
        self.groups = groups
        self.attend_for = attend_for
        self.reduce = reduce
        self.layers = layers

    @property
    def probes(self) -> bool:
        """Whether layer 0 runs on every row before the decision (some group uses the first-block policy)."""
        return any(g.mode == "first_block" for g in self.groups)

    def forward(self, model, x: torch.Tensor, rope, attend) -> torch.Tensor:
        """The residual after the last layer for the packed rows x. Layer 0 runs on every row first when
        some group uses the first-block policy (its statistic); TeaCache decides on x alone."""
        probe = 1 if self.probes else 0
        run = self.layers or (lambda h, start, stop: model.gen_layers(h, rope, attend, start=start, stop=stop))
        h1 = run(x, 0, 1) if probe else x
        rows = self.decide(x, h1)
        if rows is None:   # every branch computes: the bits of the forward without the cache
            h = run(h1, probe, None)
        else:
            rest = None
            if any(g.compute for g in self.groups):   # not rows.numel(): an SP rank may hold none
                with lora_subset(model, rows):       # the LoRA slots of those rows (lora_batched.py)
                    rest = model.gen_layers(h1.index_select(0, rows), model.rope(rope.positions[:, rows]),
                                            self.attend_for([g for g in self.groups if g.compute]), start=probe)
            h = self.fill(x, h1, rest)
        self.store(x, h1, h)
        return h

    def decide(self, x: torch.Tensor, h1: torch.Tensor) -> torch.Tensor | None:
        """Row indices that run the layers after the probe (None: all rows). One host sync when some
        group may reuse."""
        cand = [g for g in self.groups if g.may_reuse()]
        for g in self.groups:
            g.compute = True
        if cand:
            probes = [self._probe(g, x, h1) for g in cand]
            for g, c in zip(cand, self._changes(cand, probes)):
                g.state.last_change = c
                lo, hi = g.state.change_range or (c, c)
                g.state.change_range = (min(lo, c), max(hi, c))
                if g.mode == "teacache":
                    acc = g.state.accumulated + rescaled_change(c, g.tokens or g.stop - g.start)
                    g.compute = not acc < g.options.threshold
                    g.state.accumulated = 0.0 if g.compute else acc
                else:
                    g.compute = not c < g.options.threshold
        if all(g.compute for g in self.groups):
            return None
        dev = x.device
        idx = [torch.arange(g.start, g.stop, device=dev) for g in self.groups if g.compute]
        return torch.cat(idx) if idx else torch.empty(0, dtype=torch.long, device=dev)

    @staticmethod
    def _probe(g: CacheGroup, x: torch.Tensor, h1: torch.Tensor) -> torch.Tensor:
        """What the group's policy compares across steps: its input rows (teacache) or layer 0's residual."""
        if g.mode == "teacache":
            return x[g.start:g.stop]
        return h1[g.start:g.stop] - x[g.start:g.stop]

    def _changes(self, cand: list[CacheGroup], probes: list[torch.Tensor]) -> list[float]:
        if self.reduce is None:
            return torch.stack([relative_change(p, g.state.prev) for g, p in zip(cand, probes)]).tolist()
        sums = self.reduce(torch.stack([change_sums(p, g.state.prev) for g, p in zip(cand, probes)]))
        return (sums[:, 0] / sums[:, 1].clamp_min(1e-12)).tolist()

    def fill(self, x: torch.Tensor, h1: torch.Tensor, computed: torch.Tensor | None) -> torch.Tensor:
        """The stack output: computed rows from `computed` (packed in group order), the others the rows
        their policy keeps (teacache: x, first_block: h1) + the residual of their last computed step."""
        h = torch.empty_like(h1)
        off = 0
        for g in self.groups:
            n = g.stop - g.start
            if g.compute:
                h[g.start:g.stop] = computed[off:off + n]
                off += n
            else:
                base = x if g.mode == "teacache" else h1
                torch.add(base[g.start:g.stop], g.state.rest, out=h[g.start:g.stop])
        return h

    def store(self, x: torch.Tensor, h1: torch.Tensor, h: torch.Tensor) -> None:
        """Counters for every group; what the next steps compare (teacache: this input, every step) and
        reuse (the residual of the groups that computed), for the groups that may reuse at all."""
        for g in self.groups:
            s = g.state
            if g.compute:
                s.computed += 1
                s.streak = 0
            else:
                s.reused += 1
                s.streak += 1
            if not g.options.reuses:
                continue
            rows = slice(g.start, g.stop)
            if g.mode == "teacache":
                s.prev = x[rows].clone()
                if g.compute:
                    s.rest = h[rows] - x[rows]
            elif g.compute:
                s.prev = h1[rows] - x[rows]
                s.rest = h[rows] - h1[rows]
