"""CFG-parallel plumbing: which rank runs which branch, and the one collective per step.

Branch k (in canonical order cond, uncond, img_cond among a job's branches) runs on CFG rank k % cfg, so
2 ranks split cond/uncond (or cond/img_cond) and 3-branch editing puts two branches on rank 0. Only
velocities cross CFG ranks (one padded all_gather per step); every rank then runs the same combine +
Euler on identical inputs, so states stay identical without a broadcast. Control (admissions,
aborts) goes from rank 0 as small pickled objects over a gloo group of all ranks.

With sequence parallelism (`sp` > 1, sequence_parallel.py) the world is cfg x sp ranks: rank =
cfg_rank * sp + sp_rank, so the SP ranks of one CFG rank are neighbours (one SP group per CFG rank, one
CFG group per SP position). Every SP rank of a CFG rank holds whole velocities of its branches after the
step's row gather; the velocity all_gather runs within each CFG group.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .sequence_parallel import SeqParallel

_TOKEN_VALUES = 3 * 32 * 32   # x_hat / velocity values per image token (32x32 RGB)
CONTROL_TIMEOUT = timedelta(days=7)  # followers wait for rank 0 between jobs without timing out


def local_branches(branches: list[str], rank: int, world: int) -> list[str]:
    return [b for k, b in enumerate(branches) if k % world == rank]


class CfgComm:
    def __init__(self, rank: int, world: int, control_group=None, data_group=None,
                 device: torch.device | None = None, sp: SeqParallel | None = None):
        self.rank = rank              # in the whole world (control: rank 0 leads)
        self.world = world
        self.control_group = control_group
        self.data_group = data_group  # this rank's CFG group (velocities)
        self.device = device
        self.sp = sp or SeqParallel.single()
        self.cfg_rank, self.cfg_world = rank // self.sp.world, world // self.sp.world

    @classmethod
    def single(cls) -> "CfgComm":
        return cls(0, 1)

    @classmethod
    def init(cls, rank: int, world: int, port: int, device: torch.device, sp: int = 1,
             sp_mode: str = "ulysses") -> "CfgComm":
        """world = cfg x sp ranks; every rank builds every subgroup (torch wants the same calls).
        sp_mode: how the SP ranks attend (sequence_parallel.py: ulysses | kv-gather)."""
        if sp < 1 or world % sp:
            raise ValueError(f"sequence parallel {sp} must divide the {world} generation ranks")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=CONTROL_TIMEOUT,
                                **({"device_id": device} if device.type == "cuda" else {}))
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) \
            if backend != "gloo" else dist.group.WORLD
        cfg = world // sp
        if sp == 1:
            return cls(rank, world, control, dist.group.WORLD, device)
        sp_groups = [dist.new_group([c * sp + s for s in range(sp)], backend=backend) for c in range(cfg)]
        sp_ctrl = [dist.new_group([c * sp + s for s in range(sp)], backend="gloo", timeout=CONTROL_TIMEOUT)
                   for c in range(cfg)]
        cfg_groups = [dist.new_group([c * sp + s for c in range(cfg)], backend=backend) for s in range(sp)] \
            if cfg > 1 else [None] * sp
        c, s = divmod(rank, sp)
        seq = SeqParallel(s, sp, sp_groups[c], sp_ctrl[c], sp_mode)
        return cls(rank, world, control, cfg_groups[s], device, seq)

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # -- control -------------------------------------------------------------------------------
    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def all_gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    # -- data ------------------------------------------------------------------------------------
    def gather_velocities(self, jobs, local_v: list[torch.Tensor]) -> dict[str, dict]:
        """local_v: this rank's velocities in (job order, local active branch order).
        Returns {request_id: {branch: v}} with every active branch of every job."""
        if self.cfg_world == 1:
            out, it = {}, iter(local_v)
            for job in jobs:
                out[job.request_id] = {b: next(it) for b in job.active_local()}
            return out
        # Every rank derives every rank's layout from the shared job list: no size exchange.
        layouts = []
        for r in range(self.cfg_world):
            entries = []
            for job in jobs:
                mine = local_branches(job.branches, r, self.cfg_world)
                for b in job.active_branches():
                    if b in mine:
                        entries.append((job, b))
            layouts.append(entries)
        numel = [sum(job.n * job.N * _TOKEN_VALUES for job, _ in e) for e in layouts]
        width = max(max(numel), 1)
        dtype = jobs[0].x.dtype
        flat = torch.zeros(width, dtype=dtype, device=jobs[0].x.device)
        if local_v:
            cat = torch.cat([v.reshape(-1) for v in local_v])
            flat[:cat.numel()] = cat
        parts = [torch.empty_like(flat) for _ in range(self.cfg_world)]
        dist.all_gather(parts, flat, group=self.data_group)
        out = {job.request_id: {} for job in jobs}
        for r, entries in enumerate(layouts):
            off = 0
            for job, b in entries:
                size = job.n * job.N * _TOKEN_VALUES
                v = parts[r] if r != self.cfg_rank else flat
                out[job.request_id][b] = v[off:off + size].view(job.n, job.N, _TOKEN_VALUES)
                off += size
        return out
