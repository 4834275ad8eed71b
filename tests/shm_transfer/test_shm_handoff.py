"""KV handoff between the producer (this process) and a consumer peer: a spawned process for pages in shared memory,
a thread of this process for device pages (the two engines of a fused process); every test runs for both."""
from __future__ import annotations

import time

import pytest
import torch

from shm_transfer import (LAYOUT_VERSION, HandleError, KVHandle, KVLayout, PoolFull, export_kv,
                          import_kv, read_kv, write_kv)
from tests.shm_transfer.shm_peer import PeerError, make_pool, new_peer, wire
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

FP = "tiny-u1:test-fingerprint"


@pytest.fixture(scope="module")
def peer(pages):
    p = new_peer(pages)
    yield p
    p.stop()


def layout(dtype=torch.float32, page_tokens=4):
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_tokens=page_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_exact_across_processes(pages, peer, shm_name, dtype):
    lay = layout(dtype)
    with make_pool(pages, shm_name, lay, 40 * lay.page_bytes, FP) as pool:
        peer.call("attach", shm_name, expected_fingerprint=FP)
        g = torch.Generator().manual_seed(0)
        S = 64  # the understanding engine's paged pool: tokens scattered over slots
        kv_pool = torch.randn(lay.kv_shape(S), generator=g).to(dtype)
        expected, handles = [], []
        for n in (1, 3, 4, 5, 13):  # below, at and across page boundaries
            slots = torch.randperm(S, generator=g)[:n].to(torch.int32)
            h = pool.allocate(n, lease_s=30, branch="cond", t_offset=n + 1)
            export_kv(pool, h, kv_pool, slots)
            expected.append(kv_pool[:, :, slots.long()])
            handles.append(h)
        kv = torch.randn(lay.kv_shape(9), generator=g).to(dtype)  # contiguous path
        h = pool.allocate(9, lease_s=30, branch="uncond")
        write_kv(pool, h, kv)
        expected.append(kv)
        handles.append(h)

        got = peer.call("import_and_release", shm_name, [wire(h) for h in handles], cap_extra=3,
                        expected_fingerprint=FP)
        for want, dst, h in zip(expected, got, handles):
            assert dst.dtype == dtype
            assert torch.equal(dst[:, :, :h.num_tokens], want)  # bit-exact
            assert torch.isnan(dst[:, :, h.num_tokens:].float()).all()  # room for image tokens untouched
        assert pool.stats()["pages_used"] == 0  # consumer released everything
        st = pool.stats()
        total = sum(h.num_tokens for h in handles) * lay.bytes_per_token
        assert st["bytes_exported_total"] == total and st["bytes_imported_total"] == total
        assert st["process"]["export"]["count"] == len(handles)
        assert sum(st["process"]["export"]["bucket_counts"]) == len(handles)
        peer.call("close", shm_name)


def test_pool_full_then_success_after_release(pages, peer, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 4 * lay.page_bytes, FP) as pool:
        peer.call("attach", shm_name)
        a = pool.allocate(9, lease_s=30)  # 3 pages
        with pytest.raises(PoolFull) as e:
            pool.allocate(5, lease_s=30)  # needs 2, 1 free
        assert (e.value.pages_needed, e.value.pages_free, e.value.pages_total) == (2, 1, 4)
        with pytest.raises(PeerError) as pe:  # the other process sees the same state
            peer.call("allocate", shm_name, 5, 30)
        assert pe.value.cls_name == "PoolFull"
        with pytest.raises(PoolFull, match="larger than the whole pool"):
            pool.allocate(17, lease_s=30)
        assert peer.call("release", shm_name, wire(a)) == 3
        b = pool.allocate(5, lease_s=30)
        assert len(b.page_ids) == 2
        assert pool.stats()["allocation_failures"] == 3
        peer.call("close", shm_name)


def test_allocations_from_two_processes_never_overlap(pages, peer, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 64 * lay.page_bytes, FP) as pool:
        peer.call("attach", shm_name)
        theirs = peer.call("allocate_until_full", shm_name, 4, 30)
        mine = []
        try:
            while True:
                mine.append(pool.allocate(4, 30))
        except PoolFull:
            pass
        ids = [p for d in theirs for p in d["page_ids"]] + [p for h in mine for p in h.page_ids]
        assert sorted(ids) == list(range(64))
        handle_ids = [d["handle_id"] for d in theirs] + [h.handle_id for h in mine]
        assert len(set(handle_ids)) == len(handle_ids)
        peer.call("close", shm_name)


def test_release_is_idempotent_and_never_frees_another_handles_pages(pages, peer, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 2 * lay.page_bytes, FP) as pool:
        peer.call("attach", shm_name)
        a = pool.allocate(8, lease_s=30)
        assert peer.call("release", shm_name, wire(a)) == 2
        assert pool.release(a) == 0
        assert peer.call("release", shm_name, wire(a)) == 0
        b = pool.allocate(8, lease_s=30)  # same pages, new owner
        assert set(b.page_ids) == set(a.page_ids)
        assert pool.release(a) == 0  # a stale release must not free b's pages
        assert pool.stats()["pages_used"] == 2
        with pytest.raises(HandleError) as e:
            pool.validate(a)
        assert e.value.code == "pages_freed"
        assert pool.release(b) == 2
        peer.call("close", shm_name)


def test_extend_lease_never_shortens(pages, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 3 * lay.page_bytes, FP) as pool:
        h = pool.allocate(12, lease_s=30)
        assert pool.extend_lease(h, 0.01).lease_deadline >= h.lease_deadline
        time.sleep(0.05)
        pool.validate(h)  # still leased: the short extension did not cut the 30 s lease
        assert pool.extend_lease(h, 60).lease_deadline > h.lease_deadline + 20
        pool.release(h)


def test_lease_expiry_reclaims_pages_of_killed_consumer(pages, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 3 * lay.page_bytes, FP) as pool:
        consumer = new_peer(pages)   # started first: a slow spawn must not eat the lease
        try:
            consumer.call("attach", shm_name)
            h = pool.allocate(12, lease_s=4.0)
            write_kv(pool, h, torch.randn(lay.kv_shape(12)))
            consumer.call("extend_lease", shm_name, wire(h), 1.0)  # the consumer took it over ...
            consumer.kill()  # ... and died before importing and releasing
        finally:
            consumer.stop()
        assert pool.stats()["pages_used"] == 3
        with pytest.raises(PoolFull):
            pool.allocate(1, lease_s=30)
        assert wait_until(lambda: pool.stats()["pages_expired"] == 3)
        with pytest.raises(HandleError) as e:
            read_kv(pool, h)
        assert e.value.code == "lease_expired"
        fresh = pool.allocate(12, lease_s=30)  # reclaims the dead consumer's pages
        st = pool.stats()
        assert st["pages_reclaimed"] == 3 and st["pages_used"] == 3
        with pytest.raises(HandleError) as e:
            pool.validate(h)
        assert e.value.code == "pages_freed"
        pool.release(fresh)


def test_handle_errors_are_clear(pages, peer, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 4 * lay.page_bytes, FP) as pool:
        peer.call("attach", shm_name)
        h = pool.allocate(5, lease_s=30)
        write_kv(pool, h, torch.randn(lay.kv_shape(5)))

        def rejected(d, **kw):
            with pytest.raises(PeerError) as e:
                peer.call("read", shm_name, d, **kw)
            assert e.value.cls_name == "HandleError"
            return e.value

        e = rejected(wire(h), expected_fingerprint="another-model")
        assert e.code == "fingerprint_mismatch" and "another-model" in e.message and FP in e.message
        e = rejected({**wire(h), "model_fingerprint": "another-model"})
        assert e.code == "fingerprint_mismatch"
        e = rejected({**wire(h), "layout_version": LAYOUT_VERSION + 1})
        assert e.code == "layout_version_mismatch" and "layout_version" in e.message
        e = rejected({**wire(h), "pool_generation": "0123456789abcdef"})
        assert e.code == "stale_generation" and "restarted" in e.message
        e = rejected({**wire(h), "pool_name": "elsewhere"})
        assert e.code == "wrong_pool"
        e = rejected({**wire(h), "layout": {**h.layout, "head_dim": 16}})
        assert e.code == "layout_mismatch"
        e = rejected({**wire(h), "num_tokens": 9})
        assert e.code == "malformed_handle"
        e = rejected({k: v for k, v in wire(h).items() if k != "page_ids"})
        assert e.code == "malformed_handle" and "page_ids" in e.message
        with pytest.raises(HandleError, match="must be a JSON object"):
            KVHandle.from_dict([1, 2])
        pool.validate(h, FP)
        with pytest.raises(HandleError, match="another-model"):
            pool.validate(h, "another-model")

        # bad destination buffers are ValueErrors (caller bug), checked after the handle
        with pytest.raises(ValueError, match="at least 5"):
            import_kv(pool, h, torch.empty(lay.kv_shape(4)))
        with pytest.raises(ValueError, match="dtype"):
            import_kv(pool, h, torch.empty(lay.kv_shape(8), dtype=torch.float64))
        assert torch.equal(peer.call("read", shm_name, wire(h), expected_fingerprint=FP), read_kv(pool, h))
        pool.release(h)
        e = rejected(wire(h))
        assert e.code == "pages_freed"
        peer.call("close", shm_name)


def test_attach_rejects_pool_of_another_model(pages, peer, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 2 * lay.page_bytes, FP):
        with pytest.raises(PeerError) as e:
            peer.call("attach", shm_name, expected_fingerprint="another-model")
        assert e.value.cls_name == "PoolError" and "another-model" in e.value.message
    with pytest.raises(PeerError) as e:
        peer.call("attach", shm_name + "-missing", timeout_s=0.2)
    assert e.value.cls_name == "PoolError" and "does not exist" in e.value.message


def test_release_during_import_is_detected(pages, shm_name):
    """A handle released (e.g. by the gateway) while the consumer copies must not yield torn KV silently."""
    lay = layout()
    with make_pool(pages, shm_name, lay, 2 * lay.page_bytes, FP) as pool:
        h = pool.allocate(6, lease_s=30)
        write_kv(pool, h, torch.randn(lay.kv_shape(6)))
        token = pool.guard_copy(h, 30.0, FP)
        pool.release(h)
        with pytest.raises(HandleError, match="released during the copy"):
            pool.end_copy(h, token)


def test_copy_guard_does_not_extend_the_lease(pages, shm_name):
    lay = layout()
    with make_pool(pages, shm_name, lay, 2 * lay.page_bytes, FP) as pool:
        h = pool.allocate(6, lease_s=5)
        write_kv(pool, h, torch.randn(lay.kv_shape(6)))
        read_kv(pool, h)
        deadlines = pool._deadline[list(h.page_ids)]
        assert (deadlines == h.lease_deadline).all()


def test_roundtrip_through_triton_kernels_interpreted(pages, shm_name, monkeypatch):
    """The GPU code path (Triton copy kernels) on CPU via TRITON_INTERPRET, same pool and handles."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    lay = layout(torch.bfloat16)
    with make_pool(pages, shm_name, lay, 8 * lay.page_bytes, FP) as pool:
        g = torch.Generator().manual_seed(1)
        kv_pool = torch.randn(lay.kv_shape(32), generator=g).to(torch.bfloat16)
        slots = torch.randperm(32, generator=g)[:7].to(torch.int32)
        h = pool.allocate(7, lease_s=30)
        export_kv(pool, h, kv_pool, slots)
        dst = torch.zeros(lay.kv_shape(10), dtype=torch.bfloat16)
        import_kv(pool, h, dst, expected_fingerprint=FP)
        assert torch.equal(dst[:, :, :7], kv_pool[:, :, slots.long()])
        assert not dst[:, :, 7:].any()


def use_kernels(monkeypatch, mode: str) -> None:
    """mode "ref": the torch copies; "triton-interpret": the GPU code path's Triton kernels, interpreted on the CPU."""
    if mode == "triton-interpret":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("U1SERVE_KERNELS", "triton")


@pytest.mark.parametrize("mode", ["ref", "triton-interpret"])
def test_tensor_parallel_ranks_export_their_head_slices(pages, peer, shm_name, monkeypatch, mode):
    """Two producer ranks (this process and the peer) each write their KV heads into the same pages."""
    use_kernels(monkeypatch, mode)
    lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_tokens=4)
    with make_pool(pages, shm_name, lay, 4 * lay.page_bytes, FP) as pool:
        peer.call("attach", shm_name)
        full = torch.randn(lay.kv_shape(6))
        h = pool.allocate(6, lease_s=30)
        peer.call("write", shm_name, wire(h), full[:, :, :, 2:4].contiguous(), heads=(2, 4))  # rank 1
        kv_pool = torch.zeros(lay.kv_shape(16)[:3] + (2, 8))  # rank 0's paged pool: heads 0..1
        slots = torch.tensor([9, 3, 15, 0, 7, 11], dtype=torch.int32)
        kv_pool[:, :, slots.long()] = full[:, :, :, 0:2]
        export_kv(pool, h, kv_pool, slots, heads=(0, 2))
        assert torch.equal(read_kv(pool, h), full)
        half = torch.zeros(lay.kv_shape(8)[:3] + (2, 8))
        import_kv(pool, h, half, heads=(2, 4))  # a consumer rank that holds heads 2..3
        assert torch.equal(half[:, :, :6], full[:, :, :, 2:4])
        with pytest.raises(ValueError, match="heads"):
            export_kv(pool, h, kv_pool, slots, heads=(1, 5))
        peer.call("close", shm_name)


@pytest.mark.parametrize("mode", ["ref", "triton-interpret"])
def test_warm_export_runs_the_export_kernel_and_writes_no_page_of_the_pool(pages, shm_name, monkeypatch, mode):
    """What the understanding engine does before ready (shm_transfer.copy.warm_export): the export kernel runs, from a
    scratch slot into scratch pages, for a full and a tensor-parallel rank's head slice; the pool's pages and page
    table are as they were, and a live handle's KV reads back unchanged."""
    import shm_transfer.copy as copy_mod
    from shm_transfer.copy import WARM_COPY_TOKENS, warm_export
    use_kernels(monkeypatch, mode)
    real, copied = copy_mod._kernel_export, []

    def export_and_check(kv_pool, slots, pages, page_ids):      # the real kernel; then what it wrote, read back
        out = real(kv_pool, slots, pages, page_ids)
        n, pt = slots.numel(), pages.shape[3]
        rows = torch.stack([pages[int(page_ids[t // pt]), :, :, t % pt] for t in range(n)], dim=2)
        assert torch.equal(rows, kv_pool[:, :, slots.long()])
        copied.append(n)
        return out

    monkeypatch.setattr(copy_mod, "_kernel_export", export_and_check)
    lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_tokens=4)
    with make_pool(pages, shm_name, lay, 24 * lay.page_bytes, FP) as pool:
        h = pool.allocate(6, lease_s=30)
        kv = torch.randn(lay.kv_shape(6))
        write_kv(pool, h, kv)
        pool.pages[pool.layout.pages_for(6):] = 7.0        # every free page: a value the warm-up must leave alone
        before_pages, before = pool.pages.clone(), pool.stats()
        kv_pool = torch.randn(lay.kv_shape(17))
        copied.clear()                                         # write_kv above ran the kernel too
        assert warm_export(pool, kv_pool, 16) >= 0
        assert warm_export(pool, kv_pool[:, :, :, 2:4].contiguous(), 16, heads=(2, 4)) >= 0
        assert copied == 2 * list(WARM_COPY_TOKENS)          # each token-count specialisation, each call
        assert torch.equal(pool.pages, before_pages)
        after = pool.stats()
        for k in ("pages_used", "handles_live", "allocations", "pages_released", "bytes_exported_total"):
            assert after.get(k) == before.get(k), k
        assert torch.equal(read_kv(pool, h), kv)
        with pytest.raises(ValueError, match="heads"):
            warm_export(pool, kv_pool, 16, heads=(3, 5))
