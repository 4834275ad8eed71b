"""KV copy for the understanding -> generation handoff.

Layouts (fixed, see docs/kernels.md):
- GPU paged pool of the understanding engine: kv_pool [L, 2, S, Hkv, D] (0 = K, 1 = V).
- Shared-memory page pool: pages [num_pages, L, 2, page_tokens, Hkv, D]; on GPU machines a CPU
  tensor over POSIX shm registered with `register_host_memory` (pinned + mapped), which the
  Triton kernels read and write directly through its device pointer (zero copy).
- kv_export: token i of the request (pool slot slots[i]) -> pages[page_ids[i // pt], :, :, i % pt].
- kv_import: pages -> dst [L, 2, cap, Hkv, D], token i at dst[:, :, i].
- kv_write_: one layer's new K/V rows (the image tokens of a denoising step) -> kv [2, S, Hkv, D] at their
  slots, both in one launch (torch's index_copy_ moves 2-byte elements one by one: ~1 TB/s on the H200).
"""
from __future__ import annotations

import ctypes

import torch

from ._backend import lazy_jit, next_pow2, tl, use_triton

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


def _cudart_call(name, *args) -> int:
    fn = getattr(torch.cuda.cudart(), name)
    res = fn(*args)
    return int(res.value if hasattr(res, "value") else res)


def register_host_memory(tensor: torch.Tensor) -> bool:
    """Pin + map a CPU tensor's memory for the GPU (cudaHostRegister, portable|mapped).

    No-op (returns False) without CUDA. Raises if the CUDA call fails.
    """
    if not torch.cuda.is_available() or tensor.is_cuda or tensor.numel() == 0:
        return False
    torch.cuda.init()
    nbytes = tensor.untyped_storage().nbytes()
    ptr = tensor.untyped_storage().data_ptr()
    err = _cudart_call("cudaHostRegister", ptr, nbytes,
                       CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed with cudaError {err}")
    return True


def unregister_host_memory(tensor: torch.Tensor) -> bool:
    """Undo `register_host_memory`; no-op (False) without CUDA."""
    if not torch.cuda.is_available() or tensor.is_cuda or tensor.numel() == 0:
        return False
    err = _cudart_call("cudaHostUnregister", tensor.untyped_storage().data_ptr())
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with cudaError {err}")
    return True


def _device_pointer(host_ptr: int) -> int:
    """Device address of registered host memory (cuMemHostGetDevicePointer; UVA: often equal)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dptr = ctypes.c_uint64()
        fn = lib.cuMemHostGetDevicePointer_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        if fn(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), 0) == 0:
            return dptr.value
    except (OSError, AttributeError):
        pass
    return host_ptr


class HostMappedView:
    """What Triton needs to address a registered CPU tensor from the GPU: data_ptr() and dtype."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.is_cuda:
            raise ValueError("HostMappedView wraps a CPU tensor")
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.shape = tensor.shape
        self._ptr = _device_pointer(tensor.data_ptr())

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self, dim=None):
        return self.tensor.stride() if dim is None else self.tensor.stride(dim)


def device_view(tensor: torch.Tensor):
    """The tensor itself on the GPU, or a HostMappedView of a registered CPU tensor."""
    return tensor if tensor.is_cuda else HostMappedView(tensor)


def _check_pages(pages, L, Hkv, D, dtype):
    if pages.dim() != 6 or pages.shape[1] != L or pages.shape[2] != 2 or pages.shape[4:] != (Hkv, D):
        raise ValueError(f"pages must be [P, {L}, 2, page_tokens, {Hkv}, {D}], got {tuple(pages.shape)}")
    if pages.dtype != dtype:
        raise ValueError("pages dtype differs from the KV dtype")


def _page_index(n: int, pt: int, page_ids: torch.Tensor, device):
    i = torch.arange(n, device=device)
    return page_ids.to(device).long()[i // pt], i % pt


def kv_export_ref(kv_pool, slots, pages, page_ids):
    L, two, S, Hkv, D = kv_pool.shape
    _check_pages(pages, L, Hkv, D, kv_pool.dtype)
    T = slots.shape[0]
    src = kv_pool[:, :, slots.to(kv_pool.device).long()]          # [L, 2, T, Hkv, D]
    src = src.permute(2, 0, 1, 3, 4).to(pages.device)           # [T, L, 2, Hkv, D]
    pidx, row = _page_index(T, pages.shape[3], page_ids, pages.device)
    pages[pidx, :, :, row] = src
    return pages


def kv_import_ref(pages, page_ids, num_tokens, dst):
    L, two, cap, Hkv, D = dst.shape
    _check_pages(pages, L, Hkv, D, dst.dtype)
    if num_tokens > cap:
        raise ValueError("dst capacity is smaller than num_tokens")
    pidx, row = _page_index(num_tokens, pages.shape[3], page_ids, pages.device)
    src = pages[pidx, :, :, row]                                # [T, L, 2, Hkv, D]
    dst[:, :, :num_tokens] = src.permute(1, 2, 0, 3, 4).to(dst.device)
    return dst


def _copy_rows_kernel(
    Src, Dst, Slots, PageIds, n_tok, page_tokens,
    s_l, s_kv, s_tok,             # source strides: layer, k/v, token (or page-row)
    s_page,                       # source page stride (IMPORT only)
    d_l, d_kv, d_tok, d_page,     # destination strides (d_page for EXPORT only)
    ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, EXPORT: tl.constexpr,
):
    # one program: BLOCK_T tokens x one (layer, k/v) plane; each token row is ROW contiguous elems
    pid_t = tl.program_id(0)
    lk = tl.program_id(1)
    layer = (lk // 2).to(tl.int64)
    kv = (lk % 2).to(tl.int64)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok < n_tok
    page = tl.load(PageIds + tok // page_tokens, mask=ok, other=0).to(tl.int64)
    prow = (tok % page_tokens).to(tl.int64)
    if EXPORT:
        slot = tl.load(Slots + tok, mask=ok, other=0).to(tl.int64)
        src_off = layer * s_l + kv * s_kv + slot * s_tok
        dst_off = page * d_page + layer * d_l + kv * d_kv + prow * d_tok
    else:
        src_off = page * s_page + layer * s_l + kv * s_kv + prow * s_tok
        dst_off = layer * d_l + kv * d_kv + tok.to(tl.int64) * d_tok
    cols = tl.arange(0, BLOCK_C)
    for c0 in tl.static_range(0, ROW, BLOCK_C):
        c = c0 + cols
        m = ok[:, None] & (c < ROW)[None, :]
        x = tl.load(Src + src_off[:, None] + c[None, :], mask=m)
        tl.store(Dst + dst_off[:, None] + c[None, :], x, mask=m)


_copy_rows = lazy_jit(_copy_rows_kernel)


def _row_len(t: torch.Tensor, tok_dim: int) -> int:
    """Elements per token row; checks the trailing [Hkv, D] block is contiguous."""
    Hkv, D = t.shape[-2], t.shape[-1]
    if t.stride(-1) != 1 or t.stride(-2) != D:
        raise ValueError("the trailing [Hkv, D] dims must be contiguous")
    return Hkv * D


def _blocks(row: int, on_gpu: bool):
    block_c = min(next_pow2(row), 1024 if on_gpu else 64)
    block_t = max(1, (4096 if on_gpu else 256) // block_c)
    return block_t, block_c


def kv_export_triton(kv_pool, slots, pages, page_ids, num_warps=4):
    L, _, S, Hkv, D = kv_pool.shape
    _check_pages(pages, L, Hkv, D, kv_pool.dtype)
    T = slots.shape[0]
    if T == 0:
        return pages
    row = _row_len(kv_pool, 2)
    _row_len(pages, 3)
    dview = device_view(pages) if kv_pool.is_cuda else pages
    BT, BC = _blocks(row, kv_pool.is_cuda)
    _copy_rows[((T + BT - 1) // BT, 2 * L)](
        kv_pool, dview, slots, page_ids, T, pages.shape[3],
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), 0,
        pages.stride(1), pages.stride(2), pages.stride(3), pages.stride(0),
        ROW=row, BLOCK_T=BT, BLOCK_C=BC, EXPORT=True, num_warps=num_warps,
    )
    return pages


def kv_import_triton(pages, page_ids, num_tokens, dst, num_warps=4):
    L, _, cap, Hkv, D = dst.shape
    _check_pages(pages, L, Hkv, D, dst.dtype)
    if num_tokens > cap:
        raise ValueError("dst capacity is smaller than num_tokens")
    if num_tokens == 0:
        return dst
    row = _row_len(dst, 2)
    _row_len(pages, 3)
    sview = device_view(pages) if dst.is_cuda else pages
    BT, BC = _blocks(row, dst.is_cuda)
    _copy_rows[((num_tokens + BT - 1) // BT, 2 * L)](
        sview, dst, page_ids, page_ids, num_tokens, pages.shape[3],
        pages.stride(1), pages.stride(2), pages.stride(3), pages.stride(0),
        dst.stride(0), dst.stride(1), dst.stride(2), 0,
        ROW=row, BLOCK_T=BT, BLOCK_C=BC, EXPORT=False, num_warps=num_warps,
    )
    return dst


def _write_rows_kernel(K, V, Dst, Idx, n_rows, s_k, s_v, d_kv, d_tok,
                       ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """BLOCK_T rows of K (program_id(1) == 0) or V (== 1), each ROW contiguous elements, to Dst's plane 0 / 1
    at the rows' slots."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    plane = tl.program_id(1)
    ok = tok < n_rows
    slot = tl.load(Idx + tok, mask=ok, other=0).to(tl.int64)
    dst_off = plane.to(tl.int64) * d_kv + slot * d_tok
    tok = tok.to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    for c0 in tl.static_range(0, ROW, BLOCK_C):
        c = c0 + cols
        m = ok[:, None] & (c < ROW)[None, :]
        if plane == 0:
            x = tl.load(K + tok[:, None] * s_k + c[None, :], mask=m)
        else:
            x = tl.load(V + tok[:, None] * s_v + c[None, :], mask=m)
        tl.store(Dst + dst_off[:, None] + c[None, :], x, mask=m)


_write_rows = lazy_jit(_write_rows_kernel)


def kv_write_ref_(kv, slots, k, v):
    kv[0].index_copy_(0, slots, k)
    kv[1].index_copy_(0, slots, v)
    return kv


def kv_write_(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """kv [2, S, Hkv, D] (K, V planes of one layer) <- k, v [T, Hkv, D] at rows `slots` [T] (int64).
    k / v may have any row stride (views of a fused projection); their [Hkv, D] must be contiguous."""
    T = slots.shape[0]
    ok = (k.shape == v.shape and k.shape[0] == T and kv.dim() == 4 and kv.shape[0] == 2
          and kv.shape[2:] == k.shape[1:] and k.dtype == v.dtype == kv.dtype
          and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (kv, k, v)))
    if not use_triton(kv, ok) or T == 0:
        return kv_write_ref_(kv, slots, k, v)
    row = k.shape[1] * k.shape[2]
    BT, BC = _blocks(row, kv.is_cuda)
    _write_rows[((T + BT - 1) // BT, 2)](k, v, kv, slots, T, k.stride(0), v.stride(0), kv.stride(0), kv.stride(1),
                                         ROW=row, BLOCK_T=BT, BLOCK_C=BC, num_warps=4)
    return kv


def _host_reachable(pages: torch.Tensor) -> bool:
    """GPU kernels can touch `pages`: on the GPU, or pinned (registered) host memory."""
    return pages.is_cuda or pages.is_pinned()


def kv_export(kv_pool, slots, pages, page_ids):
    """Gather a request's tokens from the pool of all layers into shm pages."""
    if use_triton(kv_pool, kv_pool.is_cuda and _host_reachable(pages) or not kv_pool.is_cuda):
        return kv_export_triton(kv_pool, slots, pages, page_ids)
    return kv_export_ref(kv_pool, slots, pages, page_ids)


def kv_import(pages, page_ids, num_tokens, dst):
    """Scatter shm pages into a contiguous per-request buffer dst [L, 2, cap, Hkv, D]."""
    if use_triton(dst, dst.is_cuda and _host_reachable(pages) or not dst.is_cuda):
        return kv_import_triton(pages, page_ids, num_tokens, dst)
    return kv_import_ref(pages, page_ids, num_tokens, dst)
