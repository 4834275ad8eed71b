"""A rollout's trajectory in POSIX shared memory, from the engine's device -> host copies to the HTTP process's
trajectory store, with no byte crossing the pipe (docs/rl.md, "The trajectory's path").

Rank 0 makes one segment per rollout job that records a trajectory, /dev/shm/<kv pool name>-rl-<pid>-<n>-<token>
(`segment_prefix`), with shm_transfer's Segment (owner record, creator lock, every page reserved up front: a full
/dev/shm fails that one rollout with a 503 instead of a SIGBUS later), pinned on CUDA (shm_transfer.pinning); the
copies of the states write straight into it (rollout.HostTrajectory). The result's message carries only the
segment's name, shape and dtype (protocol.TrajectorySegment); the HTTP process maps it, takes the holder lock and
the store keeps the mapping as the trajectory's latents.

Exactly one side unlinks each segment (the naming and liveness rule: trajectory_names.py):
- the engine, while the result has not been handed over (a job aborted, failed or stopped before its result);
- the HTTP process from the moment the result is queued on the link: the store once the trajectory has left it
  and its last stream ended, the stream when the result is refused or dropped, the server at shutdown.
A live process holds a lock on every segment at every moment: the engine its creator lock until the HTTP process
says it holds the segment (or dropped it: protocol.TrajectoryHeld), then the HTTP process its holder lock for as
long as it maps it. So a segment no live process holds was left by a dead one (SIGKILL): `reclaim` unlinks those
(at a server's start, after an engine restart, at shutdown); a live server's segments are never touched, whoever
shares the prefix.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from services.kit.errors import APIError
from shm_transfer import locks, pinning
from shm_transfer.errors import PoolError
from shm_transfer.segment import SHM_DIR, Segment, unlink_exact

from .protocol import JobFailed, RlResult, TrajectorySegment
from .trajectory_names import HOLDER_SLOT, SLOTS, reclaim, segment_prefix

__all__ = ["MappedTrajectory", "SharedBuffer", "TrajectorySegments", "SLOTS", "adopt", "reclaim", "release",
           "segment_prefix"]

log = logging.getLogger("u1serve.generation.trajectory")

DATA_OFF = 4096            # the array starts after the header words and owner record (page-aligned: pinned as is)
MiB = 1 << 20


# -- engine side (rank 0) -----------------------------------------------------------------------------------
class TrajectorySegments:
    """Rank 0's trajectory segments: `make` one per recording rollout; its buffer's `hand_over` when the result is
    queued, after which the creator lock is kept only until the HTTP process's TrajectoryHeld (`held`, the command
    reader thread); `close` at the engine's exit unlinks those never handed over."""

    def __init__(self, kv_pool_name: str, owner: str = ""):
        self.prefix = segment_prefix(kv_pool_name)
        self.owner = owner                    # the stack id recorded in each segment (shm_transfer.segment)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._live: set[SharedBuffer] = set()         # made, result not handed over (the engine thread's)
        self._handed: dict[str, Segment] = {}         # name -> segment whose fd keeps the creator lock

    def make(self, shape: tuple[int, ...], pin: bool) -> "SharedBuffer":
        """A new segment for a float32 array of `shape`. 503 `trajectory_shm_full` when /dev/shm cannot hold it."""
        nbytes = 4 * math.prod(shape)
        name = f"{self.prefix}{os.getpid()}-{next(self._seq)}-{secrets.token_hex(4)}"
        try:
            seg = Segment.create(name, DATA_OFF + nbytes, self.owner, what="RL trajectory", reserve=True)
        except (PoolError, OSError) as exc:
            raise APIError(503, f"this rollout's trajectory ({nbytes / MiB:.0f} MiB) does not fit in {SHM_DIR} "
                           f"({exc}); retry once stored trajectories are fetched and deleted, or give {SHM_DIR} more "
                           "room (Docker: shm_size; docs/deployment.md)", code="trajectory_shm_full") from None
        try:
            buf = SharedBuffer(self, seg, tuple(shape), pin)
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        self._live.add(buf)
        return buf

    def _handed_over(self, buf: "SharedBuffer") -> TrajectorySegment:
        self._live.discard(buf)
        with self._lock:
            self._handed[buf.seg.name] = buf.seg
        return TrajectorySegment(buf.seg.name, buf.shape, "<f4", DATA_OFF)

    def held(self, name: str) -> None:
        """The HTTP process holds the segment now (or has dropped it): let the creator lock go."""
        with self._lock:
            seg = self._handed.pop(name, None)
        if seg is not None:
            seg.close()

    def close(self) -> None:
        """The engine is leaving: unlink what it never handed over (after the copies into it landed); close the rest
        (the HTTP process owns them: its store, or its reclaim once nobody holds them)."""
        if self._live and torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
            except Exception:       # a device fault ends the engine: the process exit unmaps everything anyway
                log.exception("waiting for the trajectory copies before unlinking them failed")
        for buf in list(self._live):
            buf.discard()
        with self._lock:
            handed, self._handed = list(self._handed.values()), {}
        for seg in handed:
            seg.close()


class SharedBuffer:
    """One rollout's trajectory array in a segment rank 0 made: `tensor` views it (registered with CUDA when
    pinned, so the copy stream's copies into it are asynchronous DMA)."""

    def __init__(self, owner: TrajectorySegments, seg: Segment, shape: tuple[int, ...], pin: bool):
        self._owner, self.seg, self.shape = owner, seg, shape
        self.tensor: Optional[torch.Tensor] = torch.frombuffer(
            seg.mm, dtype=torch.float32, count=math.prod(shape), offset=DATA_OFF).view(shape)
        self.pinned = bool(pin) and pinning.register(self.tensor)

    def _unmap(self) -> None:
        """Once no copy into it is pending: this process lets its view go (the fd and its lock stay)."""
        if self.pinned:
            pinning.unregister(self.tensor)
            self.pinned = False
        self.tensor = None
        self.seg.unmap()

    def hand_over(self) -> TrajectorySegment:
        """The copies have landed and the result is about to be queued: the message's reference. From here the
        HTTP process unlinks the segment."""
        self._unmap()
        return self._owner._handed_over(self)

    def discard(self) -> None:
        """The result never went (job aborted or failed, engine stopping; copies landed): unlink it here."""
        self._unmap()
        self.seg.unlink()
        self.seg.close()
        self._owner._live.discard(self)


# -- HTTP process side --------------------------------------------------------------------------------------
class MappedTrajectory:
    """The HTTP process's hold on a trajectory segment: `array` views it (read-only) under the holder lock until
    `release()` unlinks it (a dropped hold is released when collected, so no path leaves it behind)."""

    def __init__(self, ref: TrajectorySegment):
        seg = Segment.attach(ref.name)
        try:
            locks.try_hold(seg.fd, HOLDER_SLOT)
            arr = np.frombuffer(seg.mm, dtype=np.dtype(ref.dtype), count=math.prod(ref.shape), offset=ref.offset)
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        self.name = ref.name
        self.array = arr.reshape(ref.shape)
        self.array.flags.writeable = False
        self._release = weakref.finalize(self, _unlink, seg)

    def release(self) -> None:
        """Unlink and unmap (the mapping itself goes once no view of `array` is left). Idempotent."""
        self._release()


def _unlink(seg: Segment) -> None:
    seg.unlink()
    seg.close()


def adopt(msg: RlResult, wanted: bool):
    """The HTTP process's side of a result whose trajectory lies in a segment (the link reader thread): mapped into
    the message (`pixels` its array, `mapping` the hold) when its job still wants it, else unlinked (None). A segment
    that cannot be mapped fails the job (503 `trajectory_lost`, a JobFailed to route instead)."""
    ref = msg.segment
    if not wanted:
        unlink_exact(ref.name)
        return None
    try:
        mapped = MappedTrajectory(ref)
    except (PoolError, OSError, ValueError) as exc:
        unlink_exact(ref.name)
        log.error("request %s: its trajectory segment %s could not be mapped: %s", msg.request_id, ref.name, exc)
        return JobFailed(msg.request_id, APIError(503, f"the rollout's trajectory was lost on its way from the engine "
                                                  f"({exc}); retry the request", code="trajectory_lost").event())
    msg.pixels, msg.mapping = mapped.array, mapped
    return msg


def release(ev) -> None:
    """An event nobody will store (a stream ended, a result refused): free the trajectory segment it holds."""
    mapping = getattr(ev, "mapping", None)
    if mapping is not None:
        mapping.release()
