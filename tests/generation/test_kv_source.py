"""PrefixSource (generation's side of the Transport) against real producer processes: a replaced pool is
dropped promptly, claims hold queued jobs' pages, imports release."""
from __future__ import annotations

import os
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
