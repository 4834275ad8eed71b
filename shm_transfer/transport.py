"""Transport: what the engines use to hand prefix KV over. LocalShmTransport is the same-host pool;
DeviceTransport the same pool with its pages on the device, for engines in one process (fused colocate);
NixlTransport (nixl_transport.py) reads the producer's pool over the network; the engines do not change."""
from __future__ import annotations

import abc
import threading

import torch

from . import copy as kvcopy
from .errors import HandleError, PoolError
from .handle import KVHandle
from .layout import KVLayout
from .pool import ShmKVPool


class Transport(abc.ABC):
    """The one way prefix KV moves between the engines (docs/kv_contract.md).

    Producer (understanding): allocate -> export_kv (or write_kv; each TP rank its head slice) -> publish
    handle.to_dict(); release on error/abort. Consumer (generation): KVHandle.from_dict -> claim (a queued
    job) -> import_kv -> release. Either side may release (idempotent). Implementations: LocalShmTransport
    (same host, the pool in /dev/shm), DeviceTransport (one process, the pages on the device) and NixlTransport
    (the producer's pool read over the network)."""

    kind: str = ""  # the value of KVHandle.transport this implementation moves

    @abc.abstractmethod
    def allocate(self, num_tokens: int, lease_s: float, *, branch: str = "cond", t_offset: int = 0,
                 near: KVHandle | None = None) -> KVHandle:
        """Reserve room; raises PoolFull at once when there is none. `near`: in the pool that holds that
        handle (a consumer answering a producer in that producer's pool), else this transport's own."""

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
                  heads: tuple[int, int] | None = None):
        """Copy the handle's KV into dst[:, :, :num_tokens]; checks fingerprint and layout first.
        Synchronous unless a stream is given (then wait on the returned CopyDone)."""

    def read_kv(self, handle: KVHandle, device: torch.device | str = "cpu") -> torch.Tensor:
        """Convenience: a new [L, 2, T, Hkv, D] tensor holding the handle's KV."""
        lay = handle.kv_layout
        dst = torch.empty(lay.kv_shape(handle.num_tokens), dtype=lay.torch_dtype, device=device)
        self.import_kv(handle, dst)
        return dst

    @abc.abstractmethod
    def release(self, handle: KVHandle) -> int:
        """Free the handle's pages (idempotent). Returns the pages freed (network: the pages asked for)."""

    @abc.abstractmethod
    def extend_lease(self, handle: KVHandle, seconds: float) -> KVHandle:
        """Hold the handle's pages until at least now + seconds (never shortens)."""

    @abc.abstractmethod
    def claim(self, handle: KVHandle) -> KVHandle:
        """Hold the handle's pages for as long as this process lives, whatever the lease (a consumer that
        accepted a job); release() as usual. A killed claimer's pages are reclaimed."""

    @abc.abstractmethod
    def validate(self, handle: KVHandle) -> None:
        """Raise HandleError unless the handle can be imported here."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Plain-dict metrics."""

    def is_stale(self) -> bool:
        """True when what this transport maps was replaced (producer restarted): call reattach()."""
        return False

    def reattach(self) -> None:
        """Let go of a replaced producer's memory now and follow the new one (no-op when not stale)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the transport's resources (the producer's pool disappears)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalShmTransport(Transport):
    """Same-host transport over a ShmKVPool.

    The consumer re-attaches on its own when the producer restarted (the name now holds a new generation),
    so a restarted understanding service does not need a generation-service restart.
    """

    kind = "shm"

    def __init__(self, pool: ShmKVPool, expected_fingerprint: str | None = None):
        self._pool = pool
        self._expected = expected_fingerprint
        self._lock = threading.Lock()
        self._others: dict[str, ShmKVPool] = {}  # consumer: other producers' pools on this host, by name

    @classmethod
    def create(cls, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
               pin: bool | None = None, owner: str = "") -> "LocalShmTransport":
        return cls(ShmKVPool.create(name, layout, size_bytes, model_fingerprint, pin=pin, owner=owner),
                   model_fingerprint)

    @classmethod
    def attach(cls, name: str, *, expected_fingerprint: str | None = None, pin: bool | None = None,
               timeout_s: float = 5.0) -> "LocalShmTransport":
        pool = ShmKVPool.attach(name, expected_fingerprint=expected_fingerprint, pin=pin, timeout_s=timeout_s)
        return cls(pool, expected_fingerprint)

    @property
    def pool(self) -> ShmKVPool:
        return self._pool

    @property
    def layout(self) -> KVLayout:
        return self._pool.layout

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def is_stale(self) -> bool:
        pool = self._pool
        return not pool.is_creator and (pool.closed or pool.is_stale())

    def reattach(self) -> None:
        """Unmap a replaced pool now (its pinned memory goes with it) and map the current one. HandleError
        (code pool_unavailable) when there is none yet; the old mapping is dropped either way."""
        pool = self._pool
        if not self.is_stale():
            return
        with self._lock:
            if self._pool is not pool:
                return
            pool.close()
            try:
                self._pool = ShmKVPool.attach(pool.name, expected_fingerprint=self._expected,
                                              pin=pool.pinned, timeout_s=1.0)
            except Exception as e:
                raise HandleError(f"KV pool {pool.name!r} was replaced and cannot be re-attached: {e}",
                                  "pool_unavailable") from e

    def _pool_for(self, handle: KVHandle) -> ShmKVPool:
        """The pool, re-attached first if the handle is from a newer generation than the one we mapped. A
        consumer follows a handle of another pool on this host too (several understanding replicas, one
        pool each): that pool is attached on first use."""
        pool = self._pool
        if handle.pool_name != pool.name and not pool.is_creator and isinstance(handle, KVHandle):
            return self._other(handle)
        if handle.pool_name == pool.name and handle.pool_generation != pool.generation and self.is_stale():
            self.reattach()
        return self._pool

    def _other(self, handle: KVHandle) -> ShmKVPool:
        """Another producer's pool on this host, (re-)attached when needed. HandleError pool_unavailable when
        no such pool is here (it lives on another host, or its producer is gone)."""
        with self._lock:
            for name, other in list(self._others.items()):   # drop replaced pools (producer restarted)
                if other.closed or other.is_stale():
                    other.close()
                    del self._others[name]
            pool = self._others.get(handle.pool_name)
            if pool is None:
                try:
                    pool = ShmKVPool.attach(handle.pool_name, expected_fingerprint=self._expected,
                                            pin=self._pool.pinned, timeout_s=0)
                except (PoolError, ValueError, OSError) as e:
                    raise HandleError(f"KV pool {handle.pool_name!r} is not on this host: {e}",
                                      "pool_unavailable") from e
                self._others[handle.pool_name] = pool
            return pool

    def allocate(self, num_tokens, lease_s, *, branch="cond", t_offset=0, near=None):
        pool = self._pool if near is None else self._pool_for(near)
        return pool.allocate(num_tokens, lease_s, branch=branch, t_offset=t_offset)

    def export_kv(self, handle, kv_pool, slots, stream=None, *, heads=None):
        return kvcopy.export_kv(self._pool_for(handle), handle, kv_pool, slots, stream, heads=heads)

    def write_kv(self, handle, kv, stream=None, *, heads=None):
        return kvcopy.write_kv(self._pool_for(handle), handle, kv, stream, heads=heads)

    def import_kv(self, handle, dst, stream=None, *, heads=None):
        return kvcopy.import_kv(self._pool_for(handle), handle, dst, stream, self._expected, heads=heads)

    def release(self, handle):
        return self._pool_for(handle).release(handle)

    def extend_lease(self, handle, seconds):
        return self._pool_for(handle).extend_lease(handle, seconds)

    def claim(self, handle):
        return self._pool_for(handle).claim(handle)

    def validate(self, handle):
        self._pool_for(handle).validate(handle, self._expected)

    def stats(self):
        return self._pool.stats()

    def close(self):
        with self._lock:
            for other in self._others.values():
                other.close()
            self._others.clear()
        self._pool.close()


class DeviceTransport(LocalShmTransport):
    """Both engines in one process (fused colocate): the pool's pages are a tensor on the engines' device, so a
    prefix goes device to device (export: engine KV -> pages; import: pages -> the job's buffer), never through
    host memory. The page table, and with it every ownership / lease / claim / release / restart rule, is the
    shm pool's own (ShmKVPool with `pages_device`): only where the bytes live differs.

    Handles say transport "device". attach() in a process other than the creator's is refused (HandleError
    `device_pages_elsewhere`): the pages cannot be addressed there; so is any copy of such a pool's pages there."""

    kind = "device"

    @classmethod
    def create(cls, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
               device: str | torch.device = "cpu", owner: str = "") -> "DeviceTransport":
        """The producer: a pool of size_bytes of `device` memory (its page table in /dev/shm/<name>)."""
        pool = ShmKVPool.create(name, layout, size_bytes, model_fingerprint, owner=owner, pages_device=device)
        return cls(pool, model_fingerprint)

    @classmethod
    def attach(cls, name: str, *, expected_fingerprint: str | None = None, pin: bool | None = None,
               timeout_s: float = 5.0) -> "DeviceTransport":
        """A consumer in the producer's process. HandleError device_pages_elsewhere anywhere else (or when the
        pool `name` keeps its pages in shared memory: that is the shm transport's)."""
        pool = ShmKVPool.attach(name, expected_fingerprint=expected_fingerprint, pin=False, timeout_s=timeout_s)
        try:
            if pool.pages_device is None:
                raise HandleError(f"KV pool {name!r} keeps its pages in shared memory: use the shm transport",
                                  "wrong_transport")
            pool.require_pages()
        except BaseException:
            pool.close()
            raise
        return cls(pool, expected_fingerprint)

    def reattach(self) -> None:
        """As the shm transport's, and the new pool's pages must be here too."""
        super().reattach()
        self._pool.require_pages()

    def allocate(self, num_tokens, lease_s, *, branch="cond", t_offset=0, near=None):
        return super().allocate(num_tokens, lease_s, branch=branch, t_offset=t_offset,
                                near=near).replace(transport=self.kind)
