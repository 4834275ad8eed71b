"""The denoising engine of one rank: admit jobs (import prefix KV once), run batched steps.

One step = one `gen_forward` over the image tokens of every active (job, local branch, image) row,
packed varlen; attention per job over its own KV buffer; then per job: head, velocity, (all-gather of
velocities across CFG ranks), CFG combine and Euler step. Jobs join and leave between steps.
With step caching on for some job (its `cache` options), the forward gets a FirstBlockCache whose
groups are the (job, branch) row ranges: branches that reuse skip layers 1.. (model.gen_forward).
"""
from __future__ import annotations

import math

import torch

from services.model import sampler
from services.model.step_cache import CacheGroup, FirstBlockCache

from . import previews
from .attention import pick_denoise_attention
from .cfg_parallel import CfgComm, local_branches
from .job_state import JobState
from .kv_source import PrefixSource
from .request import ApiError, GenerateJob


class Engine:
    def __init__(self, model, prefix_source: PrefixSource, comm: CfgComm | None = None):
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.source = prefix_source
        self.comm = comm or CfgComm.single()
        self.running: list[JobState] = []
        self.scale = 1.0 / math.sqrt(model.head_dim)
        self._attn, self._host_lengths = pick_denoise_attention(self.device)

    # -- admission -----------------------------------------------------------------------------
    def admit(self, spec: GenerateJob) -> tuple[JobState, list[dict]]:
        """Build the job and import this rank's prefixes. Returns (job, stats). Raises ApiError."""
        handles = {b: self.source.parse(spec.handles[b]) for b in spec.branches}
        for b, h in handles.items():
            if h.branch not in (b, "") and h.branch in ("cond", "uncond", "img_cond"):
                raise ApiError(400, f"handle for branch {b!r} was exported as {h.branch!r}",
                               param=f"handles.{b}", code="kv_branch_mismatch")
        job = self._new_job(spec, {b: h.num_tokens for b, h in handles.items()},
                            {b: h.t_offset for b, h in handles.items()})
        stats = []
        try:
            for b in job.local:
                # The pool import wants a contiguous [L, 2, P, Hkv, D] destination; our buffer packs
                # every segment of a layer together (one attention call per layer and job), so the
                # prefix lands in a device-local staging tensor first: one extra on-device copy per
                # job and branch, never per step.
                staging = torch.empty((self.model.num_layers, 2, handles[b].num_tokens,
                                       self.model.num_kv_heads, self.model.head_dim),
                                      device=self.device, dtype=self.dtype)
                nbytes, seconds = self.source.import_into(handles[b], staging)
                job.set_prefix(b, staging)
                del staging
                stats.append({"stat": "kv_import", "bytes": nbytes, "seconds": seconds})
        except BaseException:
            job.free()
            raise
        return job, stats

    def admit_local(self, spec: GenerateJob, prefixes: dict[str, torch.Tensor],
                    t_offsets: dict[str, int]) -> JobState:
        """A job whose prefix KV [L, 2, P, Hkv, D] per branch is already in memory (warm-up,
        benchmarks, quality runs): no pool. `spec.handles` only names the branches."""
        job = self._new_job(spec, {b: kv.shape[2] for b, kv in prefixes.items()}, t_offsets)
        for b in job.local:
            job.set_prefix(b, prefixes[b].to(self.device, self.dtype))
        return job

    def _new_job(self, spec: GenerateJob, prefix_lens: dict[str, int], t_offsets: dict[str, int]):
        job = JobState(spec, local_branches(spec.branches, self.comm.rank, self.comm.world),
                       self.model, self.device, self.dtype)
        job.allocate_kv({b: prefix_lens[b] for b in job.local}, t_offsets)
        return job

    def add(self, job: JobState) -> None:
        self.running.append(job)

    def drop(self, request_id: str) -> JobState | None:
        for i, job in enumerate(self.running):
            if job.request_id == request_id:
                del self.running[i]
                job.free()
                return job
        return None

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> tuple[list[JobState], int]:
        """Advance every running job by one step. Returns (finished jobs, rows in the forward)."""
        jobs = list(self.running)
        plan = []                     # (job, active_local, row_start, row_end, z)
        rows, positions, groups = [], [], []
        r = 0
        for job in jobs:
            act = job.active_local()
            z = sampler.patchify(job.x)
            if act:
                # Embeddings once per job and step, shared by its branches (rows branch-major).
                x_in = self.model.gen_embed(job.x, job.t, job.noise_scale)
                meta = job.meta(act)
                rows.append(x_in.reshape(-1, x_in.shape[-1]).repeat(len(act), 1))
                positions.append(meta.positions)
                per = job.n * job.N
                groups += [CacheGroup(r + i * per, r + (i + 1) * per, job.branch_state[b], job.cache,
                                      job.step, key=(job, b)) for i, b in enumerate(act)]
                plan.append((job, act, r, r + meta.write_idx.numel(), z))
                r += meta.write_idx.numel()
            else:
                plan.append((job, act, r, r, z))

        local_v: list[torch.Tensor] = []
        if r:
            packed = torch.cat(rows) if len(rows) > 1 else rows[0]
            rope = self.model.rope(torch.cat(positions, dim=1))
            spans = [(job, act, a, b) for job, act, a, b, _ in plan if act]
            cache = None
            if any(j.cache.mode != "off" for j in jobs):
                cache = FirstBlockCache(groups, self._attend_for_groups)
            hidden = self.model.gen_forward(packed, rope, self._make_attend(spans), cache)
            if cache is None:
                for g in groups:
                    g.state.computed += 1
            for job, act, a, b, z in plan:
                if not act:
                    continue
                h = hidden[a:b].view(len(act), job.n, job.N, -1)
                for i in range(len(act)):
                    # Head per branch, [n, N, H] as the reference: same GEMM shapes, same bits.
                    x_hat = self.model.gen_head(h[i], job.th, job.tw)
                    local_v.append(sampler.velocity(x_hat, z, job.t, job.spec.t_eps))

        v_all = self.comm.gather_velocities(jobs, local_v)
        finished = []
        for (job, _, _, _, z) in plan:
            v = sampler.combine(v_all[job.request_id], job.params, job.step,
                                job.t_values[job.step])
            job.preview = previews.capture(job, z, v) if self.comm.rank == 0 else None
            z = sampler.euler(z, v, job.t, job.t_next)
            job.x = sampler.unpatchify(z, job.th, job.tw)
            job.step += 1
            if job.done:
                finished.append(job)
        for job in finished:
            self.running.remove(job)
        self._record_branch_steps(finished)
        return finished, r

    def _record_branch_steps(self, finished: list[JobState]) -> None:
        """Each finished job's {branch: {"computed", "reused"}} over every rank's branches."""
        if not finished:
            return
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
        spans, r = [], 0
        for g in groups:
            job, b = g.key
            n = g.stop - g.start
            if spans and spans[-1][0] is job:
                j, act, a, _ = spans[-1]
                spans[-1] = (j, act + [b], a, r + n)
            else:
                spans.append((job, [b], r, r + n))
            r += n
        return self._make_attend(spans)

    def _make_attend(self, spans):
        attn, scale, host = self._attn, self.scale, self._host_lengths

        def attend(layer: int, q, k, v):
            outs = []
            for job, act, a, b in spans:
                m = job.meta(act)
                kv = job.kv[layer]
                kv[0].index_copy_(0, m.write_idx, k[a:b])
                kv[1].index_copy_(0, m.write_idx, v[a:b])
                cu_q, cu_k = (m.cu_q_host, m.cu_k_host) if host else (m.cu_q, m.cu_k)
                outs.append(attn(q[a:b], kv[0, m.k_start:m.k_end], kv[1, m.k_start:m.k_end], cu_q, cu_k,
                                 m.max_q, m.max_k, scale))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        return attend

    # -- outputs -----------------------------------------------------------------------------------
    @staticmethod
    def pixels(job: JobState):
        """uint8 [n, H, W, 3] numpy, decoded exactly as the reference's to_pil: converted on the
        device (a quarter of the bytes cross PCIe), one copy into pinned host memory."""
        return sampler.to_host(sampler.to_uint8_device(job.x)).numpy()

    def peak_memory(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None
