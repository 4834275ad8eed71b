"""One consumer, several producers on one host (understanding replicas, one pool each): a LocalShmTransport
consumer follows each handle to its own pool, and says clearly when that pool is not on this host."""
from __future__ import annotations

import pytest
import torch

from shm_transfer import LocalShmTransport, KVLayout
from tests.shm_transfer.shm_peer import Peer, PeerError, wire

pytestmark = pytest.mark.timeout(120)

FP = "tiny-u1:test-fingerprint"
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_tokens=4)


def test_a_consumer_imports_from_every_pool_of_its_host(shm_name):
    a, b = shm_name + "-a", shm_name + "-b"
    peer = Peer()
    try:
        with LocalShmTransport.create(a, LAY, 8 * LAY.page_bytes, FP) as pa, \
                LocalShmTransport.create(b, LAY, 8 * LAY.page_bytes, FP) as pb:
            peer.call("attach", a, expected_fingerprint=FP, transport=True)
            torch.manual_seed(0)
            for producer in (pa, pb):
                kv = torch.randn(LAY.kv_shape(6))
                h = producer.allocate(6, lease_s=30)
                producer.write_kv(h, kv)
                got, _ = peer.call("import_via_transport", a, wire(h))
                assert torch.equal(got, kv)
                assert producer.stats()["pages_used"] == 0       # released into the right pool
            h = pb.allocate(2, lease_s=30)
            with pytest.raises(PeerError) as e:
                peer.call("import_via_transport", a, {**wire(h), "pool_name": shm_name + "-elsewhere"})
            assert e.value.code == "pool_unavailable" and "not on this host" in e.value.message
    finally:
        peer.stop()


def test_a_consumer_allocates_beside_a_handle_of_another_pool(shm_name):
    """What generation does with an interleaved answer's float image: the pages go into the pool of the job's
    prefix (the understanding replica that reads them back), not into the consumer's own pool."""
    a, b = shm_name + "-a", shm_name + "-b"
    with LocalShmTransport.create(a, LAY, 8 * LAY.page_bytes, FP) as pa, \
            LocalShmTransport.create(b, LAY, 8 * LAY.page_bytes, FP) as pb, \
            LocalShmTransport.attach(a, expected_fingerprint=FP) as consumer:
        near = pb.allocate(2, lease_s=30)
        h = consumer.allocate(3, lease_s=30, branch="image", near=near)
        assert h.pool_name == b and pb.stats()["pages_used"] == 2 and pa.stats()["pages_used"] == 0
        kv = torch.randn(LAY.kv_shape(3))
        consumer.write_kv(h, kv)
        assert torch.equal(pb.read_kv(h), kv)
        consumer.release(h)
        pb.release(near)
        assert pb.stats()["pages_used"] == 0
        assert consumer.allocate(1, lease_s=30).pool_name == a      # without `near`: its own pool
