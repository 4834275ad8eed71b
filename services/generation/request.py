"""Per-job state inside the engine: its place on the timestep grid (sampler.FlowMatchEuler), its KV buffer and
its attention metadata.

KV buffer of one job on one rank: `[L, 2, S, Hkv, D]`, one segment per (local branch, image) laid out
branch-major: `[prefix_b ; N image slots]`. The prefix is imported once at admission and never moves;
each step writes the new image K/V into the N slots of every active segment (no per-step copies).
With Ulysses sequence parallelism the buffer holds only this rank's KV-head slice (`kv_heads`), all N
slots; with kv-gather every KV head and all N slots (each rank writes every rank's K/V rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.contract.image import CacheOptions, GenerateRequest
from services.model import sampler
from services.model.positions import image_token_positions
from services.model.step_cache import BranchState, StepCacheOptions, truncated_interval

from .lora import job_adapter


@dataclass
class _Segment:
    branch: str
    image: int
    start: int        # first slot of this segment in the job's KV buffer
    prefix_len: int


@dataclass
class StepMeta:
    """Attention/positions metadata of one job for one set of active local branches."""
    positions: torch.Tensor      # [3, rows]
    write_idx: torch.Tensor      # [rows] KV slot of each row's K/V
    cu_q: torch.Tensor           # int32 [segments + 1]
    cu_k: torch.Tensor           # int32 [segments + 1]
    cu_q_host: torch.Tensor      # the same on the CPU (backends that loop over sequences)
    cu_k_host: torch.Tensor
    max_q: int
    max_k: int
    k_start: int                 # keys live in kv[:, :, k_start:k_end] (cu_k relative to k_start)
    k_end: int


class JobState:
    def __init__(self, spec: GenerateRequest, local_branches: list[str], model, device, dtype,
                 kv_heads: int | None = None):
        self.spec = spec
        self.lora = job_adapter(model, spec)     # held until free() (lora.py)
        self.request_id = spec.request_id
        # the contract's values as the model reads them (the engine boundary)
        self.cache = StepCacheOptions.of(CacheOptions.model_validate(spec.cache) if spec.cache else None)
        params = sampler.Sampling.of(spec.sampler())
        self.params = params.with_interval(truncated_interval(params.cfg_interval, self.cache))
        self.branches = list(spec.handles)  # all branches (every rank knows them)
        self.local = [b for b in self.branches if b in local_branches]
        self.branch_state = {b: BranchState() for b in self.local}   # step cache + step counters
        self.th, self.tw = spec.height // 32, spec.width // 32
        self.N = self.th * self.tw
        self.n = spec.n
        self.num_inference_steps = spec.num_inference_steps
        self.flow = sampler.FlowMatchEuler(spec.num_inference_steps, spec.timestep_shift, device=device)
        self.noise_scale = sampler.noise_scale(model.cfg, self.N)
        self.x = sampler.initial_noise(spec.n, spec.height, spec.width, spec.seed, device, dtype,
                                       self.noise_scale, spec.noise_draws)
        self.preview = None                      # uint8 x0 estimate of this step, when it is a preview step
        self.rl = None                           # RL jobs: rollout.RolloutState / ScoreState (rollout.py)
        self.device = device
        self.dtype = dtype
        self._model_geom = (model.num_layers, kv_heads or model.num_kv_heads, model.head_dim)
        self.kv: torch.Tensor | None = None
        self.segments: list[_Segment] = []
        self.t_offsets: dict[str, int] = {}
        self._meta: dict[tuple, StepMeta] = {}
        self.branch_steps: dict[str, dict] = {}   # at finish: every rank's branches (Engine.step)
        self.graph_steps = 0                     # steps whose layer stack ran from CUDA graphs (this rank)
        self.fp8_steps = 0                       # steps whose GEMMs ran in fp8 (the GemmPolicy's row rule)

    # -- KV --------------------------------------------------------------------------------------
    def allocate_kv(self, prefix_lens: dict[str, int], t_offsets: dict[str, int]) -> None:
        L, Hkv, D = self._model_geom
        segments, length = self._layout(prefix_lens)
        self.kv = torch.empty((L, 2, max(length, 1), Hkv, D), device=self.device, dtype=self.dtype)
        self.segments, self.t_offsets = segments, dict(t_offsets)   # after the allocation: it may be retried

    def _layout(self, prefix_lens: dict[str, int]) -> tuple[list[_Segment], int]:
        """The KV buffer's segments (branch x sample: its prefix, then the image's N tokens) and its length."""
        start, segments = 0, []
        for b in self.local:
            for i in range(self.n):
                segments.append(_Segment(b, i, start, prefix_lens[b]))
                start += prefix_lens[b] + self.N
        return segments, start

    def graph_shape(self, prefix_lens: dict[str, int] | None = None, t_offsets: dict[str, int] | None = None) -> tuple:
        """What a CUDA graph keyed by shape bakes in of this job (step_graph.py): its KV buffer's layout (segments,
        prefix lengths), the image's token grid, its samples, its step cache's mode (the graph segments), and the
        positions' offsets (the graph recomputes the rotary table from the copied positions; equal offsets keep
        that from being what a replay depends on). Given `prefix_lens` and `t_offsets`: the shape the job will have
        once its KV is allocated with them."""
        segments = self.segments if prefix_lens is None else self._layout(prefix_lens)[0]
        offsets = self.t_offsets if t_offsets is None else t_offsets
        return (tuple((s.branch, s.start, s.prefix_len) for s in segments), self.th, self.tw, self.n,
                self.cache.mode, tuple(sorted(offsets.items())))

    def graph_family(self) -> tuple:
        """The shape without what a prompt's length sets (prefix lengths, segment starts, position offsets): jobs of
        one family run the same kernels on the same image rows, only their attention's key lengths differ
        (step_graph.py: a warm family's new shape captures on its first step)."""
        return tuple(s.branch for s in self.segments), self.th, self.tw, self.n, self.cache.mode

    def set_prefix(self, branch: str, kv: torch.Tensor) -> None:
        """Copy a branch's prefix KV [L, 2, P, Hkv, D] into each of its image segments."""
        for seg in self.segments:
            if seg.branch == branch:
                self.kv[:, :, seg.start:seg.start + seg.prefix_len].copy_(kv)

    def free(self) -> None:
        if self.rl is not None:                 # a trajectory whose result never went is unlinked
            self.rl.free()
        if self.lora is not None:
            self.lora.release()
            self.lora = None
        self.kv = None
        self._meta.clear()
        self.branch_state = {b: BranchState(computed=s.computed, reused=s.reused)
                             for b, s in self.branch_state.items()}   # drop cached residuals

    def count_applied(self, graphs: bool, fp8: bool) -> None:
        self.graph_steps += graphs
        self.fp8_steps += fp8

    def applied(self) -> dict:
        """Which speed options this job's steps actually ran with (the response's `applied`): the step cache's
        computed / reused branch-steps, CUDA graphs and fp8 as true / false, or "not_applicable" for graphs off
        CUDA and "emulated" for fp8 on a CPU (its numerics, not its speed)."""
        cache = {"computed": sum(c["computed"] for c in self.branch_steps.values()),
                 "reused": sum(c["reused"] for c in self.branch_steps.values())}
        cuda = torch.device(self.device).type == "cuda"
        fp8 = self.fp8_steps > 0
        return {"cache": cache, "cache_mode": self.cache.mode,
                "graphs": self.graph_steps > 0 if cuda else "not_applicable", "graph_steps": self.graph_steps,
                "fp8": fp8 if cuda or not fp8 else "emulated", "fp8_steps": self.fp8_steps}

    def step_counts(self) -> dict[str, tuple[int, int]]:
        """{local branch: (steps computed in full, steps that reused the cached residual)}."""
        return {b: (s.computed, s.reused) for b, s in self.branch_state.items()}

    # -- steps -----------------------------------------------------------------------------------
    def active_branches(self) -> list[str]:
        """Branches whose velocity this step's CFG rule reads (outside the interval: cond only)."""
        if sampler.uses_cfg(self.params, self.flow.t_host):
            return self.branches
        return ["cond"]

    def active_local(self) -> list[str]:
        active = self.active_branches()
        return [b for b in self.local if b in active]

    def meta(self, active_local: list[str], rows: tuple[int, int] | None = None) -> StepMeta:
        """Cached metadata of the rows of `active_local` (in buffer order). The keys span the
        segments from the first to the last selected one; a segment in between that is not selected
        (a branch that reuses its cached residual) is a sequence with no queries. `rows` (lo, hi):
        the queries are only tokens [lo, hi) of each image segment (sequence parallel by K/V gather:
        cu_q / max_q count those); keys, positions and write slots stay every token's."""
        lo, hi = rows or (0, self.N)
        key = tuple(active_local) if (lo, hi) == (0, self.N) else (tuple(active_local), lo, hi)
        m = self._meta.get(key)
        if m is not None:
            return m
        sel = [i for i, s in enumerate(self.segments) if s.branch in active_local]
        segs = self.segments[sel[0]:sel[-1] + 1]
        pos, idx, cu_q, cu_k = [], [], [0], [0]
        ar = torch.arange(self.N, device=self.device)
        for s in segs:
            cu_k.append(cu_k[-1] + s.prefix_len + self.N)
            if s.branch not in active_local:
                cu_q.append(cu_q[-1])
                continue
            pos.append(image_token_positions(self.th, self.tw, self.t_offsets[s.branch],
                                             device=self.device))
            idx.append(ar + s.start + s.prefix_len)
            cu_q.append(cu_q[-1] + hi - lo)
        m = StepMeta(positions=torch.cat(pos, dim=1), write_idx=torch.cat(idx),
                     cu_q=torch.tensor(cu_q, dtype=torch.int32, device=self.device),
                     cu_k=torch.tensor(cu_k, dtype=torch.int32, device=self.device),
                     cu_q_host=torch.tensor(cu_q, dtype=torch.int32),
                     cu_k_host=torch.tensor(cu_k, dtype=torch.int32),
                     max_q=hi - lo, max_k=max(s.prefix_len for s in segs) + self.N,
                     k_start=segs[0].start, k_end=segs[0].start + cu_k[-1])
        self._meta[key] = m
        return m
