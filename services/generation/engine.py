"""The denoising engine of one rank: admit jobs (import prefix KV once), run batched steps.

One step = one `gen_forward` over the image tokens of every active (job, local branch, image) row,
packed varlen; attention per job over its own KV buffer; then per job: head, velocity, (all-gather of
velocities across CFG ranks), CFG combine and Euler step. Jobs join and leave between steps.
With step caching on for some job (its `cache` options), the forward gets a StepCache whose
groups are the (job, branch) row ranges: branches that reuse skip the stack (model.gen_forward).
With sequence parallelism (comm.sp, sequence_parallel.py) this rank runs its slice of every segment's
rows; attention sees whole segments for its heads (Ulysses) or its own query rows against every row's
K/V (kv-gather), and the hidden rows are gathered before the head.
Where the step is graphable (step_graph.py: CUDA, no LoRA rows; on by default) the layer stack runs from
CUDA graphs captured on the second step of a composition and replayed after, in segments so that the
yield gate and a first-block step cache run on the host between them. Each job counts the steps that
replayed graphs and ran fp8 GEMMs (`JobState.applied`: the response says which speed options applied).
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

import kernels
from kernels import kv_write_
from services.contract.image import GenerateRequest
from services.kit.errors import APIError
from services.model import row_blocks, sampler
from services.model.lora_batched import lora_rows
from services.model.moe import SparseMoE
from services.model.quant import Fp8Linear, fp8_policy
from services.model.step_cache import CacheGroup, StepCache

from . import faults, previews, rollout
from .attention import pick_denoise_attention
from .cfg_parallel import CfgComm, local_branches
from .lora import step_slots
from .kv_source import PrefixSource
from .protocol import KvImportStats
from .qos import YieldGate
from .request import JobState
from .sequence_parallel import check_heads
from .step_graph import EAGER, StepGraphs, graphable, layer_segments

log = logging.getLogger("u1serve.generation.engine")


def fp8_applies(model):
    """rows -> whether this forward's GEMMs run in fp8 (the GemmPolicy's row threshold; False: not quantised)."""
    policy = fp8_policy(model)
    return (lambda rows: False) if policy is None else policy.fp8


class _Rows(NamedTuple):
    """One job in a step: its active local branches, its rows [a, b) of the whole forward (canonical)
    and [la, lb) of this rank's rows (the same without sequence parallelism), its patchified state."""
    job: JobState
    act: list
    a: int
    b: int
    la: int
    lb: int
    z: torch.Tensor


class _Pack(NamedTuple):
    """A step's rows, built once from its jobs (`Engine._pack`): every job's _Rows (in job order), this
    rank's embedded rows and positions of each job that runs, the step cache's (job, branch) groups, the
    SP segment lengths, each job's LoRA run, and the row counts."""
    plan: list[_Rows]
    inputs: list[torch.Tensor]
    positions: list[torch.Tensor]
    groups: list[CacheGroup]
    segments: list[int]
    runs: list
    local_rows: int         # rows on this rank
    rows: int               # rows of the whole forward (canonical)


def linear_gemms(model) -> bool:
    """Whether every GEMM of the model's stack is a plain linear layer (what row_blocks splits by rows): no 8-bit
    layers (their row-count policy and quantiser see the whole forward) and no MoE (its expert kernels group every
    row)."""
    return not any(isinstance(m, (Fp8Linear, SparseMoE)) for m in model.modules())


def check_prefix_finite(branch: str, kv: torch.Tensor) -> None:
    """A prefix KV [L, 2, P, Hkv, D] holding NaN/Inf makes every image of the job NaN: refuse the job at admission with
    where the bad values are (layer, K or V, token), which says whether understanding's prefill or the transport made
    them (one reduction per job and branch; the import has synchronised already)."""
    if bool(torch.isfinite(kv).all()):
        return
    bad = ~torch.isfinite(kv)           # only on the failure path: where, and how many
    layer, kv_i, token = (int(i) for i in bad.nonzero()[0][:3])
    count = int(bad.sum())
    msg = (f"the prefix KV of branch {branch!r} holds {count} non-finite values of {kv.numel()} (first: layer "
           f"{layer}, {'KV'[kv_i]}, token {token} of {kv.shape[2]}); the prompt's prefill or the KV transport made them")
    log.error("%s", msg)
    raise APIError(500, msg, code="nonfinite_prefix")


class Engine:
    def __init__(self, model, prefix_source: PrefixSource, comm: CfgComm | None = None,
                 yield_gate: YieldGate | None = None, cuda_graphs: str = "off", graph_segment_layers: int = 4,
                 graph_keys: str = "job"):
        """yield_gate (colocate QoS, qos.py): before each layer's attention (eager steps) or between graph
        segments of `graph_segment_layers` layers (graphed steps), give the GPU to a waiting decode step of the
        understanding engine. cuda_graphs: auto | on | off (step_graph.py; the server passes --cuda-graphs,
        default auto = on where the device is CUDA); graph_keys: job | shape (--graph-keys resolved; job under SP)."""
        self.model = model
        self.gate = yield_gate
        self.device = model.device
        self.dtype = model.dtype
        self.source = prefix_source
        self.comm = comm or CfgComm.single()
        self.running: list[JobState] = []
        self.scale = 1.0 / math.sqrt(model.head_dim)
        self._attn, self._host_lengths = pick_denoise_attention(self.device)
        self.sp = self.comm.sp
        check_heads(model.num_heads, model.num_kv_heads, self.sp.world, self.sp.mode)
        self._kv_heads = self.sp.kv_heads(model.num_kv_heads)   # the KV heads this rank's buffers hold
        # keyed by shape with one SP rank only (the config refuses --graph-keys shape with --sp > 1)
        self.graphs = StepGraphs(self.device, cuda_graphs, graph_keys if self.sp.world == 1 else "job")
        self.graph_segment_layers = graph_segment_layers
        self.fp8 = fp8_applies(model)
        self.weights_version = "0"      # the version of the weights every running job runs under (weights.py)
        self.trajectory_segments = None     # rank 0 of a served engine: where rollouts record (shared_trajectory.py)
        self._linear_gemms = linear_gemms(model)

    # -- admission -----------------------------------------------------------------------------
    def admit(self, spec: GenerateRequest) -> tuple[JobState, list[KvImportStats]]:
        """Build the job and import this rank's prefixes. Returns (job, stats). Raises APIError."""
        handles = {b: self.source.parse(spec.handles[b]) for b in spec.handles}
        for b, h in handles.items():
            if h.branch not in (b, "") and h.branch in ("cond", "uncond", "img_cond"):
                raise APIError(400, f"handle for branch {b!r} was exported as {h.branch!r}",
                               param=f"handles.{b}", code="kv_branch_mismatch")
        job, stats = None, []
        sp = self.sp.world > 1
        h0, h1 = self._kv_heads
        heads = (h0, h1) if h1 - h0 < self.model.num_kv_heads else None
        try:
            job = self._new_job(spec, {b: h.num_tokens for b, h in handles.items()},
                                {b: h.t_offset for b, h in handles.items()})
            for b in job.local:
                # The pool import wants a contiguous [L, 2, P, Hkv, D] destination; our buffer packs
                # every segment of a layer together (one attention call per layer and job), so the
                # prefix lands in a device-local staging tensor first: one extra on-device copy per
                # job and branch, never per step. Ulysses SP: each rank imports its KV-head slice.
                staging = torch.empty((self.model.num_layers, 2, handles[b].num_tokens, h1 - h0,
                                       self.model.head_dim), device=self.device, dtype=self.dtype)
                nbytes, seconds = self.source.import_into(handles[b], staging,
                                                          heads=heads,
                                                          release=not sp)
                check_prefix_finite(b, staging)
                job.set_prefix(b, staging)
                del staging
                stats.append(KvImportStats(bytes=nbytes, seconds=seconds))
        except BaseException:
            if job is not None:
                job.free()
            raise
        finally:
            if sp:   # the SP ranks of a CFG rank read the same pages: free them once all have read
                self.sp.barrier()
                if self.sp.rank == 0:
                    self.source.release([spec.handles[b] for b in self._local(spec)])
        return job, stats

    def admit_local(self, spec: GenerateRequest, prefixes: dict[str, torch.Tensor],
                    t_offsets: dict[str, int]) -> JobState:
        """A job whose prefix KV [L, 2, P, Hkv, D] per branch is already in memory (warm-up,
        benchmarks, quality runs): no pool. `spec.handles` only names the branches."""
        job = self._new_job(spec, {b: kv.shape[2] for b, kv in prefixes.items()}, t_offsets)
        h0, h1 = self._kv_heads
        for b in job.local:
            job.set_prefix(b, prefixes[b][:, :, :, h0:h1].to(self.device, self.dtype))
        return job

    def _local(self, spec: GenerateRequest) -> list[str]:
        return local_branches(list(spec.handles), self.comm.cfg_rank, self.comm.cfg_world)

    def _new_job(self, spec: GenerateRequest, prefix_lens: dict[str, int], t_offsets: dict[str, int]):
        h0, h1 = self._kv_heads
        job = JobState(spec, self._local(spec), self.model, self.device, self.dtype, kv_heads=h1 - h0)
        rollout.attach(job, spec, self)           # RL jobs: the SDE transition and what it records
        lens = {b: prefix_lens[b] for b in job.local}
        if self.graphs.holds() and not self.running and not self.graphs.held_for(job.graph_shape(lens, t_offsets)):
            self.graphs.release()         # an idle graph of another shape goes before this job's KV: peak as by job
        try:
            try:
                job.allocate_kv(lens, t_offsets)
            except torch.OutOfMemoryError:
                if not self.graphs.holds():
                    raise
                self.graphs.release()     # an idle graph's buffers (keyed by shape) give way to a job
                job.allocate_kv(lens, t_offsets)
        except BaseException:
            job.free()                            # its trajectory segment, if it made one
            raise
        return job

    def add(self, job: JobState) -> None:
        self.running.append(job)

    def abort(self, request_id: str) -> JobState | None:
        for i, job in enumerate(self.running):
            if job.request_id == request_id:
                del self.running[i]
                self.graphs.forget(job)     # before free(): a graph may point at its KV
                job.free()
                return job
        return None

    def free(self, finished: list[JobState]) -> None:
        """Jobs a step finished (no longer running) give their device buffers back, after their results went."""
        for job in finished:
            job.free()

    # -- one step --------------------------------------------------------------------------------
    def shares_forward_exactly(self, job: JobState) -> bool:
        """Whether `job` (an RL job) may share a forward with other such jobs and keep the bits it has alone
        (reference.py): every GEMM of the stack is a linear layer run per job (`exact` steps), the rest is
        row-wise or per job. Not where some GEMM is not a plain linear layer (`linear_gemms`), nor with LoRA rows, a
        step cache (its groups decide per step), sequence parallelism (the row layout splits each job over ranks),
        nor on CUDA for a job that may have at most SKINNY_MAX_ROWS rows (alone, its linear layers would take the
        skinny kernel, which sees the whole forward)."""
        skinny = self.device.type == "cuda" and job.n * job.N <= kernels.SKINNY_MAX_ROWS
        return (self._linear_gemms and job.lora is None and job.cache.mode == "off" and self.sp.world == 1
                and not skinny)

    @torch.inference_mode()
    def step(self, jobs: list[JobState] | None = None, exact: bool = False) -> tuple[list[JobState], int]:
        """Advance every running job (or those of `jobs`) by one step. Returns (finished jobs, rows in the
        forward). Pack the rows, run the layer stack, heads -> velocities, then (after the CFG gather)
        combine and step each job. `exact`: every job's linear layers run on its rows alone (as when it
        steps alone: RL jobs sharing a forward, `shares_forward_exactly`)."""
        jobs = list(self.running) if jobs is None else jobs
        faults.inject_step_faults(jobs)
        pack = self._pack(jobs)
        local_v: list[torch.Tensor] = []
        if pack.rows:   # the same on every SP rank (a rank may hold no rows of tiny images: it still joins)
            hidden, layout, cache = self._forward(jobs, pack, exact)
            self._count_applied(pack, cache)
            local_v = self._velocities(pack.plan, hidden, layout)
        finished = self._advance(pack.plan, self.comm.gather_velocities(jobs, local_v))
        self._retire(finished)
        return finished, pack.local_rows

    def _pack(self, jobs: list[JobState]) -> _Pack:
        """Each job's rows of this step, embedded once per job and shared by its branches (rows
        branch-major); this rank's rows of each (branch, image) segment are its tokens [lo, hi)."""
        sp = self.sp
        plan: list[_Rows] = []
        inputs, positions, groups, segments, runs = [], [], [], [], []
        r = c = 0                     # rows on this rank, rows of the whole forward (canonical)
        for job in jobs:
            act = job.active_local()
            z = sampler.patchify(job.x)
            if not act:               # no local branch this step: it still advances (others' velocities)
                plan.append(_Rows(job, act, c, c, r, r, z))
                continue
            x_in = self.model.gen_embed(job.x, job.flow.t, job.noise_scale)
            lo, hi = sp.bounds(job.N)
            meta = job.meta(act)
            inputs.append(x_in[:, lo:hi].reshape(-1, x_in.shape[-1]).repeat(len(act), 1))
            pos = meta.positions
            positions.append(pos if sp.world == 1 else
                             pos.view(3, -1, job.N)[:, :, lo:hi].reshape(3, -1))
            per = job.n * (hi - lo)
            groups += [CacheGroup(r + i * per, r + (i + 1) * per, job.branch_state[b], job.cache,
                                  job.flow.index, key=(job, b), tokens=job.N) for i, b in enumerate(act)]
            segments += [job.N] * (len(act) * job.n)
            runs.append((job, per * len(act)))         # this job's rows: its LoRA adapter (lora.py)
            plan.append(_Rows(job, act, c, c + meta.write_idx.numel(), r, r + per * len(act), z))
            r += per * len(act)
            c += meta.write_idx.numel()
        return _Pack(plan, inputs, positions, groups, segments, runs, r, c)

    def _forward(self, jobs: list[JobState], pack: _Pack, exact: bool = False):
        """The layer stack over the packed rows -> (hidden, SP row layout or None, step cache or None):
        replayed from the step graphs where graphable (no LoRA rows), eager otherwise."""
        sp = self.sp
        packed = torch.cat(pack.inputs) if len(pack.inputs) > 1 else pack.inputs[0]
        pos = torch.cat(pack.positions, dim=1)
        spans = [(p.job, p.act, p.a, p.b, p.la, p.lb) for p in pack.plan if p.act]
        layout = sp.layout(pack.segments, self.device) if sp.world > 1 else None
        cache = None
        if any(j.cache.mode != "off" for j in jobs):
            cache = StepCache(pack.groups, self._attend_for_groups, reduce=sp.sum_over_ranks if sp.world > 1 else None)
        slots = step_slots(pack.runs)
        blocks = self._row_blocks(pack, cache, layout, exact)
        if self.graphs.enabled and graphable(self.device, slots is not None):
            with row_blocks.per_sequence(blocks, self.device, force=exact):
                return self._graphed_forward(spans, packed, pos, layout, cache), layout, cache
        self.graphs.not_graphable()
        with lora_rows(self.model, slots), row_blocks.per_sequence(blocks, self.device, force=exact):
            hidden = self.model.gen_forward(packed, self.model.rope(pos), self._attend(spans, layout), cache)
        return hidden, layout, cache

    def _row_blocks(self, pack: _Pack, cache, layout, exact: bool) -> list[int]:
        """The row blocks the linear layers run on one by one (row_blocks): each (job, branch) as the reference's
        per-branch forward where exact rows are on (CPU); for an `exact` step elsewhere each job's rows, as its
        forward alone runs them; none with a step cache or SP."""
        if cache is not None or layout is not None:
            return []
        if exact and not row_blocks.enabled(self.device):
            return [p.lb - p.la for p in pack.plan if p.act]
        return [g.stop - g.start for g in pack.groups]

    def _count_applied(self, pack: _Pack, cache: StepCache | None) -> None:
        """What this step's forward applied, per job (graphs, fp8) and, without a step cache deciding it,
        per (job, branch): a computed step."""
        fp8 = self.fp8(pack.local_rows)
        for p in pack.plan:
            if p.act:
                p.job.count_applied(graphs=self.graphs.last != EAGER, fp8=fp8)
        if cache is None:
            for g in pack.groups:
                g.state.computed += 1

    def _velocities(self, plan: list[_Rows], hidden: torch.Tensor, layout) -> list[torch.Tensor]:
        """This rank's velocity per (job, active local branch), in plan order (what the CFG gather expects)."""
        local_v = []
        for p, x_hat in self._heads(plan, hidden, layout):
            for i in range(len(p.act)):
                local_v.append(sampler.velocity(x_hat[i], p.z, p.job.flow.t, p.job.spec.t_eps))
        return local_v

    def _advance(self, plan: list[_Rows], v_all: dict[str, dict]) -> list[JobState]:
        """Per job: CFG combine of every branch's velocity, the preview, the Euler step (or the RL
        transition), the new state. Returns the jobs whose schedule is done."""
        finished = []
        for p in plan:
            job = p.job
            v = sampler.combine(v_all[job.request_id], job.params, job.flow.index, job.flow.t_host)
            job.preview = previews.capture(job, p.z, v) if self.comm.rank == 0 else None
            if job.rl is None:
                z = job.flow.step(p.z, v)
            else:                       # the RL transition (SDE steps, or a stored trajectory's next state)
                z = job.rl.transition(job, p.z, v)
                job.flow.advance()
            job.x = sampler.unpatchify(z, job.th, job.tw)
            if job.flow.done:
                finished.append(job)
        return finished

    def _retire(self, finished: list[JobState]) -> None:
        """The finished leave the running set (and their graphs); their branch step counts are agreed."""
        for job in finished:
            self.running.remove(job)
            self.graphs.forget(job)         # the caller frees its KV next
        self._record_branch_steps(finished)

    def _graphed_forward(self, spans, packed: torch.Tensor, pos: torch.Tensor, layout, cache) -> torch.Tensor:
        """The layer stack through the engine's CUDA graphs (step_graph.py), in segments: the yield gate runs
        between them, and a step cache decides between [0, 1) and the rest. What the attend closure bakes in
        (job.kv, each job's cached StepMeta and its host ints, under SP the row layout and the collectives) is
        fixed by the key; the segment layout too (the gate is the engine's, a job's cache mode is its own)."""
        model, graphs, gate = self.model, self.graphs, self.gate
        rope, spans = graphs.begin(spans, packed.shape[0], pos, model.rope)    # keyed by shape: the stand-ins
        if rope is None:        # the composition's first step (its warm-up), or graphs refused: eager
            hidden = model.gen_forward(packed, model.rope(pos), self._attend(spans, layout), cache)
            graphs.end()
            return hidden
        attend = self._attend(spans, layout, gated=False)     # no host work inside a capture
        last = model.num_layers
        segs = layer_segments(last, self.graph_segment_layers if gate is not None else 0,
                              cache is not None and cache.probes)

        def stack(h: torch.Tensor, start: int, stop: int | None, final: bool = False) -> torch.Tensor:
            stop = last if stop is None else stop
            for a, b in segs:
                if a < start or b > stop:
                    continue
                if gate is not None and a > 0:
                    gate.boundary()
                h = graphs.segment((a, b), lambda x, r, a=a, b=b: model.gen_layers(
                    x, r, attend, a, b, final_norm=final and b == last), h)
            return h

        if cache is None:
            hidden = stack(packed, 0, last, final=True)
        else:
            cache.layers = stack
            hidden = model.gen_forward(packed, rope, attend, cache)
        graphs.end()
        return hidden

    def _heads(self, plan: list["_Rows"], hidden: torch.Tensor, layout):
        """(rows, x_hat per active branch [n, N, 3072]) of every job that ran. Without SP: the head per
        branch on [n, N, H] as the reference (same GEMM shapes, same bits). SP: the per-token MLP head
        (U1) runs on this rank's rows and its output is gathered (narrower than the hidden); the pixel
        head (U1.5) mixes neighbouring tokens, so the hidden rows are gathered first."""
        model, ran = self.model, [p for p in plan if p.act]
        if layout is not None and not model.cfg.use_pixel_head:
            parts = []
            for p in ran:
                h = hidden[p.la:p.lb].view(len(p.act), p.job.n, -1, hidden.shape[-1])
                parts += [model.gen_head(h[i], p.job.th, p.job.tw).flatten(0, 1) for i in range(len(p.act))]
            full = self.sp.gather_rows(layout, torch.cat(parts))
            return [(p, full[p.a:p.b].view(len(p.act), p.job.n, p.job.N, -1)) for p in ran]
        if layout is not None:
            hidden = self.sp.gather_rows(layout, hidden)
        out = []
        for p in ran:
            h = hidden[p.a:p.b].view(len(p.act), p.job.n, p.job.N, -1)
            out.append((p, [model.gen_head(h[i], p.job.th, p.job.tw) for i in range(len(p.act))]))
        return out

    def _record_branch_steps(self, finished: list[JobState]) -> None:
        """Each finished job's {branch: {"computed", "reused"}} over every rank's branches."""
        if not finished:
            return
        for j in finished:
            if j.cache.mode != "off":   # why a cache reused what it did: the changes it measured vs its threshold
                log.info("step cache %s (threshold %s): %s", j.cache.mode, j.cache.threshold, "; ".join(
                    f"{b} computed {s.computed} reused {s.reused} change {_fmt_range(s.change_range)}"
                    for b, s in j.branch_state.items()))
        local = {j.request_id: j.step_counts() for j in finished}
        parts = self.comm.all_gather_objects(local) if self.comm.world > 1 else [local]
        for job in finished:
            merged = {}
            for part in parts:
                merged.update(part[job.request_id])
            job.branch_steps = {b: {"computed": merged[b][0], "reused": merged[b][1]}
                                for b in job.branches if b in merged}

    def _attend_for_groups(self, groups: list[CacheGroup]):
        """Attention of a subset of (job, branch) groups whose rows are packed in order."""
        spans, r, lr, segments = [], 0, 0, []
        for g in groups:
            job, b = g.key
            n = job.n * job.N          # the group's rows over every SP rank
            lo, hi = self.sp.bounds(job.N)
            ln = job.n * (hi - lo)     # and on this rank
            if spans and spans[-1][0] is job:
                j, act, a, _, la, _ = spans[-1]
                spans[-1] = (j, act + [b], a, r + n, la, lr + ln)
            else:
                spans.append((job, [b], r, r + n, lr, lr + ln))
            r += n
            lr += ln
            segments += [job.N] * job.n
        return self._attend(spans, self.sp.layout(segments, self.device) if self.sp.world > 1 else None)

    def _attend(self, spans, layout, gated: bool = True):
        """The forward's attend: per-job attention (under SP wrapped by the mode's collective), with the yield
        gate before each layer (`gated`: eager steps; graphed steps run it between segments)."""
        attend = self._make_attend(spans)
        if layout is not None:
            attend = self.sp.wrap_attend(layout, attend)
        return attend if self.gate is None or not gated else self.gate.wrap(attend)

    def _make_attend(self, spans):
        """spans: (job, active local branches, canonical rows [a, b), local rows [la, lb)). k / v come
        for every row in canonical order and are written at their slots; q comes for the local rows
        (no SP, kv-gather: tokens [lo, hi) of each segment) or for every row (Ulysses)."""
        attn, scale, host, sp = self._attn, self.scale, self._host_lengths, self.sp
        local_q = sp.local_queries
        plan = []                      # per span, once per forward (every layer reads the same metadata)
        for job, act, a, b, la, lb in spans:
            m = job.meta(act)
            qm, qa, qb = (job.meta(act, sp.bounds(job.N)), la, lb) if local_q else (m, a, b)
            cu_q, cu_k = (qm.cu_q_host, m.cu_k_host) if host else (qm.cu_q, m.cu_k)
            plan.append((job, m, a, b, qa, qb, cu_q, cu_k, qm.max_q))

        def attend(layer: int, q, k, v):
            outs = []
            for job, m, a, b, qa, qb, cu_q, cu_k, max_q in plan:
                kv = job.kv[layer]
                kv_write_(kv, m.write_idx, k[a:b], v[a:b])
                if qa == qb:           # this rank holds none of the job's rows (N < sp)
                    outs.append(q[qa:qb])
                    continue
                outs.append(attn(q[qa:qb], kv[0, m.k_start:m.k_end], kv[1, m.k_start:m.k_end], cu_q, cu_k,
                                 max_q, m.max_k, scale))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        return attend

    # -- outputs -----------------------------------------------------------------------------------
    @staticmethod
    def pixels(job: JobState):
        """uint8 [n, H, W, 3] numpy, decoded exactly as the reference's to_pil: converted on the
        device (a quarter of the bytes cross PCIe), one copy into pinned host memory."""
        return sampler.to_host(sampler.to_uint8_device(job.x)).numpy()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_memory(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None


def _fmt_range(r) -> str:
    return "not measured" if r is None else f"{r[0]:.4g}..{r[1]:.4g}"
