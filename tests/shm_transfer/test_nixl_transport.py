"""The network transport (NIXL over UCX, TCP on loopback here) between two real processes: producer = this
process (the understanding side), consumer = a spawned peer (the generation side)."""
from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from shm_transfer import KVLayout
from shm_transfer.nixl_transport import NixlTransport, nixl_available
from tests.shm_transfer.shm_peer import Peer, PeerError, wire
from tests.waiting import wait_until

if not nixl_available():
    if os.environ.get("CI"):
        pytest.fail("NIXL is part of the test extra and must be installed in CI", pytrace=False)
    pytest.skip("NIXL not installed (pip install -e '.[network]')", allow_module_level=True)

pytestmark = pytest.mark.timeout(180)

FP = "tiny-u1:test-fingerprint"
LAY = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_tokens=4)


@pytest.fixture(scope="module", autouse=True)
def tcp_only():
    """Force UCX onto TCP and the consumer off the shared pool, as between two hosts without RDMA (the peers
    inherit both at spawn)."""
    forced = {"UCX_TLS": "tcp", "U1SERVE_KV_SAME_HOST_SHM": "0"}
    old = {k: os.environ.get(k) for k in forced}
    os.environ.update(forced)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def consumer(tcp_only):
    p = Peer()
    p.call("net_connect", expected_fingerprint=FP, claim_lease_s=1.5, heartbeat_s=0.3, connect_timeout_s=3.0)
    yield p
    p.stop()


@pytest.fixture
def producer():
    name = f"u1kv-test-{uuid.uuid4().hex[:12]}"
    t = NixlTransport.create(name, LAY, 12 * LAY.page_bytes, FP)
    yield t
    t.close()
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_is_bit_exact_and_release_frees_the_producers_pages(consumer, dtype):
    lay = KVLayout(3, 2, 8, dtype, 4)
    with NixlTransport.create(f"u1kv-test-{uuid.uuid4().hex[:12]}", lay, 12 * lay.page_bytes, FP) as producer:
        g = torch.Generator().manual_seed(0)
        kv_pool = torch.randn(lay.kv_shape(64), generator=g).to(lay.torch_dtype)  # the engine's paged KV
        for n in (1, 4, 13):
            slots = torch.randperm(64, generator=g)[:n].to(torch.int32)
            h = producer.allocate(n, lease_s=30, t_offset=n + 1)
            producer.export_kv(h, kv_pool, slots)
            d = wire(h)
            assert d["transport"] == "nixl" and d["producer"]["agent"].endswith(producer.pool.generation)
            got = consumer.call("net_import", d)
            assert torch.equal(got[:, :, :n], kv_pool[:, :, slots.long()])
            assert torch.isnan(got[:, :, n:].float()).all()  # the image-token room is untouched
            assert wait_until(lambda: producer.stats()["pages_used"] == 0)
        h = producer.allocate(6, lease_s=30)
        kv = torch.randn(lay.kv_shape(6)).to(lay.torch_dtype)
        producer.write_kv(h, kv)
        got = consumer.call("net_import", wire(h), release=False, heads=(1, 2))  # a TP rank: its heads only
        assert torch.equal(got[:, :, :6], kv[:, :, :, 1:2])
        consumer.call("net", "validate", wire(h))
        consumer.call("net", "release", wire(h))
        assert wait_until(lambda: producer.stats()["pages_used"] == 0)


def test_cancel_before_import(consumer, producer):
    h = producer.allocate(5, lease_s=30)
    producer.write_kv(h, torch.randn(LAY.kv_shape(5)))
    assert consumer.call("net", "release", wire(h)) == 2
    assert wait_until(lambda: producer.stats()["pages_used"] == 0)
    with pytest.raises(PeerError) as e:
        consumer.call("net_import", wire(h))
    assert e.value.code == "pages_freed"
    consumer.call("net", "release", wire(h))  # idempotent


def test_lease_expiry_and_reclaim(consumer, producer):
    h = producer.allocate(8, lease_s=1.0)
    producer.write_kv(h, torch.randn(LAY.kv_shape(8)))
    time.sleep(max(0.0, h.lease_left()) + 0.1)
    with pytest.raises(PeerError) as e:
        consumer.call("net_import", wire(h))
    assert e.value.code == "lease_expired"
    fresh = producer.allocate(40, lease_s=30)  # the whole pool: reclaims the expired pages
    assert producer.stats()["pages_reclaimed"] == 2
    with pytest.raises(PeerError) as e:
        consumer.call("net_import", wire(h))
    assert e.value.code == "pages_freed"
    producer.release(fresh)


def test_extend_lease_over_the_network(consumer, producer):
    h = producer.allocate(4, lease_s=1.0)
    consumer.call("net", "extend_lease", wire(h), 30.0)
    assert wait_until(lambda: producer.pool._deadline[list(h.page_ids)].min() > time.time() + 20)
    producer.release(h)


def test_killed_claimer_pages_are_reclaimed(tcp_only, producer):
    claimer = Peer()
    try:
        claimer.call("net_connect", expected_fingerprint=FP, claim_lease_s=1.5, heartbeat_s=0.3)
        h = producer.allocate(8, lease_s=1.0)
        kv = torch.randn(LAY.kv_shape(8))
        producer.write_kv(h, kv)
        claimer.call("net", "claim", wire(h))  # a queued job: held by heartbeats, not by the first lease
        time.sleep(2.5)
        producer.validate(h)
        assert torch.equal(claimer.call("net_import", wire(h), release=False)[:, :, :8], kv)
        claimer.kill()  # SIGKILL: the heartbeats stop
    finally:
        claimer.stop()
    assert wait_until(lambda: producer.stats()["pages_expired"] == 2, timeout=10)
    fresh = producer.allocate(40, lease_s=30)  # 10 of 12 pages: needs the dead claimer's 2
    assert producer.stats()["pages_reclaimed"] == 2
    producer.release(fresh)


def test_handle_checks_as_with_shm(consumer, producer):
    h = producer.allocate(3, lease_s=30)
    producer.write_kv(h, torch.randn(LAY.kv_shape(3)))
    for change, code in ((dict(model_fingerprint="other:model"), "fingerprint_mismatch"),
                         (dict(layout_version=1), "layout_version_mismatch"),
                         (dict(page_ids=(0, 1)), "malformed_handle"),
                         (dict(producer={}), "malformed_handle")):
        with pytest.raises(PeerError) as e:
            consumer.call("net_import", wire(h.replace(**change)))
        assert e.value.code == code, change
    d = wire(h)
    d["layout"]["head_dim"] = 16
    with pytest.raises(PeerError) as e:
        consumer.call("net_import", d)
    assert e.value.code == "layout_mismatch"
    producer.release(h)


def test_a_restarted_producer_does_not_answer_old_handles(consumer):
    name = f"u1kv-test-{uuid.uuid4().hex[:12]}"
    first = NixlTransport.create(name, LAY, 4 * LAY.page_bytes, FP)
    old = first.allocate(3, lease_s=30)
    first.close()
    with NixlTransport.create(name, LAY, 4 * LAY.page_bytes, FP) as second:
        with pytest.raises(PeerError) as e:
            consumer.call("net_import", wire(old))
        assert e.value.code == "producer_unreachable"
        h = second.allocate(3, lease_s=30)
        kv = torch.randn(LAY.kv_shape(3))
        second.write_kv(h, kv)
        assert torch.equal(consumer.call("net_import", wire(h))[:, :, :3], kv)


def test_same_host_consumer_moves_the_bytes_through_shared_memory(producer):
    """A consumer that sees the producer's /dev/shm maps the pool and imports like LocalShmTransport: the pool's
    shared import counter moves (a network read never touches it), claims are lock-based, release is at once."""
    peer = Peer()
    try:
        peer.call("net_connect", expected_fingerprint=FP, same_host_shm=True)
        kv = torch.randn(LAY.kv_shape(7))
        h = producer.allocate(7, lease_s=30)
        producer.write_kv(h, kv)
        peer.call("net", "claim", wire(h))
        assert producer.stats()["pages_claimed"] == 2
        got = peer.call("net_import", wire(h))
        assert torch.equal(got[:, :, :7], kv)
        assert producer.stats()["pages_used"] == 0          # released synchronously, not by a notification
        assert producer.stats()["bytes_imported_total"] == 7 * LAY.bytes_per_token
        h2 = producer.allocate(3, lease_s=30)
        peer.call("net", "claim", wire(h2))
        peer.kill()                                         # a killed same-host claimer: the lock tells
        assert producer.allocate(1, lease_s=30) is not None
        assert wait_until(lambda: producer.stats()["pages_used"] == 1)
    finally:
        peer.stop()
