"""Prefix KV from the shared-memory pool: lazy attach, re-attach after a producer restart, import, release.

The pool is created by the understanding service, which may start after us or restart: attach lazily,
and re-attach when the name now points at a newer segment (a new pool generation).
"""
from __future__ import annotations

import time

import torch

from .request import ApiError

# HandleError codes whose KV is simply gone (producer restarted, pages freed or reclaimed).
_GONE = {"stale_generation", "pages_freed", "lease_expired"}


def handle_error_to_api(e) -> ApiError:
    code = getattr(e, "code", "invalid_handle")
    status = 410 if code in _GONE else 400
    return ApiError(status, f"KV handle rejected: {e}", code=f"kv_{code}", param="handles")


class PrefixSource:
    def __init__(self, pool_name: str, fingerprint: str, device: torch.device,
                 attach_timeout_s: float = 1.0, geometry: tuple | None = None):
        """geometry: (num_layers, num_kv_heads, head_dim, dtype) the engine's buffers use."""
        self.pool_name = pool_name
        self.fingerprint = fingerprint
        self.device = device
        self.geometry = geometry
        self.attach_timeout_s = attach_timeout_s
        self._pool = None

    # -- pool ----------------------------------------------------------------------------------
    def pool(self):
        """The attached pool, (re-)attaching when needed. ApiError 503 when it does not exist."""
        from shm_transfer.errors import PoolError
        from shm_transfer.pool import ShmKVPool
        if self._pool is not None and (self._pool.closed or self._pool.is_stale()):
            self._close()
        if self._pool is None:
            try:
                self._pool = ShmKVPool.attach(self.pool_name, expected_fingerprint=self.fingerprint or None,
                                              pin=self.device.type == "cuda",
                                              timeout_s=self.attach_timeout_s)
            except (PoolError, FileNotFoundError, OSError) as e:
                raise ApiError(503, f"KV pool {self.pool_name!r} is not available: {e}",
                               type="server_error", code="kv_pool_unavailable") from e
            self._check_geometry()
        return self._pool

    def _check_geometry(self) -> None:
        if self.geometry is None:
            return
        lay = self._pool.layout
        have = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.torch_dtype)
        if have != tuple(self.geometry):
            self._close()
            raise ApiError(503, f"KV pool {self.pool_name!r} holds [layers, kv heads, head_dim, dtype]"
                           f" = {have}, this engine needs {tuple(self.geometry)} (both services "
                           "must run the same model and --dtype)", type="server_error",
                           code="kv_pool_mismatch")

    def _close(self) -> None:
        try:
            self._pool.close()
        except Exception:
            pass
        self._pool = None

    # -- handles -------------------------------------------------------------------------------
    @staticmethod
    def parse(handle_dict: dict):
        from shm_transfer.errors import HandleError
        from shm_transfer.handle import KVHandle
        try:
            return KVHandle.from_dict(handle_dict)
        except HandleError as e:
            raise handle_error_to_api(e) from e

    def import_into(self, handle, dst: torch.Tensor) -> tuple[int, float]:
        """Copy the handle's prefix into dst[:, :, :num_tokens] (dst [L, 2, cap, Hkv, D]) and free its
        pages at once (the engine owns its copy from here on). Returns (bytes, seconds)."""
        from shm_transfer import import_kv
        from shm_transfer.errors import HandleError
        pool = self.pool()
        if handle.pool_generation != pool.generation and pool.is_stale():
            self._close()
            pool = self.pool()
        t0 = time.perf_counter()
        try:
            import_kv(pool, handle, dst)
        except HandleError as e:
            raise handle_error_to_api(e) from e
        if dst.is_cuda:
            torch.cuda.current_stream(dst.device).synchronize()
        seconds = time.perf_counter() - t0
        pool.release(handle)
        nbytes = handle.num_tokens * pool.layout.bytes_per_token
        return nbytes, seconds

    def release(self, handle_dicts) -> None:
        """Best-effort free of handles never imported (cancelled / failed jobs). Idempotent: a
        handle only frees pages it still owns."""
        handle_dicts = list(handle_dicts)
        if not handle_dicts:
            return
        try:
            pool = self.pool()
        except ApiError:
            return  # no pool: nothing to free (its pages died with it)
        for d in handle_dicts:
            try:
                pool.release(self.parse(d))
            except Exception:
                pass

    def keep_alive(self, handle_dicts, seconds: float) -> None:
        """Extend the leases of handles of jobs still queued here, so a long queue does not turn them
        into 410s (best effort: a handle that is already gone fails at import with a clear error)."""
        try:
            pool = self.pool()
        except ApiError:
            return
        for d in handle_dicts:
            try:
                pool.extend_lease(self.parse(d), seconds)
            except Exception:
                pass

    def close(self) -> None:
        if self._pool is not None:
            self._close()
