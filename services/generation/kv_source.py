"""Prefix KV through the shm_transfer Transport (the consumer side): attach before ready, re-attach after a
producer restart, claim, import, release.

Handles say which transport moves their bytes: "shm" (the same-host pool `pool_name`, created by the
understanding service, which may start after us or restart), "nixl" (the producer's pool read over
the network) or "device" (the pool's pages on the GPU of this very process: both engines fused into one; imports
copy device to device; anywhere else such a handle is 503 `kv_pool_unavailable`, HandleError
`device_pages_elsewhere`). The engine ranks open the shm pool before they report ready (`open_before_ready`: on CUDA
the attach registers the whole segment, 16 GiB by default, and the first import compiles its kernel; a first
request used to pay both, H200 2026-12-02: 4.75 s vs 3.39 s steady at 2048²), waiting a bounded time for the
producer; a pool that is not there by then, and every other transport, is opened on the first handle. With
`follow_handles` (a Ray replica: its understanding neighbours name their pools) and no pool of our own name on
the host, shm opens on the pool the handle names; without it such a handle is 503 (a stack never reads a pool
it was not configured for).
"""
from __future__ import annotations

import logging
import time

import torch

from services.kit.errors import APIError

# HandleError codes whose KV is simply gone (producer restarted, pages freed or reclaimed).
_GONE = {"stale_generation", "pages_freed", "lease_expired"}
_UNAVAILABLE = {"pool_unavailable", "producer_unreachable", "device_pages_elsewhere"}
log = logging.getLogger("u1serve.generation.kv")


def handle_error_to_api(e) -> APIError:
    code = getattr(e, "code", "invalid_handle")
    if code in _UNAVAILABLE:
        return APIError(503, f"KV handle rejected: {e}", type="server_error", code="kv_pool_unavailable",
                        param="handles")
    status = 410 if code in _GONE else 400
    return APIError(status, f"KV handle rejected: {e}", code=f"kv_{code}", param="handles")


class PrefixSource:
    def __init__(self, pool_name: str, fingerprint: str, device: torch.device,
                 attach_timeout_s: float = 1.0, geometry: tuple | None = None, follow_handles: bool = False):
        """geometry: (num_layers, num_kv_heads, head_dim, dtype) the engine's buffers use."""
        self.pool_name = pool_name
        self.follow_handles = follow_handles
        self.fingerprint = fingerprint
        self.device = device
        self.geometry = geometry
        self.attach_timeout_s = attach_timeout_s
        self._transports: dict = {}  # handle.transport -> Transport
        # the shm pool as /health shows it ("kv_pool"); on_change(report) hears of every open / drop after start-up
        self.report: dict = {"pool": pool_name, "attached": False, "before_ready": False, "seconds": None,
                             "pinned": False, "warm_import_seconds": None, "waited_s": None, "detail": None}
        self.on_change = None
        self._starting = False
        self._look_again = False    # look for the shm pool while idle (drop_stale): it went, or was not there
        self._heads = None          # this rank's KV heads (warm_import)

    # -- transports ----------------------------------------------------------------------------
    def transport(self, kind: str = "shm", handle=None, wait_s: float | None = None):
        """The transport for handles of `kind`, opened when needed (shm: re-attached when the producer
        replaced its pool; opened on `handle`'s pool when ours is not there; waiting up to `wait_s`, default
        attach_timeout_s, for a pool being created). APIError 503 when it cannot be opened."""
        from shm_transfer.errors import HandleError, PoolError
        t = self._transports.get(kind)
        if t is not None and t.is_stale():
            try:
                t.reattach()
            except HandleError:
                self._close(kind)
                t = None
        if t is None:
            t0 = time.perf_counter()
            try:
                t = self._open(kind, handle, self.attach_timeout_s if wait_s is None else wait_s)
            except HandleError as e:        # a device pool of another process
                raise handle_error_to_api(e) from e
            except (PoolError, FileNotFoundError, OSError) as e:
                raise APIError(503, f"KV transport {kind!r} (pool {self.pool_name!r}) is not available: {e}",
                               type="server_error", code="kv_pool_unavailable") from e
            self._transports[kind] = t
            seconds = time.perf_counter() - t0
            if not self._starting:      # start-up logs its own line (open_before_ready)
                log.info("KV transport %s opened in %.3f s", kind, seconds)  # shm: mapping pinned
            if kind == "shm":
                self._look_again = False
                self._update(pool=t.pool.name, attached=True, before_ready=self._starting,
                             seconds=round(seconds, 3), pinned=t.pool.pinned, detail=None)
        return t

    def open_before_ready(self, wait_s: float, heads: tuple[int, int] | None = None) -> dict:
        """Start-up (every engine rank, after its warm-up): open the shm pool now, waiting up to `wait_s` for
        the producer to create it, and run the import kernel once on its memory (shm_transfer.copy.warm_import:
        this rank's KV heads `heads`), so the first request pays neither. Never raises: a pool that is not
        there in time is opened when it appears (drop_stale, while idle) or by the first handle, as before.
        Returns `report`."""
        t0 = time.perf_counter()
        self._heads = heads
        self._starting = True
        try:
            t = self.transport("shm", wait_s=wait_s)
        except Exception as e:   # absent, another model, pinning refused: the first handle tries again
            self._look_again = isinstance(e, APIError)      # the engine loop looks again while idle
            why = e.message if isinstance(e, APIError) else repr(e)
            later = "looked for again while idle, else opened by the first request" if self._look_again else \
                "the first request tries again"
            self._update(waited_s=round(time.perf_counter() - t0, 3), detail=f"not opened before ready ({why}); {later}")
            log.log(logging.WARNING if wait_s > 0 else logging.INFO,    # cpu: one look, a lazy attach is cheap
                    "KV pool %r not opened before ready after %.1f s: %s; %s", self.pool_name,
                    time.perf_counter() - t0, why, later)
            return self.report
        finally:
            self._starting = False
        self._warm(t)
        log.info("KV pool %r attached before ready in %.3f s (pinned: %s); import kernel warmed in %s s",
                 self.pool_name, self.report["seconds"], self.report["pinned"], self.report["warm_import_seconds"])
        return self.report

    def _warm(self, t) -> None:
        from shm_transfer.copy import warm_import
        try:
            self._update(warm_import_seconds=round(warm_import(t.pool, self.device, heads=self._heads), 3))
        except Exception as e:   # the first real import compiles it instead
            log.warning("KV import warm-up on pool %r failed: %r", self.pool_name, e)
            self._update(warm_import_seconds=None, detail=f"import warm-up failed: {e!r}")

    def _update(self, **changes) -> None:
        """Change `report`; on_change (set after start-up) hears of it: rank 0 tells /health."""
        self.report = {**self.report, **changes}
        if self.on_change is not None:
            self.on_change(dict(self.report))

    def pool(self):
        """The shm pool (attached on demand)."""
        return self.transport("shm").pool

    def _open(self, kind: str, handle, wait_s: float):
        if kind == "shm":
            from shm_transfer.errors import PoolError
            from shm_transfer.transport import LocalShmTransport
            attach = lambda name, timeout_s: LocalShmTransport.attach(    # noqa: E731
                name, expected_fingerprint=self.fingerprint or None, pin=False, timeout_s=timeout_s)
            try:
                t = attach(self.pool_name, wait_s)
            except (PoolError, FileNotFoundError, OSError):
                if (not self.follow_handles or handle is None
                        or getattr(handle, "pool_name", self.pool_name) == self.pool_name):
                    raise
                t = attach(handle.pool_name, 0)   # the transport follows other pools from there
            try:
                self._check_geometry(t.layout)
                if self.device.type == "cuda":
                    t.pool.pin()        # the slow part (the whole segment): only a pool this engine can read
            except BaseException:
                t.close()
                raise
            return t
        if kind == "device":       # the producer is in this process: its pool's pages are on our device
            from shm_transfer.transport import DeviceTransport
            name = getattr(handle, "pool_name", None) or self.pool_name
            t = DeviceTransport.attach(name, expected_fingerprint=self.fingerprint or None, timeout_s=wait_s)
            try:
                self._check_geometry(t.layout)
            except BaseException:
                t.close()
                raise
            return t
        if kind == "nixl":
            from shm_transfer.nixl_transport import NixlTransport
            return NixlTransport.connect(expected_fingerprint=self.fingerprint or None)
        raise APIError(400, f"unknown KV transport {kind!r}", code="kv_malformed_handle", param="handles")

    def _check_geometry(self, lay) -> None:
        if self.geometry is None:
            return
        have = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.torch_dtype)
        if have != tuple(self.geometry):
            raise APIError(503, f"KV pool {self.pool_name!r} holds [layers, kv heads, head_dim, dtype]"
                           f" = {have}, this engine needs {tuple(self.geometry)} (both services "
                           "must run the same model and --dtype)", type="server_error",
                           code="kv_pool_mismatch")

    def is_stale(self) -> bool:
        """Cheap (one stat): does an open transport still map a producer's replaced pool?"""
        return any(t.is_stale() for t in self._transports.values())

    def drop_stale(self) -> bool:
        """The engine loop calls this when idle: unmap a replaced pool now, so the old pinned segment does not
        stay mapped until the next job, and open the shm pool once it is there again (one look a call), or for
        the first time when it was not there at start-up, so the next job pays no attach either. Returns
        whether anything was dropped."""
        stale = [k for k, t in self._transports.items() if t.is_stale()]
        for kind in stale:
            self._close(kind)
        if self._look_again and "shm" not in self._transports:
            self._open_when_there()
        return bool(stale)

    def _open_when_there(self) -> None:
        """One look for the shm pool while idle (cheap when it is absent: a failed open()); its import kernel is
        warmed too if start-up could not. A pool that fails otherwise (pinning refused) is left to the jobs."""
        try:
            t = self.transport("shm", wait_s=0)
        except APIError:
            return                  # not there (yet), or not ours: a mismatched pool is never pinned (_open)
        except Exception as e:
            self._look_again = False
            log.warning("KV pool %r could not be opened while idle: %r; the next job tries again", self.pool_name, e)
            return
        log.info("KV pool %r attached while idle in %.3f s", self.pool_name, self.report["seconds"])
        if self.report["warm_import_seconds"] is None:
            self._warm(t)

    def _close(self, kind: str) -> None:
        t = self._transports.pop(kind, None)
        if t is not None:
            try:
                t.close()
            except Exception:
                pass
            if kind == "shm":
                self._look_again = True
                self._update(attached=False, before_ready=False, pinned=False,
                             detail="the producer replaced its pool: attached again once it is there")

    # -- handles -------------------------------------------------------------------------------
    @staticmethod
    def parse(handle_dict: dict):
        from shm_transfer.errors import HandleError
        from shm_transfer.handle import KVHandle
        try:
            return KVHandle.from_dict(handle_dict)
        except HandleError as e:
            raise handle_error_to_api(e) from e

    def import_into(self, handle, dst: torch.Tensor, heads: tuple[int, int] | None = None,
                    release: bool = True) -> tuple[int, float]:
        """Copy the handle's prefix (KV heads [h0, h1) when `heads` is given; dst [L, 2, cap, h1-h0, D])
        into dst[:, :, :num_tokens] and free its pages at once (the engine owns its copy from here on)
        unless release=False (several ranks read the same pages). Returns (bytes, seconds)."""
        from shm_transfer.errors import HandleError
        if handle.transport != "shm":
            self._check_geometry(handle.kv_layout)
        t = self.transport(handle.transport, handle)
        t0 = time.perf_counter()
        try:
            t.import_kv(handle, dst, heads=heads)
        except HandleError as e:
            raise handle_error_to_api(e) from e
        if dst.is_cuda:
            torch.cuda.current_stream(dst.device).synchronize()
        seconds = time.perf_counter() - t0
        if release:
            t.release(handle)
        share = 1.0 if heads is None else (heads[1] - heads[0]) / handle.kv_layout.num_kv_heads
        return int(handle.num_tokens * handle.kv_layout.bytes_per_token * share), seconds

    def _each(self, handle_dicts, op) -> None:
        """Best effort: op(transport, handle) for each handle; a missing pool or a gone handle is skipped
        (its pages died with the pool, or were freed already)."""
        for d in list(handle_dicts):
            try:
                h = self.parse(d)
                op(self.transport(h.transport, h), h)
            except Exception:
                pass

    def release(self, handle_dicts) -> None:
        """Free handles never imported (aborted / failed jobs). Idempotent: a handle only frees pages it
        still owns."""
        self._each(handle_dicts, lambda t, h: t.release(h))

    def claim(self, handle_dicts) -> None:
        """Hold the pages of an accepted job's handles for as long as this process lives (no lease to
        renew; a killed process's claims are reclaimed). Best effort: a handle already gone fails at import."""
        self._each(handle_dicts, lambda t, h: t.claim(h))

    def close(self) -> None:
        self.on_change = None        # shutting down: nobody to tell
        for kind in list(self._transports):
            self._close(kind)
