"""Messages between the generation HTTP process (supervisor.py) and engine rank 0 (worker.py), pickled over the
link (link.py). Commands go down, events come back; both sides dispatch with isinstance / match.

A message with a `pixels` field (an image, a preview, an RL trajectory) crosses with the array as a raw byte frame
right after it (link.py), never pickled. A served rollout's trajectory does not cross at all: it lies in a shared-memory
segment the message names (TrajectorySegment; shared_trajectory.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from services.contract.image import GenerateRequest


# -- commands: HTTP process -> rank 0 ------------------------------------------------------------------------
@dataclass
class SubmitJob:
    job: GenerateRequest                  # or an RL rollout / score job (services.contract.rl)


@dataclass
class AbortJob:
    """The HTTP process already ended the job's stream: stop the work, free what it holds."""
    request_id: str


@dataclass
class WeightsOp:
    op: dict                              # a services.kit.weights_api op: stage / commit / abort / lora_*


@dataclass
class Stop:
    pass


@dataclass
class TrajectoryHeld:
    """The HTTP process holds (or has dropped) the trajectory segment of a result: rank 0 lets its lock go."""
    name: str


Command = Union[SubmitJob, AbortJob, WeightsOp, Stop, TrajectoryHeld]


# -- engine events: rank 0 -> HTTP process --------------------------------------------------------------------
@dataclass
class Starting:
    """Where the ranks are on their way to Ready (services.contract.health.EnginePhase), for /health."""
    phase: str


@dataclass
class Ready:
    capacity: dict                        # capacity.measure(): the reference job's KV bytes, free memory


@dataclass
class Fatal:
    message: str                          # the rank logged it with its traceback; the supervisor reports it


@dataclass
class WarmupStats:
    sizes: list[str]
    steps: int
    seconds: float
    per_size: dict = field(default_factory=dict)   # every warmed size (the size table's too): seconds


@dataclass
class KvPoolStats:
    """The shm KV pool as rank 0 has it (kv_source.PrefixSource.report, /health "kv_pool"): sent before Ready,
    then whenever a job opens it or a producer restart drops it."""
    report: dict


@dataclass
class KvImportStats:
    bytes: int
    seconds: float


@dataclass
class StepStats:
    seconds: float
    tokens: int                           # image-token rows in the forward
    jobs: int
    running: int
    queued: int
    peak_memory: Optional[int]
    graph: Optional[str]                  # step_graph: eager | capture | replay
    forwards: int = 1                     # layer-stack forwards the step ran (reference.py: image jobs, RL jobs)


@dataclass
class IdleStats:
    queued: int
    running: int = 0


@dataclass
class BranchSteps:
    """A finished job's computed / reused steps per CFG branch (step caching)."""
    branch_steps: dict[str, dict]


@dataclass
class WeightsReply:
    reply: dict                           # rank 0's answer to a WeightsOp (services.kit.weights_api)


Stats = Union[WarmupStats, KvPoolStats, KvImportStats, StepStats, IdleStats, BranchSteps]


# -- per-job events ------------------------------------------------------------------------------------------
@dataclass
class JobStarted:
    request_id: str
    weights_version: str


@dataclass
class Progress:
    request_id: str
    step: int
    total: int


@dataclass
class Preview:
    request_id: str
    index: int
    partial_image_index: int
    step: int
    pixels: Optional[np.ndarray] = None   # uint8 [h, w, 3]


@dataclass
class Image:
    request_id: str
    index: int
    branch_steps: dict
    image_handle: Optional[dict]          # the float image exported into the pool (interleave), or None
    weights_version: str
    pixels: Optional[np.ndarray] = None   # uint8 [H, W, 3]
    applied: Optional[dict] = None        # JobState.applied(): the speed options the steps ran with


@dataclass
class TrajectorySegment:
    """Where a rollout's trajectory lies: /dev/shm/<name>, an array of `shape` and `dtype` from byte `offset`."""
    name: str
    shape: tuple
    dtype: str
    offset: int


@dataclass
class RlResult:
    request_id: str
    logprobs: list[list[Optional[float]]]
    timesteps: list[float]
    sde_steps: list[int]
    noise_scale: float
    weights_version: str
    pixels: Optional[np.ndarray] = None   # a rollout's trajectory z_0..z_N (float32), when one is stored
    segment: Optional[TrajectorySegment] = None   # rank 0's segment holding it (the message carries no bytes)
    mapping: Any = None                   # the HTTP process's hold on that segment (shared_trajectory.adopt)

    def result(self) -> dict[str, Any]:
        """What the `rl_result` event carries (everything but the trajectory)."""
        return {"logprobs": self.logprobs, "timesteps": self.timesteps, "sde_steps": self.sde_steps,
                "noise_scale": self.noise_scale, "weights_version": self.weights_version}


@dataclass
class JobDone:
    request_id: str


@dataclass
class JobFailed:
    request_id: str
    error: dict = field(default_factory=dict)   # APIError.event(): {"type": "error", "status", "error": {...}}


JobEvent = Union[JobStarted, Progress, Preview, Image, RlResult, JobDone, JobFailed]
Event = Union[Ready, Fatal, WeightsReply, WarmupStats, KvPoolStats, KvImportStats, StepStats, IdleStats, BranchSteps,
              JobEvent]


# -- the step plan: rank 0 -> every rank (broadcast over the CPU control group, cfg_parallel.py) ----------------
@dataclass
class StepPlan:
    """What every rank does this iteration, in this order: abort, admit, the weights op; then one step (unless
    `stop`)."""
    admit: list = field(default_factory=list)          # job specs, FIFO
    abort: list[str] = field(default_factory=list)     # request ids of running jobs
    weights: Optional[dict] = None                     # a WeightsOp's op, when one runs now
    stop: bool = False
