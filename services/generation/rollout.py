"""RL jobs inside the engine (docs/rl.md): a rollout job is an ordinary n-image job over one set of prefixes whose
transition runs the SDE (services/model/flow_sde.py) on the selected steps and records per-sample log-probs and
the trajectory; a score job re-evaluates the velocity at a stored trajectory's SDE steps only (each step's input
is the stored z_k, so the steps are independent) and returns the log-probs of the stored z_{k+1}.

The engine calls `job.rl.transition(job, z, v)` in place of the Euler step (z, v patchified [n, N, 3072], v the
CFG-combined velocity); every CFG / SP rank computes the same transition from the same per-sample generators.
The state z stays in the engine's dtype as on the image path (ODE steps are the exact Euler step); an SDE step
computes mean and std in fp32, rounds z' to the state dtype and evaluates the log-prob on the rounded z', so
scoring the stored trajectory reproduces it exactly.

Nothing of a step waits on the host: the log-probs stay on the device, and each recorded state is copied as it is
made into the job's trajectory buffer on the host (pinned on CUDA: an asynchronous copy on a side stream, overlapping
the next step's kernels); the job waits once, when it finishes, for the last copies (`HostTrajectory`). On a served
engine's rank 0 that buffer is a shared-memory segment the HTTP process then maps (shared_trajectory.py): the result
names it, no byte crosses the pipe; a side thread makes and pins it while the first states wait on the device. Only
rank 0 records (the other ranks' results are never read).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np
import torch

from services.contract.rl import DEFAULT_WEIGHTS_VERSION, RolloutJobRequest, ScoreJobRequest
from services.kit.errors import APIError
from services.model import flow_sde, sampler

from .config import RL_WAITING_BYTES as WAITING_BYTES
from .protocol import JobFailed, RlResult, TrajectorySegment


def weights_version(engine) -> str:
    """The version of the weights a job is admitted under: the engine's `weights_version` (set by live weight
    updates, which apply between jobs)."""
    return str(getattr(engine, "weights_version", DEFAULT_WEIGHTS_VERSION))


_COPY_STREAMS: dict = {}        # device -> the side stream the trajectories' device -> host copies run on


def _copy_stream(device: torch.device):
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class HostTrajectory:
    """A rollout's states z_0..z_N f32 [n, N+1, 3, H, W] in host memory, filled a state at a time by copies that do
    not wait: on CUDA into pinned memory (each sample's slot a contiguous destination) on a side stream that starts
    each copy once the step made the state, the state held for that stream (`record_stream`); waited for once by
    `take`. With `segments` (rank 0 of a served engine) the memory is a shared-memory segment (shared_trajectory.py)
    and `take` hands over its reference; else a pinned buffer and `take` gives the array. `discard` frees a
    trajectory whose result never went. `waits` counts the host's waits on the device (the rollout's one, at the
    end).

    The engine loop's part per rollout with segments: at admission, name the segment and check /dev/shm's room
    (the side thread makes, fallocates, maps and pins it); each step, one f32 copy of the state on the device and,
    once the segment is made, its device -> host copies issued on the copy stream behind an event (no host wait;
    until then the copy waits on the device, `WAITING_BYTES` at most for all rollouts together); at the end, wait
    for the segment if the side thread is behind, the one wait for the last copies, and the reference handed over
    (the side thread unpins and unmaps; on an abort it waits for the copies, unpins, unmaps and unlinks)."""

    def __init__(self, n: int, steps: int, height: int, width: int, device: torch.device, segments=None):
        cuda = device.type == "cuda"
        shape = (n, steps + 1, 3, height, width)
        self.segments = segments      # its `waiting_bytes`: every rollout's states on the device, one budget
        self.shared = segments.make(shape, device) if segments is not None else None
        self.buf: Optional[torch.Tensor] = None if self.shared is not None else \
            torch.empty(shape, dtype=torch.float32, pin_memory=cuda)
        self.waiting: list[tuple[int, torch.Tensor]] = []      # states made before their segment: (k, f32 copy)
        self.lost: Optional[APIError] = None                  # the segment could not be made
        self.stream = _copy_stream(device) if cuda else None
        self.done = torch.cuda.Event() if cuda else None
        self.waits = 0

    def put(self, k: int, x: torch.Tensor) -> None:
        """State k, x [n, 3, H, W] on the device (made by the current stream)."""
        if self.buf is None and self.lost is None:
            # past the engine's budget (one state always waits where none does): wait for this rollout's segment
            held = self.segments.waiting_bytes
            self._arrive(block=held > 0 and held + 4 * x.numel() > WAITING_BYTES)
        if self.buf is not None:
            self._write(k, x if self.stream is None else _own(x))
        elif self.lost is None:
            state = _own(x)
            self.waiting.append((k, state))
            self.segments.waiting_bytes += state.nbytes

    def _arrive(self, block: bool) -> None:
        """Once the segment is made (now, or waiting for it when `block`): the states that waited go to it."""
        if not (block or self.shared.made.done()):
            return
        try:
            self.buf = self.shared.wait()
        except APIError as err:
            self.lost = err
        waiting = self._drop_waiting()
        if self.buf is not None:
            for k, x in waiting:
                self._write(k, x)

    def _drop_waiting(self) -> list[tuple[int, torch.Tensor]]:
        waiting, self.waiting = self.waiting, []
        self.segments.waiting_bytes -= sum(x.nbytes for _, x in waiting)
        return waiting

    def _write(self, k: int, x: torch.Tensor) -> None:
        if self.stream is None:
            self.buf[:, k].copy_(x)
            return
        self.stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.stream):
            for i in range(x.shape[0]):
                self.buf[i, k].copy_(x[i], non_blocking=True)
            self.done.record(self.stream)
        x.record_stream(self.stream)

    def _landed(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.waits += 1

    def take(self) -> Union[np.ndarray, TrajectorySegment]:
        """Once the copies landed: the array, or the segment's reference (the HTTP process owns it from here).
        Raises the segment's APIError when it could not be made."""
        if self.shared is None:
            self._landed()
            return self.buf.numpy()
        if self.buf is None and self.lost is None:
            self._arrive(block=True)
        if self.lost is not None:
            raise self.lost
        self._landed()
        shared, self.shared, self.buf = self.shared, None, None
        return shared.hand_over()

    def discard(self) -> None:
        """The job ended without its result (aborted, failed): the segment is unlinked once no copy writes into it."""
        if self.shared is not None:
            self._drop_waiting()
            shared, self.shared, self.buf = self.shared, None, None
            shared.discard(self.done)


def _own(x: torch.Tensor) -> torch.Tensor:
    """A f32 copy of its own (one cast in bf16): the copy stream, or a later write, then reads memory no later step
    writes."""
    return x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


class _Sde:
    def __init__(self, job, sde, num_steps: int):
        self.kind, self.a = sde.kind, float(sde.noise_level)
        self.steps = flow_sde.sde_step_indices(num_steps, sde.window_tuple(), sde.steps)
        self.t1 = job.flow.grid[1] if num_steps >= 1 else job.flow.grid[0]

    def mean_std(self, job, z, v):
        return flow_sde.sde_mean_std(self.kind, z, v, job.flow.t, job.flow.t_next, self.t1, self.a, job.noise_scale,
                                     job.spec.t_eps)

    def result(self, job, logprobs: list, trajectory: Union[np.ndarray, TrajectorySegment, None] = None) -> RlResult:
        segment = trajectory if isinstance(trajectory, TrajectorySegment) else None
        return RlResult(request_id=job.request_id, logprobs=_nulls(logprobs),
                        timesteps=[float(t) for t in job.flow.grid.float().cpu().tolist()], sde_steps=self.steps,
                        noise_scale=float(job.noise_scale), weights_version=self.version,
                        pixels=None if segment is not None else trajectory, segment=segment)

    def free(self) -> None:
        """The job is over (JobState.free)."""


class RolloutState(_Sde):
    """One rollout job: per-sample generators (initial noise, then one N(0, I) draw per SDE step), log-probs
    [n, N] (NaN on ODE steps), the trajectory z_0..z_N when asked."""

    def __init__(self, job, spec: RolloutJobRequest, version: str, record: bool, segments=None):
        super().__init__(job, spec.rl.sde, spec.num_inference_steps)
        rl = spec.rl
        self.version = version
        self.wants_images = rl.return_images
        self.gens = [torch.Generator(device=job.device).manual_seed(int(s)) for s in rl.seeds]
        draws = [torch.randn((1, 3, spec.height, spec.width), device=job.device, dtype=job.dtype, generator=g)
                 for g in self.gens]
        x = torch.cat([draws[0]] * job.n if rl.same_initial_noise else draws)
        job.x = job.noise_scale * x
        self.logprobs = torch.full((job.n, spec.num_inference_steps), float("nan"), dtype=torch.float32,
                                   device=job.device)
        self.trajectory: Optional[HostTrajectory] = None
        if record:
            self.trajectory = HostTrajectory(job.n, spec.num_inference_steps, spec.height, spec.width, job.device,
                                             segments)
            self.trajectory.put(0, job.x)
        self._sde = set(self.steps)

    def transition(self, job, z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = job.flow.index
        if k in self._sde:
            mean, std = self.mean_std(job, z, v)
            xi = flow_sde.draw_noise((job.n, 3, job.spec.height, job.spec.width), job.device, self.gens)
            z_next = (mean + std * sampler.patchify(xi)).to(z.dtype)
            self.logprobs[:, k] = flow_sde.transition_logprob(self.kind, z_next, mean, std)
        else:
            z_next = sampler.euler(z, v, job.flow.t, job.flow.t_next)
        if self.trajectory is not None:
            self.trajectory.put(k + 1, sampler.unpatchify(z_next, job.th, job.tw))
        return z_next

    def results(self, job) -> Union[RlResult, JobFailed]:
        """The job's result (log-probs, grid, version) with the trajectory as its raw frame (the host's one wait for
        the trajectory's copies; the log-probs are read after the step, the engine stream's work, is done). A
        trajectory whose segment could not be made fails this job alone (its APIError, as a JobFailed the HTTP
        process routes in place of the result; what follows for the job is then dropped there)."""
        logprobs = self.logprobs.cpu().tolist()
        frame = None
        if self.trajectory is not None:
            trajectory, self.trajectory = self.trajectory, None
            try:
                frame = trajectory.take()
            except APIError as err:
                return JobFailed(job.request_id, err.event())
        return self.result(job, logprobs, frame)

    def free(self) -> None:
        if self.trajectory is not None:          # no result went: the trajectory is nobody's
            self.trajectory.discard()
            self.trajectory = None


class ScoreState(_Sde):
    """One score job: starts at the first SDE step of the stored trajectory and visits only SDE steps."""

    def __init__(self, job, spec: ScoreJobRequest, latents: np.ndarray, version: str):
        super().__init__(job, spec.sde, spec.num_inference_steps)
        self.version = version
        self.wants_images = False
        self.latents = torch.from_numpy(np.ascontiguousarray(latents)).to(job.device)
        self.logprobs = torch.full((job.n, spec.num_inference_steps), float("nan"), dtype=torch.float32,
                                   device=job.device)
        self._next = list(self.steps)
        first = self._next.pop(0) if self._next else spec.num_inference_steps - 1
        job.flow.index = first
        job.x = self.latents[:, first].to(job.dtype)

    def transition(self, job, z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = job.flow.index
        if k in self.steps:
            mean, std = self.mean_std(job, z, v)
            z_next = sampler.patchify(self.latents[:, k + 1].to(z.dtype))
            self.logprobs[:, k] = flow_sde.transition_logprob(self.kind, z_next, mean, std)
        if not self._next:
            job.flow.index = job.num_inference_steps - 1  # the engine's advance() ends the job
            return z
        k2 = self._next.pop(0)
        job.flow.index = k2 - 1
        return sampler.patchify(self.latents[:, k2].to(z.dtype))

    def results(self, job) -> RlResult:
        return self.result(job, self.logprobs.cpu().tolist())


def _nulls(rows: list[list[float]]) -> list[list[Optional[float]]]:
    return [[None if math.isnan(x) else x for x in row] for row in rows]


def attach(job, spec, engine) -> None:
    """Give a rollout / score job its RL state (an image job keeps `job.rl = None`)."""
    if isinstance(spec, RolloutJobRequest):
        segments = getattr(engine, "trajectory_segments", None)      # rank 0 of a served engine
        record = spec.rl.trajectory_id is not None and engine.comm.rank == 0
        job.rl = RolloutState(job, spec, weights_version(engine), record, segments)
    elif isinstance(spec, ScoreJobRequest):
        job.rl = ScoreState(job, spec, spec.latents(), weights_version(engine))
