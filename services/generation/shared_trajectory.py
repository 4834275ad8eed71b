"""A rollout's trajectory in POSIX shared memory, from the engine's device -> host copies to the HTTP process's
trajectory store, with no byte crossing the pipe (docs/rl.md, "The trajectory's path").

Rank 0 makes one segment per rollout job that records a trajectory, /dev/shm/<kv pool name>-rl-<pid>-<n>-<token>
(`segment_prefix`), with shm_transfer's Segment (owner record, creator lock, every page reserved up front: a full
/dev/shm fails that one rollout with a 503 instead of a SIGBUS later), pinned on CUDA (shm_transfer.pinning), on a
side thread, never on the engine loop (TrajectorySegments); the copies of the states write straight into it
(rollout.HostTrajectory). The result's message carries only the segment's name, shape and dtype
(protocol.TrajectorySegment); the HTTP process maps it, takes the holder lock and the store keeps the mapping as
the trajectory's latents.

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from services.kit.errors import APIError
from shm_transfer import locks, pinning
from shm_transfer.errors import PoolError
from shm_transfer.segment import SHM_DIR, Segment, shm_free_bytes, unlink_exact

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
    reader thread); `close` at the engine's exit unlinks those never handed over.

    The engine loop only names a segment and checks that /dev/shm has room for it; the work whose cost grows with the
    trajectory runs on one side thread, in the order it was asked for: make (posix_fallocate of every page, mmap),
    pin (cudaHostRegister faults in and page-locks the whole array: milliseconds per 100 MB), and after the result
    or an abort unpin, unmap, unlink and close. Until a segment is made its rollout's states wait on the device
    (rollout.HostTrajectory), all rollouts' together at most rollout.WAITING_BYTES (`waiting_bytes`)."""

    def __init__(self, kv_pool_name: str, owner: str = ""):
        self.prefix = segment_prefix(kv_pool_name)
        self.owner = owner                    # the stack id recorded in each segment (shm_transfer.segment)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._live: set[SharedBuffer] = set()         # asked for, result not handed over (the engine thread's)
        self._handed: dict[str, Segment] = {}         # name -> segment whose fd keeps the creator lock
        self._unmade = 0                              # bytes asked of the side thread, not yet reserved
        self.waiting_bytes = 0    # states of its rollouts on the device until their segment is made (rollout.py)
        self._side = ThreadPoolExecutor(1, thread_name_prefix="u1-gen-trajectory")

    def make(self, shape: tuple[int, ...], device: Optional[torch.device] = None) -> "SharedBuffer":
        """A segment for a float32 array of `shape`, made on the side thread (pinned for `device` when it is a CUDA
        one); `SharedBuffer.wait` gives its array. 503 `trajectory_shm_full` here when /dev/shm has no room for
        it beside the segments asked for before (the side thread's own reservation failing later is the same 503,
        from `wait`)."""
        buf = SharedBuffer(self, f"{self.prefix}{os.getpid()}-{next(self._seq)}-{secrets.token_hex(4)}",
                           tuple(shape), device)
        with self._lock:
            free = shm_free_bytes()
            if free is not None and buf.size > free - self._unmade:
                raise _shm_full(buf.size - DATA_OFF, f"{(free - self._unmade) / MiB:.0f} MiB free beside the "
                                "trajectories being made")
            self._unmade += buf.size
        try:
            buf.made = self._side.submit(buf._make)
        except BaseException:
            self._reserved(buf.size)
            raise
        self._live.add(buf)
        return buf

    def _reserved(self, size: int) -> None:
        with self._lock:
            self._unmade -= size

    def _later(self, fn, *args) -> None:
        """`fn(*args)` on the side thread after what was asked before; here once the side thread has stopped."""
        try:
            self._side.submit(_logged, fn, *args)
        except RuntimeError:              # shut down (the engine left): nothing else runs on it any more
            _logged(fn, *args)

    def settle(self) -> None:
        """Wait until the side thread has done everything asked of it so far (tests, benchmarks)."""
        self._side.submit(lambda: None).result()

    def _handed_over(self, buf: "SharedBuffer") -> TrajectorySegment:
        self._live.discard(buf)
        with self._lock:
            self._handed[buf.seg.name] = buf.seg
        return TrajectorySegment(buf.seg.name, buf.shape, "<f4", DATA_OFF)

    def held(self, name: str) -> None:
        """The HTTP process holds the segment now (or has dropped it): let the creator lock go (on the side thread,
        after the unmap that hand_over asked for)."""
        with self._lock:
            seg = self._handed.pop(name, None)
        if seg is not None:
            self._later(seg.close)

    def close(self) -> None:
        """The engine is leaving: finish the side thread's work, unlink what was never handed over (after the
        copies into it landed); close the rest (the HTTP process owns them: its store, or its reclaim once nobody
        holds them)."""
        self._side.shutdown(wait=True)
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


def _logged(fn, *args) -> None:
    """A release nobody waits for: its failure is logged, not lost in a Future."""
    try:
        fn(*args)
    except Exception:
        log.exception("releasing a trajectory segment failed (%s)", getattr(fn, "__qualname__", fn))


def _shm_full(nbytes: int, why: object) -> APIError:
    return APIError(503, f"this rollout's trajectory ({nbytes / MiB:.0f} MiB) does not fit in {SHM_DIR} ({why}); "
                    f"retry once stored trajectories are fetched and deleted, or give {SHM_DIR} more room (Docker: "
                    "shm_size; docs/deployment.md)", code="trajectory_shm_full")


class SharedBuffer:
    """One rollout's trajectory array in a segment rank 0 makes on its side thread: `made` (a Future) is done once
    `tensor` views it (registered with CUDA when pinned, so the copy stream's copies into it are asynchronous DMA).
    The engine loop calls `wait`, then `hand_over` or `discard`; `seg` and `tensor` are the side thread's until
    `made` is done."""

    def __init__(self, owner: TrajectorySegments, name: str, shape: tuple[int, ...], device: Optional[torch.device]):
        self._owner, self.name, self.shape = owner, name, shape
        self.size = DATA_OFF + 4 * math.prod(shape)
        self.device = None                         # the CUDA device to pin it for (its side thread's current one)
        if device is not None and device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.seg: Optional[Segment] = None
        self.tensor: Optional[torch.Tensor] = None
        self.pinned = False
        self.made: Optional[Future] = None

    # the side thread
    def _make(self) -> None:
        try:
            seg = Segment.create(self.name, self.size, self._owner.owner, what="RL trajectory", reserve=True)
        except (PoolError, OSError) as exc:
            raise _shm_full(self.size - DATA_OFF, exc) from None
        finally:
            self._owner._reserved(self.size)
        try:
            tensor = torch.frombuffer(seg.mm, dtype=torch.float32, count=math.prod(self.shape),
                                      offset=DATA_OFF).view(self.shape)
            if self.device is not None:
                torch.cuda.set_device(self.device)    # this thread's CUDA calls: the rank's context, no other
                self.pinned = pinning.register(tensor)
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        self.seg, self.tensor = seg, tensor

    def _unmap(self, landed: Optional[torch.cuda.Event] = None) -> None:
        """Once no copy into it is pending: this process lets its view go (the fd and its lock stay)."""
        if self.device is not None:
            torch.cuda.set_device(self.device)
        if landed is not None:
            landed.synchronize()
        if self.pinned:
            pinning.unregister(self.tensor)
            self.pinned = False
        self.tensor = None
        self.seg.unmap()

    def _unlink(self, landed: Optional[torch.cuda.Event]) -> None:
        try:
            self._unmap(landed)
        finally:                                   # the name and the lock go even if the device failed
            self.seg.unlink()
            self.seg.close()

    # the engine loop
    def wait(self) -> torch.Tensor:
        """The array once the side thread has made it. Raises the APIError that failed it (503
        `trajectory_shm_full`; 500 `engine_error` for anything else: it is logged)."""
        try:
            self.made.result()
        except APIError:
            self._owner._live.discard(self)
            raise
        except Exception as exc:
            self._owner._live.discard(self)
            log.error("making the trajectory segment %s failed", self.name, exc_info=exc)
            raise APIError(500, f"the rollout's trajectory could not be recorded ({exc!r})",
                           code="engine_error") from None
        return self.tensor

    def hand_over(self) -> TrajectorySegment:
        """The copies have landed, this process holds no view of `tensor` any more, and the result is about to be
        queued: the message's reference. From here the HTTP process unlinks the segment; this one unpins and
        unmaps it on the side thread."""
        self.wait()
        self._owner._later(self._unmap)
        return self._owner._handed_over(self)

    def discard(self, landed: Optional[torch.cuda.Event] = None) -> None:
        """The result never went (job aborted or failed, engine stopping): unlink it on the side thread once the
        copies into it have landed (`landed`, the last copy's event)."""
        if self not in self._owner._live:         # handed over, discarded, or never made
            return
        self._owner._live.discard(self)
        if self.made.cancel():                    # the side thread had not started it: nothing to undo
            self._owner._reserved(self.size)
            return
        self._owner._later(self._discard, landed)

    def _discard(self, landed: Optional[torch.cuda.Event]) -> None:
        try:
            self.made.result()
        except Exception:
            return                                 # never made: nothing to unlink
        self._unlink(landed)


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
