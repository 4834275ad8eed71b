"""Segment lifetimes across real processes: nothing leaks in /dev/shm, restarts invalidate old handles."""
from __future__ import annotations

import json
import os

import pytest
import torch

from shm_transfer import HandleError, KVHandle, KVLayout, ShmKVPool, read_kv, write_kv
from tests.shm_transfer.shm_peer import PeerError, make_pool, new_peer, wire

pytestmark = pytest.mark.timeout(120)

FP = "tiny-u1:test-fingerprint"
LAY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_tokens=4)


def shm_exists(name):
    return os.path.exists(os.path.join("/dev/shm", name))


def test_consumer_exit_does_not_unlink_and_creator_close_does(pages, shm_name):
    pool = make_pool(pages, shm_name, LAY, 4 * LAY.page_bytes, FP)
    consumer = new_peer(pages)
    try:
        consumer.call("attach", shm_name)
    finally:
        consumer.stop()  # a clean consumer exit: the segment must stay
    assert shm_exists(shm_name)
    h = pool.allocate(3, 30)
    write_kv(pool, h, torch.ones(LAY.kv_shape(3)))
    assert torch.equal(read_kv(pool, h), torch.ones(LAY.kv_shape(3)))
    pool.close()
    assert not shm_exists(shm_name)
    pool.close()  # idempotent


def test_unlink_then_close(pages, shm_name):
    pool = make_pool(pages, shm_name, LAY, 4 * LAY.page_bytes, FP)
    views = pool.pages  # a view held past close must not crash close()
    pool.unlink()
    assert not shm_exists(shm_name)
    pool.allocate(1, 30)  # the mapping stays usable until close()
    pool.close()
    del views


def test_creator_process_exit_unlinks(pages, shm_name):
    creator = new_peer(pages)
    creator.call("create", shm_name, LAY.to_dict(), 4 * LAY.page_bytes, FP, pages)
    assert shm_exists(shm_name)
    creator.stop()  # normal interpreter exit: the creator's finalizer unlinks
    assert not shm_exists(shm_name)


def test_killed_creator_is_replaced_and_its_handles_rejected(pages, shm_name):
    creator = new_peer(pages)
    consumer = new_peer(pages)
    try:
        old_gen = creator.call("create", shm_name, LAY.to_dict(), 4 * LAY.page_bytes, FP, pages)
        old_handle = creator.call("allocate", shm_name, 5, 30)
        creator.call("write", shm_name, old_handle, torch.randn(LAY.kv_shape(5)))
        consumer.call("attach", shm_name, expected_fingerprint=FP, transport=True)
        creator.kill()
        assert shm_exists(shm_name)  # SIGKILL: no cleanup ran

        with make_pool(pages, shm_name, LAY, 4 * LAY.page_bytes, FP) as pool:  # the restarted producer
            assert pool.generation != old_gen
            with pytest.raises(HandleError) as e:
                pool.validate(KVHandle.from_dict(old_handle))
            assert e.value.code == "stale_generation"
            # the consumer still maps the old segment; a new-generation handle makes it re-attach
            h = pool.allocate(6, 30)
            kv = torch.randn(LAY.kv_shape(6))
            write_kv(pool, h, kv)
            got, gen = consumer.call("import_via_transport", shm_name, wire(h))
            assert gen == pool.generation and torch.equal(got, kv)
            with pytest.raises(PeerError) as pe:
                consumer.call("import_via_transport", shm_name, old_handle)
            assert pe.value.code == "stale_generation"
            assert pool.stats()["pages_used"] == 0
        assert not shm_exists(shm_name)
    finally:
        creator.stop()
        consumer.stop()


def test_create_validates_size_and_name(pages, shm_name):
    from shm_transfer import PoolError
    with pytest.raises(PoolError, match="smaller than one page"):
        make_pool(pages, shm_name, LAY, LAY.page_bytes - 1, FP)
    with pytest.raises(ValueError, match="bad shared-memory name"):
        ShmKVPool.create("a/b", LAY, LAY.page_bytes, FP)
    with pytest.raises(PoolError, match="GiB"):
        make_pool(pages, shm_name, LAY, 1 << 50, FP)  # more than /dev/shm (or the device) has


def test_layout_and_handle_json_roundtrip():
    lay = KVLayout(36, 8, 128, torch.bfloat16, 256)
    assert lay.dtype == "bfloat16" and lay.bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert KVLayout.from_dict(json.loads(lay.to_json())) == lay
    with pytest.raises(ValueError):
        KVLayout(0, 8, 128, "bfloat16", 256)
    with pytest.raises(ValueError):
        KVLayout(1, 8, 128, "int8", 256)
