"""PrefixSource (generation's side of the Transport) against real producer processes: a replaced pool is
dropped promptly, claims hold queued jobs' pages, imports release."""
from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from services.generation.kv_source import PrefixSource
from services.kit.errors import APIError
from shm_transfer import KVLayout, ShmKVPool, write_kv
from tests.shm_transfer.shm_peer import Peer

pytestmark = pytest.mark.timeout(120)
FP = "tiny-u1:test-fingerprint"
LAY = KVLayout(2, 1, 4, "float32", 4)


@pytest.fixture
def name():
    n = f"u1gen-src-{uuid.uuid4().hex[:10]}"
    yield n
    for f in os.listdir("/dev/shm"):
        if f.startswith(n):
            os.unlink(os.path.join("/dev/shm", f))


def test_a_replaced_pool_is_dropped_when_idle_and_the_new_one_used(name):
    producer = Peer()
    try:
        producer.call("create", name, LAY.to_dict(), 4 * LAY.page_bytes, FP)
        src = PrefixSource(name, FP, torch.device("cpu"))
        old = src.pool()
        assert not src.is_stale() and not src.drop_stale()
        producer.kill()  # the understanding service dies; its restart replaces the pool
        with ShmKVPool.create(name, LAY, 4 * LAY.page_bytes, FP) as fresh:
            assert src.is_stale()
            assert src.drop_stale() and old.closed and not src.is_stale()  # unmapped at once
            h = fresh.allocate(5, 30)
            kv = torch.randn(LAY.kv_shape(5))
            write_kv(fresh, h, kv)
            dst = torch.zeros(LAY.kv_shape(7))
            src.import_into(h, dst)  # attaches the new pool on demand
            assert torch.equal(dst[:, :, :5], kv) and fresh.stats()["pages_used"] == 0
            src.close()
    finally:
        producer.stop()


def test_claim_holds_a_queued_jobs_pages_past_the_lease(name):
    with ShmKVPool.create(name, LAY, 4 * LAY.page_bytes, FP) as pool:
        src = PrefixSource(name, FP, torch.device("cpu"))
        h = pool.allocate(5, lease_s=0.5)
        src.claim([h.to_dict()])
        time.sleep(0.7)
        pool.validate(h)  # still ours: claimed
        src.release([h.to_dict()])
        assert pool.stats()["pages_used"] == 0
        src.close()


def test_missing_pool_is_a_503(name):
    src = PrefixSource(name, FP, torch.device("cpu"), attach_timeout_s=0.1)
    with pytest.raises(APIError) as e:
        src.pool()
    assert e.value.status == 503 and e.value.code == "kv_pool_unavailable"
    src.release([{"not": "a handle"}])  # best effort, never raises


def test_without_its_own_pool_it_opens_the_pool_a_handle_names(name):
    """A Ray replica's generation engine (follow_handles): no understanding service made a pool of its name; its
    neighbours' pools (one per understanding replica on the node) are named by the handles. Without follow_handles
    (u1serve up) a handle of another pool is refused: 503, the stack reads only the pool it was given."""
    with ShmKVPool.create(f"{name}-und", LAY, 4 * LAY.page_bytes, FP) as pool:
        strict = PrefixSource(f"{name}-own", FP, torch.device("cpu"), attach_timeout_s=0.1)
        other = pool.allocate(2, 30)
        with pytest.raises(APIError) as e:
            strict.import_into(other, torch.zeros(LAY.kv_shape(2)))
        assert e.value.status == 503 and e.value.code == "kv_pool_unavailable"
        pool.release(other)
        strict.close()
        src = PrefixSource(f"{name}-own", FP, torch.device("cpu"), attach_timeout_s=0.1, follow_handles=True)
        held, h = pool.allocate(3, lease_s=0.5), pool.allocate(5, 30)
        src.claim([held.to_dict()])
        time.sleep(0.7)
        pool.validate(held)            # claimed through the handle's pool
        kv = torch.randn(LAY.kv_shape(5))
        write_kv(pool, h, kv)
        dst = torch.zeros(LAY.kv_shape(7))
        src.import_into(h, dst)
        assert torch.equal(dst[:, :, :5], kv)
        src.release([held.to_dict()])
        assert pool.stats()["pages_used"] == 0
        src.close()


def test_open_before_ready_waits_for_the_pool_and_warms_without_touching_pages(name):
    """Start-up: the producer creates the pool a moment after the engine began to wait: it is opened then (before
    ready); the import warm-up reads pool memory but leaves every page, lease and counter as it was."""
    made: list = []
    later = threading.Timer(0.3, lambda: made.append(ShmKVPool.create(name, LAY, 4 * LAY.page_bytes, FP)))
    later.start()
    src = PrefixSource(name, FP, torch.device("cpu"), geometry=(2, 1, 4, torch.float32))
    try:
        t0 = time.monotonic()
        report = src.open_before_ready(30)
        assert time.monotonic() - t0 < 10
        later.join(10)     # the pool is readable (magic + READY) before create() returns to the timer's append
        assert made
        assert report["attached"] and report["before_ready"] and report["pool"] == name
        assert report["seconds"] >= 0 and report["warm_import_seconds"] >= 0 and report["detail"] is None
        pool = made[0]
        h = pool.allocate(5, 30)
        kv = torch.randn(LAY.kv_shape(5))
        write_kv(pool, h, kv)
        before = pool.stats()
        from shm_transfer.copy import warm_import
        warm_import(src.pool(), torch.device("cpu"))
        after = pool.stats()
        for k in ("pages_used", "handles_live", "allocations", "pages_released", "bytes_imported_total"):
            assert after[k] == before[k], k
        pool.validate(h)
        dst = torch.zeros(LAY.kv_shape(5))
        src.import_into(h, dst)
        assert torch.equal(dst, kv) and pool.stats()["pages_used"] == 0
    finally:
        later.cancel()
        src.close()
        for p in made:
            p.close()


def test_open_before_ready_without_a_producer_is_bounded_then_lazy(name):
    """No producer: start-up goes on after the bounded wait (never raises); the first handle opens the pool and
    /health hears of it. A producer restart: the idle engine drops the old pool and opens the new one once it is
    there (reported each time); a job in between would open it itself."""
    src = PrefixSource(name, FP, torch.device("cpu"), attach_timeout_s=0.1)
    heard: list[dict] = []
    t0 = time.monotonic()
    report = src.open_before_ready(0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert not report["attached"] and report["waited_s"] >= 0.3 and "first request" in report["detail"]
    src.on_change = heard.append
    try:
        assert not src.drop_stale() and not heard     # idle, no pool yet: nothing to tell
        with ShmKVPool.create(name, LAY, 4 * LAY.page_bytes, FP) as pool:
            h = pool.allocate(3, 30)
            src.import_into(h, torch.zeros(LAY.kv_shape(3)))
            assert heard[-1]["attached"] and not heard[-1]["before_ready"]
        assert src.drop_stale() and not heard[-1]["attached"] and "replaced" in heard[-1]["detail"]
        assert not src.drop_stale()                   # still gone: nothing happens
        with ShmKVPool.create(name, LAY, 4 * LAY.page_bytes, FP) as fresh:   # the producer is back
            assert not src.drop_stale() and heard[-1]["attached"] and heard[-1]["warm_import_seconds"] is not None
            src.import_into(fresh.allocate(3, 30), torch.zeros(LAY.kv_shape(3)))
            assert fresh.stats()["pages_used"] == 0
    finally:
        src.close()


def test_open_before_ready_leaves_a_pool_of_another_shape_to_the_first_request(name):
    with ShmKVPool.create(name, LAY, 4 * LAY.page_bytes, FP):
        src = PrefixSource(name, FP, torch.device("cpu"), geometry=(2, 2, 4, torch.float32))
        report = src.open_before_ready(5)
        assert not report["attached"] and "kv heads" in report["detail"]
        assert not src.drop_stale() and not src.report["attached"]     # idle looks never take it
        with pytest.raises(APIError) as e:
            src.pool()
        assert e.value.code == "kv_pool_mismatch"
        src.close()
