import pytest
import torch

from kernels.kv_copy import (kv_export, kv_export_ref, kv_export_triton, kv_import, kv_import_ref, kv_import_triton,
                             kv_write_, kv_write_ref_)
from kernels.qk_norm_rope import qk_norm_rope_, qk_norm_rope_ref_, qk_norm_rope_triton_

from tests.kernels.kernel_testutil import assert_close


def _norm_rope_inputs(T, hq, hkv, d, dtype):
    q = torch.randn(T, hq, d).to(dtype) * 3
    k = torch.randn(T, hkv, d).to(dtype)
    ws = [(torch.rand(d // 2) + 0.5).to(dtype) for _ in range(4)]
    pos = torch.stack([torch.randint(0, 40000, (T,)), torch.randint(0, 64, (T,)), torch.randint(0, 64, (T,))])
    pos[1:, : T // 2] = 0  # text tokens: h = w = 0
    return q, k, ws, pos


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 128), (8, 1, 16), (4, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_rope_matches_reference(rng, hq, hkv, d, dtype):
    q, k, ws, pos = _norm_rope_inputs(7, hq, hkv, d, dtype)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    qk_norm_rope_ref_(q1, k1, *ws, pos, 5e6, 1e4, 1e-6)
    qk_norm_rope_triton_(q2, k2, *ws, pos, 5e6, 1e4, 1e-6)
    assert_close(q2, q1)
    assert_close(k2, k1)


@pytest.mark.parametrize("block_t,heads", [(1, 8), (2, 4), (4, 2)])
def test_norm_rope_head_groups_and_strided_views(rng, block_t, heads):
    """Head counts a group does not divide (12 q, 3 kv heads), q and k strided views of one fused [q | k | v]
    projection, a token count the block does not divide."""
    T, hq, hkv, d = 9, 12, 3, 32
    qkv = torch.randn(T, (hq + 2 * hkv) * d).to(torch.float16)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hkv, d)
    _, _, ws, pos = _norm_rope_inputs(T, hq, hkv, d, torch.float16)
    q1, k1 = q.clone(), k.clone()
    v_before = qkv[:, (hq + hkv) * d:].clone()
    qk_norm_rope_ref_(q1, k1, *ws, pos, 5e6, 1e4, 1e-6)
    qk_norm_rope_triton_(q, k, *ws, pos, 5e6, 1e4, 1e-6, block_t=block_t, heads_per_program=heads)
    assert_close(q, q1)
    assert_close(k, k1)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched


def test_norm_rope_dispatch_forced_triton(rng, monkeypatch):
    q, k, ws, pos = _norm_rope_inputs(5, 8, 2, 16, torch.float32)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    qk_norm_rope_ref_(q1, k1, *ws, pos, 1e7, 1e4, 1e-6)
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    qk_norm_rope_(q2, k2, *ws, pos, 1e7, 1e4, 1e-6)
    assert_close(q2, q1)
    assert_close(k2, k1)


@pytest.mark.parametrize("T,pt", [(1, 4), (11, 4), (16, 8), (13, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_export_import_match_reference(rng, T, pt, dtype):
    L, S, hkv, d = 3, 40, 2, 16
    kv = torch.randn(L, 2, S, hkv, d).to(dtype)
    slots = torch.randperm(S)[:T].int()
    n_pages = -(-T // pt)
    page_ids = torch.randperm(n_pages + 3)[:n_pages].int()
    pages_ref = torch.full((n_pages + 3, L, 2, pt, hkv, d), float("nan"), dtype=dtype)
    pages_tri = pages_ref.clone()
    kv_export_ref(kv, slots, pages_ref, page_ids)
    kv_export_triton(kv, slots, pages_tri, page_ids)
    assert torch.equal(pages_ref.nan_to_num(7.0), pages_tri.nan_to_num(7.0))
    cap = T + 5
    dst_ref = torch.full((L, 2, cap, hkv, d), float("nan"), dtype=dtype)
    dst_tri = dst_ref.clone()
    kv_import_ref(pages_tri, page_ids, T, dst_ref)
    kv_import_triton(pages_tri, page_ids, T, dst_tri)
    assert torch.equal(dst_tri[:, :, :T], kv[:, :, slots.long()])
    assert torch.equal(dst_tri[:, :, :T], dst_ref[:, :, :T])
    assert dst_tri[:, :, T:].isnan().all()  # room for image tokens untouched


def test_kv_copy_dispatch_forced_triton(rng, monkeypatch):
    L, S, hkv, d, pt, T = 2, 30, 1, 128, 4, 9
    kv = torch.randn(L, 2, S, hkv, d).half()
    slots = torch.randperm(S)[:T].int()
    page_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    pages = torch.zeros(3, L, 2, pt, hkv, d).half()
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    kv_export(kv, slots, pages, page_ids)
    dst = torch.zeros(L, 2, T, hkv, d).half()
    kv_import(pages, page_ids, T, dst)
    assert torch.equal(dst, kv[:, :, slots.long()])


@pytest.mark.parametrize("T,hkv,d", [(1, 2, 16), (37, 2, 16), (70, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_index_copy(rng, monkeypatch, T, hkv, d, dtype):
    """A step's K/V rows, strided views of one fused projection [q | k | v], written at their slots."""
    S, hq = T + 20, 2 * hkv
    fused = torch.randn(T, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], dim=1)
    k, v = k.view(T, hkv, d), v.view(T, hkv, d)
    slots = torch.randperm(S)[:T]
    want = torch.randn(2, S, hkv, d).to(dtype)
    got = want.clone()
    kv_write_ref_(want, slots, k, v)
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    kv_write_(got, slots, k, v)
    assert torch.equal(got, want)
