"""Who may replace, unlink and reclaim what: owner checks with real (and really killed) processes."""
from __future__ import annotations

import os
import time

import pytest
import torch

from shm_transfer import HandleError, KVLayout, PoolError, PoolFull, ShmKVPool, read_kv, unlink_exact, write_kv
from shm_transfer.segment import reclaim_orphans
from tests.shm_transfer.shm_peer import make_pool, new_peer, wire
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

FP = "tiny-u1:test-fingerprint"
LAY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_tokens=4)


def test_create_refuses_a_live_creators_pool_and_reclaims_a_killed_ones(pages, shm_name):
    other = new_peer(pages)  # another stack's understanding service
    try:
        gen = other.call("create", shm_name, LAY.to_dict(), 4 * LAY.page_bytes, FP, pages)
        with pytest.raises(PoolError, match=f"live process \\(creator pid {other.pid}\\)"):
            make_pool(pages, shm_name, LAY, 4 * LAY.page_bytes, FP)
        with ShmKVPool.attach(shm_name) as still:  # untouched
            assert still.generation == gen
        other.kill()  # SIGKILL: no cleanup ran, the segment stays ...
        assert os.path.exists(f"/dev/shm/{shm_name}")
        with make_pool(pages, shm_name, LAY, 4 * LAY.page_bytes, FP) as pool:  # ... and is reclaimed
            assert pool.generation != gen
            with pytest.raises(PoolError, match=f"creator pid {os.getpid()}"):
                make_pool(pages, shm_name, LAY, 4 * LAY.page_bytes, FP)  # our own live pool: refused too
    finally:
        other.stop()


def test_reclaim_orphans_removes_only_dead_creators_segments_of_the_prefix(pages, shm_name):
    """What a Ray replica sweeps at start (services/ray_serve/engine.py): pools of replicas killed with their node."""
    dead, live = f"{shm_name}-dead", f"{shm_name}-live"
    killed, alive = new_peer("shm"), new_peer("shm")       # two processes, whatever `pages` is
    try:
        killed.call("create", dead, LAY.to_dict(), 2 * LAY.page_bytes, FP, "shm")
        alive.call("create", live, LAY.to_dict(), 2 * LAY.page_bytes, FP, "shm")
        killed.kill()
        removed = reclaim_orphans(f"{shm_name}-")
        assert dead in removed and not os.path.exists(f"/dev/shm/{dead}")
        assert os.path.exists(f"/dev/shm/{live}")           # its creator lives
        assert reclaim_orphans(f"{shm_name}-dead") == []       # idempotent
    finally:
        alive.stop()
        killed.stop()
        unlink_exact(live)


def test_unlink_exact_leaves_other_stacks_segments(pages, shm_name):
    others = [f"{shm_name}-4242-8000", f"{shm_name}.old"]
    with make_pool(pages, shm_name, LAY, 2 * LAY.page_bytes, FP) as pool:
        for n in others:
            open(f"/dev/shm/{n}", "wb").close()
        try:
            assert unlink_exact(shm_name)
            assert not os.path.exists(f"/dev/shm/{shm_name}")
            assert all(os.path.exists(f"/dev/shm/{n}") for n in others)
            assert not unlink_exact(shm_name)  # idempotent
            pool.allocate(1, 30)  # our mapping is unaffected
        finally:
            for n in others:
                os.unlink(f"/dev/shm/{n}")
    with pytest.raises(ValueError):
        unlink_exact("../etc/passwd")


def test_claimed_pages_outlive_the_lease_until_the_claimer_is_killed(pages, shm_name):
    with make_pool(pages, shm_name, LAY, 3 * LAY.page_bytes, FP) as pool:
        claimer = new_peer(pages)  # the generation service accepting a queued job
        try:
            claimer.call("attach", shm_name)
            h = pool.allocate(8, lease_s=1.0)  # 2 pages, a short lease
            kv = torch.randn(LAY.kv_shape(8))
            write_kv(pool, h, kv)
            claimer.call("claim", shm_name, wire(h))
            time.sleep(max(0.0, h.lease_left()) + 0.2)  # the lease is over, the claim holds
            other = pool.allocate(4, lease_s=30)  # takes the one free page, reclaims nothing
            assert pool.stats()["pages_reclaimed"] == 0 and pool.stats()["pages_claimed"] == 2
            with pytest.raises(PoolFull):
                pool.allocate(1, lease_s=30)
            assert torch.equal(read_kv(pool, h), kv)
            claimer.kill()  # SIGKILL while holding the claim
        finally:
            claimer.stop()
        assert pool.stats()["pages_expired"] == 2
        with pytest.raises(HandleError) as e:
            pool.validate(h)
        assert e.value.code == "lease_expired" and "claimed it died" in str(e.value)
        fresh = pool.allocate(8, lease_s=30)  # reclaims the dead claimer's pages
        assert pool.stats()["pages_reclaimed"] == 2
        pool.release(fresh)
        pool.release(other)


def test_a_new_process_in_a_dead_claimers_slot_does_not_revive_its_claims(pages, shm_name):
    with make_pool(pages, shm_name, LAY, 2 * LAY.page_bytes, FP) as pool:
        first = new_peer(pages)
        try:
            first.call("attach", shm_name)
            a, b = pool.allocate(4, lease_s=1.0), pool.allocate(4, lease_s=30)
            first.call("claim", shm_name, wire(a))
            first.kill()
        finally:
            first.stop()
        second = new_peer(pages)  # takes the freed slot (same lock byte), with a new nonce
        try:
            second.call("attach", shm_name)
            second.call("claim", shm_name, wire(b))
            assert wait_until(lambda: pool.stats()["pages_expired"] == 1)
            assert pool.stats()["pages_claimed"] == 1
            second.call("release", shm_name, wire(b))  # release works on claimed pages as usual
            assert pool.stats()["pages_used"] == 0
        finally:
            second.stop()


def test_claim_ends_when_the_claimer_closes_the_pool(pages, shm_name):
    with make_pool(pages, shm_name, LAY, 2 * LAY.page_bytes, FP) as pool:
        h = pool.allocate(4, lease_s=0.2)
        with ShmKVPool.attach(shm_name) as consumer:
            consumer.claim(h)
            time.sleep(0.3)
            consumer.validate(h)
            pool.validate(h)  # the creator sees the claim of another open of the segment
        assert pool.stats()["pages_expired"] == 1
