"""Moving KV between an engine's tensors and pool pages.

export: engine paged KV [L, 2, S, Hkv, D] + token slots [T]  -> the handle's pages
import: the handle's pages -> a preallocated contiguous [L, 2, cap, Hkv, D] buffer (cap >= T)

The copies go through kernels.kv_export / kernels.kv_import (Triton on CUDA, torch reference on CPU). The
pages are the CPU tensor over the shared memory; in a CUDA process it is registered (pinned, mapped) so the
kernels read/write it directly from the GPU. A device pool's pages (DeviceTransport, one process) are a tensor on
the engines' device: the same kernels then copy device to device. Same code for all.

With stream=None a copy is synchronous: on return an exported handle may be published and an imported
handle may be released. With a side stream the call returns at once and the returned CopyDone must be
waited on (wait(), or wait_stream() to order a compute stream after it) before that.
"""
from __future__ import annotations

import contextlib
import time

import torch
from kernels import kv_export as _kernel_export
from kernels import kv_import as _kernel_import

from .errors import HandleError
from .handle import KVHandle
from .layout import KVLayout
from .pool import ShmKVPool

# A copy must finish within this many seconds of starting; the pages' lease is held at least that long so
# an allocation elsewhere cannot reclaim them mid-copy.
COPY_GUARD_S = 30.0


class CopyDone:
    """Completion of one export/import. wait() is idempotent; it records metrics and re-checks that the
    pages still belonged to the handle at the end of the copy (a concurrent release would corrupt it)."""

    def __init__(self, pool: ShmKVPool, handle: KVHandle, kind: str, nbytes: int, *, t0: float, guard,
                 device: torch.device | None = None, start: "torch.cuda.Event | None" = None,
                 end: "torch.cuda.Event | None" = None):
        self._pool, self._handle, self.kind, self.nbytes = pool, handle, kind, nbytes
        self._device, self._start, self._end, self._guard = device, start, end, guard
        self.seconds: float | None = None
        if end is None:
            self._finish(time.perf_counter() - t0)

    def query(self) -> bool:
        if self.seconds is not None:
            return True
        if self._end.query():
            self.wait()
            return True
        return False

    def wait(self) -> "CopyDone":
        if self.seconds is None:
            self._end.synchronize()
            self._finish(self._start.elapsed_time(self._end) / 1000.0)
        return self

    def wait_stream(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Order `stream` (default: current) after the copy without blocking the host. Still call wait()
        before releasing an imported handle or publishing an exported one."""
        if self._end is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._end)

    def _finish(self, seconds: float) -> None:
        self.seconds = seconds
        self._pool.add_bytes_moved(self.kind, self.nbytes, seconds)
        self._pool.end_copy(self._handle, self._guard)  # HandleError if released while copying


def head_slice(layout: KVLayout, heads) -> tuple[int, int]:
    n = layout.num_kv_heads
    if heads is None:
        return 0, n
    h0, h1 = (int(h) for h in heads)
    if not 0 <= h0 < h1 <= n:
        raise ValueError(f"heads {heads!r} must be a (start, stop) range within the pool's {n} KV heads")
    return h0, h1


def heads_view(pages: torch.Tensor, layout: KVLayout, h0: int, h1: int) -> torch.Tensor:
    """The pages, or the view of one tensor-parallel rank's KV heads (token rows stay contiguous)."""
    if (h0, h1) == (0, layout.num_kv_heads):
        return pages
    return pages[:, :, :, :, h0:h1]


def check_kv(name: str, t: torch.Tensor, lay: KVLayout, min_tokens: int, *, exact: bool,
             num_heads: int | None = None) -> None:
    num_heads = lay.num_kv_heads if num_heads is None else num_heads
    if not isinstance(t, torch.Tensor) or t.dim() != 5:
        raise ValueError(f"{name} must be a 5-D tensor [L, 2, T, Hkv, D]")
    L, two, T, H, D = t.shape
    if (L, two, H, D) != (lay.num_layers, 2, num_heads, lay.head_dim):
        raise ValueError(f"{name} shape {tuple(t.shape)} does not match the pool layout "
                         f"[{lay.num_layers}, 2, T, {num_heads}, {lay.head_dim}]")
    if (T != min_tokens) if exact else (T < min_tokens):
        raise ValueError(f"{name} has {T} tokens, needs {'exactly' if exact else 'at least'} {min_tokens}")
    if t.dtype != lay.torch_dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from the pool dtype {lay.torch_dtype}")


def _run(pool: ShmKVPool, handle: KVHandle, kind: str, guard, nbytes: int, device: torch.device, stream, fn,
         *tensors) -> CopyDone:
    """Run fn(page_ids) either now (CPU, or CUDA with stream=None) or on `stream`."""
    try:
        t0 = time.perf_counter()
        if device.type == "cpu":
            fn(torch.tensor(handle.page_ids, dtype=torch.int32))
            return CopyDone(pool, handle, kind, nbytes, t0=t0, guard=guard)
        return _run_cuda(pool, handle, kind, guard, nbytes, t0, device, stream, fn, tensors)
    except BaseException:
        with contextlib.suppress(Exception):
            pool.end_copy(handle, guard)
        raise


def _run_cuda(pool, handle, kind, guard, nbytes, t0, device, stream, fn, tensors) -> CopyDone:
    pool.pin()  # the kernels address the pages from the GPU only when they are registered here
    side = stream if stream is not None else torch.cuda.current_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # the KV / buffer were produced on the compute stream
    with torch.cuda.stream(side):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        page_ids = torch.tensor(handle.page_ids, dtype=torch.int32).to(device, non_blocking=True)
        fn(page_ids)
        end.record(side)
    for t in tensors:
        t.record_stream(side)  # keep the caching allocator from reusing them before the copy ends
    done = CopyDone(pool, handle, kind, nbytes, t0=t0, guard=guard, device=device, start=start, end=end)
    return done.wait() if stream is None else done


def export_kv(pool: ShmKVPool, handle: KVHandle, kv_pool: torch.Tensor, slots: torch.Tensor,
              stream=None, *, heads: tuple[int, int] | None = None) -> CopyDone:
    """Copy the request's tokens kv_pool[:, :, slots] into the handle's pages (producer side).

    heads=(start, stop): kv_pool holds only those global KV heads (one tensor-parallel rank); each rank
    exports its own slice into the same pages. With KV heads replicated over ranks, only one rank of each
    replica group exports. The handle is complete when every slice's copy is done."""
    h0, h1 = head_slice(pool.layout, heads)
    check_kv("kv_pool", kv_pool, pool.layout, 1, exact=False, num_heads=h1 - h0)
    if slots.dim() != 1 or slots.numel() != handle.num_tokens:
        raise ValueError(f"slots must be 1-D with {handle.num_tokens} entries, got {tuple(slots.shape)}")
    if slots.device != kv_pool.device:
        raise ValueError(f"slots on {slots.device} but kv_pool on {kv_pool.device}")
    guard = pool.guard_copy(handle, COPY_GUARD_S, None)
    slots = slots.to(torch.int32)
    pages = heads_view(pool.pages, pool.layout, h0, h1)
    nbytes = handle.num_tokens * pool.layout.bytes_per_token * (h1 - h0) // pool.layout.num_kv_heads
    return _run(pool, handle, "export", guard, nbytes, kv_pool.device, stream,
                lambda page_ids: _kernel_export(kv_pool, slots, pages, page_ids), kv_pool, slots)


def write_kv(pool: ShmKVPool, handle: KVHandle, kv: torch.Tensor, stream=None, *,
             heads: tuple[int, int] | None = None) -> CopyDone:
    """Copy a contiguous [L, 2, T, Hkv, D] tensor into the handle's pages (T = handle.num_tokens)."""
    h0, h1 = head_slice(pool.layout, heads)
    check_kv("kv", kv, pool.layout, handle.num_tokens, exact=True, num_heads=h1 - h0)
    slots = torch.arange(handle.num_tokens, dtype=torch.int32, device=kv.device)
    return export_kv(pool, handle, kv, slots, stream, heads=heads)


def import_kv(pool: ShmKVPool, handle: KVHandle, dst: torch.Tensor, stream=None,
              expected_fingerprint: str | None = None, *, heads: tuple[int, int] | None = None) -> CopyDone:
    """Copy the handle's tokens into dst[:, :, :num_tokens] (consumer side). Checks pool, generation,
    fingerprint (against expected_fingerprint when given, else the pool's) and layout first.
    heads=(start, stop) imports only those KV heads (a tensor-parallel consumer rank)."""
    pool.validate(handle, expected_fingerprint)  # handle errors before buffer errors: they say more
    h0, h1 = check_import_dst(pool.layout, handle, dst, heads)
    guard = pool.guard_copy(handle, COPY_GUARD_S, expected_fingerprint)
    pages = heads_view(pool.pages, pool.layout, h0, h1)
    nbytes = import_bytes(pool.layout, handle, h0, h1)
    return _run(pool, handle, "import", guard, nbytes, dst.device, stream,
                lambda page_ids: pages_into(pages, page_ids, handle.num_tokens, dst), dst)


def check_import_dst(layout: KVLayout, handle: KVHandle, dst: torch.Tensor, heads) -> tuple[int, int]:
    """ValueError unless dst [L, 2, cap >= T, h1 - h0, D] (contiguous) can take the handle's heads."""
    h0, h1 = head_slice(layout, heads)
    check_kv("dst", dst, layout, handle.num_tokens, exact=False, num_heads=h1 - h0)
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous")
    return h0, h1


def import_bytes(layout: KVLayout, handle: KVHandle, h0: int, h1: int) -> int:
    return handle.num_tokens * layout.bytes_per_token * (h1 - h0) // layout.num_kv_heads


def pages_into(pages: torch.Tensor, page_ids: torch.Tensor, num_tokens: int, dst: torch.Tensor) -> None:
    """The import kernel: rows [0, num_tokens) of the listed pages into dst (Triton on CUDA)."""
    _kernel_import(pages, page_ids, num_tokens, dst)


# The copy kernels are specialised (Triton) on whether num_tokens is a multiple of 16: one warm copy of each.
WARM_COPY_TOKENS = (32, 33)


def warm_import(pool: ShmKVPool, device: torch.device, *, heads: tuple[int, int] | None = None) -> float:
    """What a process's first import_kv into `device` sets up, done now: the import kernel compiled (Triton JIT on
    CUDA) and run on the pool's registered memory into a scratch buffer, for each of WARM_COPY_TOKENS. The page
    table is not touched: the pages read are anyone's (a live handle's or free), the bytes are thrown away.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    lay = pool.layout
    h0, h1 = head_slice(lay, heads)
    pool.require_pages()
    pages = heads_view(pool.pages, lay, h0, h1)
    if device.type == "cuda":
        pool.pin()
    for n in WARM_COPY_TOKENS:
        page_ids = torch.arange(lay.pages_for(n), dtype=torch.int32) % pool.num_pages
        dst = torch.empty((lay.num_layers, 2, n, h1 - h0, lay.head_dim), dtype=lay.torch_dtype, device=device)
        pages_into(pages, page_ids.to(device), n, dst)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_export(pool: ShmKVPool, kv_pool: torch.Tensor, slot: int, *, heads: tuple[int, int] | None = None) -> float:
    """What a process's first export_kv from `kv_pool` sets up, done now: the export kernel compiled (Triton JIT on
    CUDA: the EXPORT variant is a kernel of its own) and run, for each of WARM_COPY_TOKENS, from row `slot` of
    kv_pool (a scratch slot: it is only read) into scratch pages of the pool's page shape where the pool keeps its
    pages (registered host memory, or the device of a device pool). The pool's own pages are not written: any may be
    a live handle's. Returns the seconds it took."""
    t0 = time.perf_counter()
    lay = pool.layout
    h0, h1 = head_slice(lay, heads)
    check_kv("kv_pool", kv_pool, lay, 1, exact=False, num_heads=h1 - h0)
    pool.require_pages()
    where = pool.pages.device
    for n in WARM_COPY_TOKENS:
        scratch = torch.zeros((lay.pages_for(n), *lay.page_shape), dtype=lay.torch_dtype, device=where,
                              pin_memory=where.type == "cpu" and kv_pool.is_cuda)
        slots = torch.full((n,), slot, dtype=torch.int32, device=kv_pool.device)
        page_ids = torch.arange(scratch.shape[0], dtype=torch.int32, device=kv_pool.device)
        _kernel_export(kv_pool, slots, heads_view(scratch, lay, h0, h1), page_ids)
    if kv_pool.is_cuda:
        torch.cuda.synchronize(kv_pool.device)
    return time.perf_counter() - t0


def read_kv(pool: ShmKVPool, handle: KVHandle, device: torch.device | str = "cpu",
            expected_fingerprint: str | None = None) -> torch.Tensor:
    """Convenience: a new [L, 2, T, Hkv, D] tensor holding the handle's KV."""
    dst = torch.empty(pool.layout.kv_shape(handle.num_tokens), dtype=pool.layout.torch_dtype, device=device)
    import_kv(pool, handle, dst, expected_fingerprint=expected_fingerprint)
    return dst


__all__ = ["export_kv", "write_kv", "import_kv", "read_kv", "warm_import", "warm_export", "CopyDone", "HandleError"]
