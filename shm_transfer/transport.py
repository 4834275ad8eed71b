"""Transport: what the engines use to hand prefix KV over. LocalShmTransport is the same-host pool; a network
transport (RDMA across hosts) implements the same methods and the engines do not change."""
from __future__ import annotations

import abc
import threading

import torch

from . import copy as kvcopy
from .errors import HandleError
from .handle import KVHandle
from .layout import KVLayout
from .pool import ShmKVPool


class Transport(abc.ABC):
    """Producer side: allocate -> export_kv (or write_kv) -> publish handle.to_dict().
    Consumer side: KVHandle.from_dict -> import_kv -> release. Either side may release (idempotent)."""

    @abc.abstractmethod
    def allocate(self, num_tokens: int, lease_s: float, *, branch: str = "cond", t_offset: int = 0) -> KVHandle:
        """Reserve room; raises PoolFull at once when there is none."""

    @abc.abstractmethod
    def export_kv(self, handle: KVHandle, kv_pool: torch.Tensor, slots: torch.Tensor, stream=None, *,
                  heads: tuple[int, int] | None = None) -> kvcopy.CopyDone:
        """Copy the engine's paged KV of `slots` (optionally only KV heads [start, stop)) into the handle."""

    @abc.abstractmethod
    def write_kv(self, handle: KVHandle, kv: torch.Tensor, stream=None, *,
                 heads: tuple[int, int] | None = None) -> kvcopy.CopyDone:
        """Copy a contiguous [L, 2, T, Hkv, D] tensor into the handle."""

    @abc.abstractmethod
    def import_kv(self, handle: KVHandle, dst: torch.Tensor, stream=None, *,
                  heads: tuple[int, int] | None = None) -> kvcopy.CopyDone:
        """Copy the handle's KV into dst[:, :, :num_tokens]; checks fingerprint and layout first."""

    @abc.abstractmethod
    def release(self, handle: KVHandle) -> int:
        """Free the handle's pages (idempotent)."""

    @abc.abstractmethod
    def extend_lease(self, handle: KVHandle, seconds: float) -> KVHandle:
        """Push the handle's lease deadline to now + seconds."""

    @abc.abstractmethod
    def validate(self, handle: KVHandle) -> None:
        """Raise HandleError unless the handle can be imported here."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Plain-dict metrics."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the transport's resources (the producer's pool disappears)."""


class LocalShmTransport(Transport):
    """Same-host transport over a ShmKVPool.

    The consumer re-attaches on its own when the producer restarted (the name now holds a new generation),
    so a restarted understanding service does not need a generation-service restart.
    """

    def __init__(self, pool: ShmKVPool, expected_fingerprint: str | None = None):
        self._pool = pool
        self._expected = expected_fingerprint
        self._lock = threading.Lock()

    @classmethod
    def create(cls, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
               pin: bool | None = None) -> "LocalShmTransport":
        return cls(ShmKVPool.create(name, layout, size_bytes, model_fingerprint, pin=pin), model_fingerprint)

    @classmethod
    def attach(cls, name: str, *, expected_fingerprint: str | None = None, pin: bool | None = None,
               timeout_s: float = 5.0) -> "LocalShmTransport":
        pool = ShmKVPool.attach(name, expected_fingerprint=expected_fingerprint, pin=pin, timeout_s=timeout_s)
        return cls(pool, expected_fingerprint)

    @property
    def pool(self) -> ShmKVPool:
        return self._pool

    def _pool_for(self, handle: KVHandle) -> ShmKVPool:
        """The pool, re-attached first if the handle is from a newer generation than the one we mapped."""
        pool = self._pool
        if (pool.is_creator or handle.pool_name != pool.name
                or handle.pool_generation == pool.generation or not pool.is_stale()):
            return pool
        with self._lock:
            if self._pool is pool:
                try:
                    fresh = ShmKVPool.attach(pool.name, expected_fingerprint=self._expected,
                                             pin=pool.pinned, timeout_s=1.0)
                except Exception as e:
                    raise HandleError(f"KV pool {pool.name!r} was replaced and cannot be re-attached: {e}",
                                      "pool_unavailable") from e
                self._pool = fresh
                pool.close()
            return self._pool

    def allocate(self, num_tokens, lease_s, *, branch="cond", t_offset=0):
        return self._pool.allocate(num_tokens, lease_s, branch=branch, t_offset=t_offset)

    def export_kv(self, handle, kv_pool, slots, stream=None, *, heads=None):
        return kvcopy.export_kv(self._pool_for(handle), handle, kv_pool, slots, stream, heads=heads)

    def write_kv(self, handle, kv, stream=None, *, heads=None):
        return kvcopy.write_kv(self._pool_for(handle), handle, kv, stream, heads=heads)

    def import_kv(self, handle, dst, stream=None, *, heads=None):
        return kvcopy.import_kv(self._pool_for(handle), handle, dst, stream, self._expected, heads=heads)

    def read_kv(self, handle, device="cpu"):
        return kvcopy.read_kv(self._pool_for(handle), handle, device, self._expected)

    def release(self, handle):
        return self._pool_for(handle).release(handle)

    def extend_lease(self, handle, seconds):
        return self._pool_for(handle).extend_lease(handle, seconds)

    def validate(self, handle):
        self._pool_for(handle).validate(handle, self._expected)

    def stats(self):
        return self._pool.stats()

    def close(self):
        self._pool.close()
