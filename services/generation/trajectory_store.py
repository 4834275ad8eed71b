"""Rollout trajectories kept in the generation HTTP process for the trainer to fetch or score (docs/rl.md).

A trajectory is one rollout's samples, filled in parts (one part per generation job: a group over one prefix,
or one sample with its own think prefix), each keyed by its first sample's index. Bounded by bytes: the least
recently used trajectory is evicted first (an evicted id is 404 `trajectory_not_found`). Each trajectory belongs
to an owner (the gateway's hash of the tenant's key, contract.rl.OWNER_HEADER; "open" without keys): any other
owner gets the same 404 as for an id never stored. An owner holds at most `owner_max_bytes` (its own least
recently used trajectories make room first), and when the whole store is full the owner holding the most
bytes gives up its least recently used one: a tenant within its fair share is never evicted by another.
The wire format is safetensors: `latents` f32 [S, N+1, 3, H, W], `timesteps` f32 [N+1], `logprobs` f32 [S, N] (NaN on ODE steps),
`sde_mask` u8 [N]; the metadata holds the rollout parameters and the weights version as JSON. `blob()` serves
those bytes as views of the stored arrays (streamed by range, never joined: a trajectory is GBs); `reader()` is one
GET's hold on them. A trajectory deleted or evicted while it is streamed leaves the store at once (404 for any new
request), but its arrays live until the last open stream of it ends; `stats()` counts those bytes as
`draining_bytes` (outside the store's bound) until then.
A rollout's latents are the mapping of the shared-memory segment the engine recorded them in (shared_trajectory.py;
the bound counts those bytes as any others: shm is RAM too). The store owns each part it was given: it releases
(unlinks) the segment when the part is refused, replaced, or leaves the store with no stream reading it (else when
the last such stream ends), and at `close()`.
"""
from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from services.contract.rl import OPEN_OWNER
from services.kit.errors import APIError, bad_request


def not_found(tid: str) -> APIError:
    return APIError(404, f"trajectory {tid!r} not found (never stored, deleted, or evicted: the store is bounded "
                    "by --rl-trajectory-store-mb)", param="trajectory_id", code="trajectory_not_found")


CHUNK_BYTES = 4 << 20          # one streamed piece: large enough that per-chunk overheads vanish, small next to RAM


@dataclass(frozen=True)
class Blob:
    """A safetensors file as a list of buffers (its header, then each tensor's bytes, possibly in several arrays)
    served by byte range without ever joining them. The layout is safetensors' own: tensors ordered by dtype
    (wider first) then name, the header JSON padded with spaces to 8 bytes so every f32 tensor is aligned."""
    pieces: tuple[memoryview, ...]
    size: int

    @classmethod
    def of(cls, tensors: list[tuple[str, str, Optional[list[int]], list[np.ndarray]]], metadata: dict) -> "Blob":
        """`tensors`: (name, safetensors dtype, shape (None: the one array's), arrays whose bytes in order form
        the tensor), already in safetensors order."""
        header: dict = {"__metadata__": metadata}
        pieces, offset = [], 0
        for name, dtype, shape, arrays in tensors:
            views = [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]
            n = sum(v.nbytes for v in views)
            header[name] = {"dtype": dtype, "shape": list(arrays[0].shape) if shape is None else shape,
                            "data_offsets": [offset, offset + n]}
            pieces += views
            offset += n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        first = memoryview(len(head).to_bytes(8, "little") + head)
        return cls((first, *pieces), first.nbytes + offset)

    def chunks(self, start: int = 0, end: Optional[int] = None, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """Bytes [start, end) as views of at most `size` bytes."""
        end = self.size if end is None else end
        pos = 0
        for piece in self.pieces:
            lo, hi = max(start - pos, 0), min(end - pos, piece.nbytes)
            for a in range(lo, hi, size):
                yield piece[a:min(a + size, hi)]
            pos += piece.nbytes
            if pos >= end:
                return

    def tobytes(self) -> bytes:
        return b"".join(self.chunks())


@dataclass
class Part:
    latents: np.ndarray                # f32 [n, N+1, 3, H, W]
    logprobs: np.ndarray               # f32 [n, N], NaN on ODE steps
    meta: dict                         # timesteps, sde_steps, noise_scale, weights_version, params
    shared: Optional[object] = None    # the hold on the segment `latents` maps (shared_trajectory.MappedTrajectory)

    @property
    def nbytes(self) -> int:
        return self.latents.nbytes + self.logprobs.nbytes

    def release(self) -> None:
        if self.shared is not None:
            self.shared.release()


@dataclass(eq=False)                  # identity: a set of them (the store's `_leaving`)
class Trajectory:
    parts: dict[int, Part] = field(default_factory=dict)     # first sample index -> part
    owner: str = OPEN_OWNER            # who made it (only they read, score or delete it)
    readers: int = 0                   # open streams of it (Reader)
    draining: int = 0                  # its bytes, once it left the store while readers held it
    retired: list[Part] = field(default_factory=list)   # parts replaced while readers held it

    def release(self, retired_only: bool = False) -> None:
        """Free its parts' segments (once no stream reads them)."""
        parts, self.retired = self.retired, []
        for p in parts + ([] if retired_only else list(self.parts.values())):
            p.release()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    def samples(self, start: int, count: int) -> np.ndarray:
        """latents [count, N+1, 3, H, W] of samples [start, start + count) (KeyError if not held)."""
        out = []
        for first in sorted(self.parts):
            p = self.parts[first]
            n = p.latents.shape[0]
            lo, hi = max(start, first), min(start + count, first + n)
            if lo < hi:
                out.append(p.latents[lo - first:hi - first])
        got = sum(x.shape[0] for x in out)
        if got != count:
            raise KeyError(f"samples [{start}, {start + count}) not all held")
        return out[0] if len(out) == 1 else np.concatenate(out)


class Reader:
    """One GET's hold on a trajectory: `blob` (views of its arrays) until `close()`, which the stream's cleanup
    runs however it ends; the last reader of a deleted or evicted trajectory frees its draining bytes."""

    def __init__(self, store: "TrajectoryStore", traj: Trajectory, blob: "Blob"):
        self._store, self._traj, self.blob = store, traj, blob

    def chunks(self, start: int, end: int) -> Iterator[memoryview]:
        yield from self.blob.chunks(start, end)

    def close(self) -> None:
        if self._traj is not None:
            self._store._release(self._traj)
            self._traj = self.blob = None          # the arrays go with the last reference (the store's is gone)


class TrajectoryStore:
    def __init__(self, max_bytes: int, owner_max_bytes: Optional[int] = None):
        self.max_bytes = int(max_bytes)
        self.owner_max_bytes = min(int(owner_max_bytes or max_bytes), self.max_bytes)
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[str, Trajectory] = collections.OrderedDict()
        self._bytes = 0
        self._owned: collections.Counter[str] = collections.Counter()   # owner -> bytes in the store
        self._draining = 0                   # bytes of trajectories gone from the store that streams still read
        self._streams = 0                    # open Readers
        self._leaving: set[Trajectory] = set()   # left the store, still streamed (their `draining` bytes)
        self._closed = False

    def close(self) -> None:
        """The server is stopping: every segment the store holds is released (open streams keep their mappings
        until they end; the names go now)."""
        with self._lock:
            self._closed = True
            trajs = list(self._items.values()) + list(self._leaving)
            self._items.clear()
            self._leaving.clear()
            self._owned.clear()
            self._bytes = 0
        for traj in trajs:
            traj.release()

    def check_fits(self, nbytes: int) -> None:
        """413 before any work when a part of `nbytes` could never be stored (the rollout's pre-check)."""
        limit = self.owner_max_bytes
        if nbytes > limit:
            raise APIError(413, f"this rollout's trajectory ({nbytes} bytes) exceeds what one tenant may keep in "
                           f"the store ({limit} bytes, --rl-trajectory-owner-mb / --rl-trajectory-store-mb): ask "
                           "for fewer samples, steps or pixels, or return_trajectory=false",
                           code="trajectory_too_large")

    def put(self, tid: str, first_sample: int, part: Part, owner: str = OPEN_OWNER) -> None:
        """Add a part; evicts least recently used trajectories (never the one being filled; the owner's own
        first, then the biggest owner's) to stay in bounds. A part that cannot fit is refused (413). The store owns
        the part from here, refused or not."""
        try:
            self._put(tid, first_sample, part, owner)
        except BaseException:
            part.release()
            raise

    def _put(self, tid: str, first_sample: int, part: Part, owner: str) -> None:
        self.check_fits(part.nbytes)
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is stopping", code="service_unavailable")
            traj = self._items.pop(tid, None)
            if traj is not None and traj.owner != owner:
                self._items[tid] = traj
                raise not_found(tid)
            traj = traj or Trajectory(owner=owner)
            old = traj.parts.get(first_sample)
            if old is not None:
                self._take(traj, -old.nbytes)
                traj.retired.append(old)
                if not traj.readers:
                    traj.release(retired_only=True)
            traj.parts[first_sample] = part
            self._take(traj, part.nbytes)
            while self._owned[owner] > self.owner_max_bytes and self._evict_of(owner):
                pass
            while self._bytes > self.max_bytes and any(self._evict_of(o) for o, _ in self._owned.most_common()):
                pass                          # the biggest owner first (the next if it holds only `tid`)
            self._items[tid] = traj
            if self._bytes > self.max_bytes or self._owned[owner] > self.owner_max_bytes:
                traj.parts.pop(first_sample)         # only this trajectory left and still too big
                self._take(traj, -part.nbytes)
                if not traj.parts:
                    self._items.pop(tid)
                raise APIError(413, "this trajectory no longer fits the store (--rl-trajectory-store-mb, "
                               "--rl-trajectory-owner-mb)", code="trajectory_too_large")

    def _take(self, traj: Trajectory, nbytes: int) -> None:
        self._bytes += nbytes
        self._owned[traj.owner] += nbytes
        if self._owned[traj.owner] <= 0:
            del self._owned[traj.owner]

    def _evict_of(self, owner: str) -> bool:
        """Evict the least recently used trajectory of `owner` other than the one being filled (it is out of
        `_items` meanwhile); False when there is none."""
        for tid, traj in self._items.items():
            if traj.owner == owner:
                del self._items[tid]
                self._left(traj)
                return True
        return False

    def get(self, tid: str, owner: str = OPEN_OWNER) -> Trajectory:
        with self._lock:
            return self._touch(tid, owner)

    def _touch(self, tid: str, owner: str) -> Trajectory:
        """The trajectory, now the most recently used (lock held; 404 when it is not stored or not `owner`'s)."""
        traj = self._items.get(tid)
        if traj is None or traj.owner != owner:
            raise not_found(tid)
        self._items.move_to_end(tid)
        return traj

    def delete(self, tid: str, owner: str = OPEN_OWNER) -> bool:
        with self._lock:
            traj = self._items.get(tid)
            if traj is None or traj.owner != owner:
                return False
            del self._items[tid]
            self._left(traj)
            return True

    def _left(self, traj: Trajectory) -> None:
        """`traj` has just left the store (deleted or evicted; lock held): its bytes stay counted, as draining,
        while open streams still read it."""
        self._take(traj, -traj.nbytes)
        if traj.readers:
            traj.draining = traj.nbytes
            self._draining += traj.draining
            self._leaving.add(traj)
        else:
            traj.release()

    def reader(self, tid: str, owner: str = OPEN_OWNER) -> Reader:
        """A hold on the trajectory's bytes for one stream (404 when it is not stored or not `owner`'s); close it
        when done."""
        with self._lock:
            traj = self._touch(tid, owner)
            blob = _blob(tid, traj)
            traj.readers += 1
            self._streams += 1
        return Reader(self, traj, blob)

    def _release(self, traj: Trajectory) -> None:
        with self._lock:
            traj.readers -= 1
            self._streams -= 1
            if traj.readers:
                return
            if traj.draining:                    # it left the store: its last stream ended
                self._draining -= traj.draining
                traj.draining = 0
                self._leaving.discard(traj)
                traj.release()
            else:
                traj.release(retired_only=True)

    def stats(self) -> dict:
        with self._lock:
            return {"trajectories": len(self._items), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "owner_max_bytes": self.owner_max_bytes, "owners": len(self._owned), "streams": self._streams,
                    "draining_bytes": self._draining}

    # -- wire format -----------------------------------------------------------------------------------------
    def blob(self, tid: str, owner: str = OPEN_OWNER) -> "Blob":
        """The trajectory's safetensors bytes as views of the stored arrays (nothing of the latents is copied)."""
        return _blob(tid, self.get(tid, owner))

    def put_safetensors(self, tid: str, blob: bytes, owner: str = OPEN_OWNER) -> int:
        """Store an uploaded trajectory (the GET format) as one part; returns its sample count. 400 on a blob that
        is not one."""
        from safetensors.numpy import load
        try:
            t = load(blob)
        except Exception as exc:
            raise bad_request(f"not a safetensors trajectory: {exc}", param="trajectory_b64",
                              code="invalid_trajectory") from None
        lat = t.get("latents")
        if lat is None or lat.ndim != 5 or lat.shape[2] != 3 or lat.dtype != np.float32:
            raise bad_request("the trajectory needs 'latents' float32 [S, N+1, 3, H, W]", param="trajectory_b64",
                              code="invalid_trajectory")
        if not np.isfinite(lat).all():
            raise bad_request("the trajectory's latents are not all finite", param="trajectory_b64",
                              code="invalid_trajectory")
        n_steps = lat.shape[1] - 1
        lp = t.get("logprobs")
        if lp is None or lp.shape != (lat.shape[0], n_steps):
            lp = np.full((lat.shape[0], n_steps), np.nan, dtype=np.float32)
        self.put(tid, 0, Part(np.ascontiguousarray(lat), lp.astype(np.float32), {"timesteps": [], "sde_steps": []}),
                 owner)
        return int(lat.shape[0])

    def latents(self, tid: str, start: int, count: int, steps: int, height: int, width: int,
                owner: str = OPEN_OWNER) -> np.ndarray:
        """The latents of samples [start, start+count), checked against the job's shape (400 on a mismatch)."""
        traj = self.get(tid, owner)
        try:
            lat = traj.samples(start, count)
        except KeyError as exc:
            raise bad_request(f"trajectory {tid!r}: {exc.args[0]} (prompts x group_size must match the rollout)",
                              param="trajectory_id", code="trajectory_mismatch") from None
        want = (count, steps + 1, 3, height, width)
        if tuple(lat.shape) != want:
            raise bad_request(f"trajectory {tid!r} has latents {list(lat.shape)}, this request needs {list(want)} "
                              "(size and num_inference_steps must match the rollout)", param="trajectory_id",
                              code="trajectory_mismatch")
        return lat


def _blob(tid: str, traj: Trajectory) -> Blob:
    """`traj`'s safetensors bytes: views of its latents, the small tensors built here."""
    parts = [traj.parts[k] for k in sorted(traj.parts)]
    meta0 = parts[0].meta
    mask = np.zeros(len(meta0["timesteps"]) - 1, dtype=np.uint8)
    mask[list(meta0["sde_steps"])] = 1
    meta = {k: v for k, v in meta0.items() if k != "timesteps"}
    meta["samples"] = [s for p in parts for s in p.meta.get("samples", [])]
    lat = parts[0].latents
    tensors = [("latents", "F32", [sum(p.latents.shape[0] for p in parts), *lat.shape[1:]],
                [p.latents for p in parts]),
               ("logprobs", "F32", None, [np.concatenate([p.logprobs for p in parts])]),
               ("timesteps", "F32", None, [np.asarray(meta0["timesteps"], dtype=np.float32)]),
               ("sde_mask", "U8", None, [mask])]
    return Blob.of(tensors, {"trajectory_id": tid, "u1serve": json.dumps(meta)})
