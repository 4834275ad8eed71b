"""The device transport: both engines in one process, the prefix's pages a tensor on their device.

In-process: understanding's side (create_producer "device", an engine rank's attach_exporter) and generation's
(PrefixSource: claim, import, release) on two threads, bit-exact, nothing left held; a producer restart. Another
process: refused with a clear error wherever it would touch the pages (never garbage), while the page table still
answers. On CPU the "device" is the CPU (the code path is the same); on a GPU the CUDA test runs it there.
"""
from __future__ import annotations

import os
import queue
import threading

import pytest
import torch

from services.generation.kv_source import PrefixSource
from shm_transfer import DeviceTransport, HandleError, KVHandle, KVLayout, LocalShmTransport, PoolError
from shm_transfer.producer import attach_exporter, create_producer
from tests.shm_transfer.shm_peer import Peer, PeerError, wire

pytestmark = pytest.mark.timeout(120)

FP = "tiny-u1:test-fingerprint"
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_tokens=4)


def _export(exporter, producer, kv_pool: torch.Tensor, n: int, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    """What understanding does for one prefix: allocate (HTTP side), export the engine's slots (engine side)."""
    slots = torch.randperm(kv_pool.shape[2], generator=g)[:n].to(torch.int32).to(kv_pool.device)
    h = producer.allocate(n, lease_s=30, t_offset=n + 1)
    exporter.export_kv(h, kv_pool, slots)
    return wire(h), kv_pool[:, :, slots.long()].clone()


def test_producer_and_consumer_threads_of_one_process(shm_name):
    producer = create_producer("device", shm_name, LAY, 64 * LAY.page_bytes, FP, device="cpu")
    exporter = attach_exporter(shm_name, FP)         # the understanding engine's thread
    source = PrefixSource(shm_name, FP, torch.device("cpu"), geometry=(2, 2, 4, torch.float32))
    published: queue.SimpleQueue = queue.SimpleQueue()
    got: list = []
    try:
        def understanding():
            g = torch.Generator().manual_seed(0)
            kv_pool = torch.randn(LAY.kv_shape(96), generator=g)
            for n in (1, 3, 4, 5, 13, 40, 7, 16):
                published.put(_export(exporter, producer, kv_pool, n, g))
            published.put(None)

        def generation():
            while (item := published.get()) is not None:
                d, want = item
                source.claim([d])                     # the HTTP process accepting the job
                h = source.parse(d)
                assert h.transport == "device"
                dst = torch.full(LAY.kv_shape(h.num_tokens + 3), float("nan"))
                nbytes, _ = source.import_into(h, dst)   # frees the pages
                got.append((dst, want, h.num_tokens, nbytes))

        threads = [threading.Thread(target=understanding), threading.Thread(target=generation)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 8
        for dst, want, n, nbytes in got:
            assert torch.equal(dst[:, :, :n], want) and torch.isnan(dst[:, :, n:]).all()
            assert nbytes == n * LAY.bytes_per_token
        st = producer.stats()
        assert st["pages_used"] == 0 and st["pages_on"] == "cpu" and st["handles_live"] == 0
        assert st["bytes_exported_total"] == st["bytes_imported_total"] == sum(g[2] for g in got) * LAY.bytes_per_token
    finally:
        source.close()
        exporter.close()
        producer.close()


def test_restarted_producer_old_handles_stale_new_ones_read(shm_name):
    producer = DeviceTransport.create(shm_name, LAY, 8 * LAY.page_bytes, FP, device="cpu")
    consumer = DeviceTransport.attach(shm_name, expected_fingerprint=FP)
    try:
        old = producer.allocate(5, lease_s=30)
        producer.write_kv(old, torch.randn(LAY.kv_shape(5)))
        consumer.claim(old)
        producer.close()                       # understanding restarts: its pool goes, a new generation comes
        producer = DeviceTransport.create(shm_name, LAY, 8 * LAY.page_bytes, FP, device="cpu")
        kv = torch.randn(LAY.kv_shape(6))
        new = producer.allocate(6, lease_s=30)
        producer.write_kv(new, kv)
        assert torch.equal(consumer.read_kv(new), kv)      # re-attached on the newer generation's handle
        assert consumer.pool.generation == producer.pool.generation != old.pool_generation
        with pytest.raises(HandleError) as e:
            consumer.read_kv(old)
        assert e.value.code == "stale_generation"
        assert consumer.release(new) == 2 and producer.stats()["pages_used"] == 0
    finally:
        consumer.close()
        producer.close()


def test_a_device_handle_in_another_process_is_refused_clearly(shm_name):
    peer = Peer()
    try:
        with DeviceTransport.create(shm_name, LAY, 8 * LAY.page_bytes, FP, device="cpu") as producer:
            h = producer.allocate(6, lease_s=30)
            producer.write_kv(h, torch.randn(LAY.kv_shape(6)))
            d = wire(h)
            with pytest.raises(PeerError) as e:                     # the consumer's transport
                peer.call("attach", shm_name, expected_fingerprint=FP, transport="device")
            assert e.value.cls_name == "HandleError" and e.value.code == "device_pages_elsewhere"
            assert f"process {producer.pool.creator_pid}" in e.value.message and "one process" in e.value.message
            status, code, message = peer.call("source_import", shm_name, d, FP)[1]    # generation: a 503
            assert (status, code) == (503, "kv_pool_unavailable") and "cannot read or write" in message
            with pytest.raises(PeerError) as e:                     # an understanding engine rank elsewhere
                peer.call("exporter", shm_name, FP)
            assert e.value.cls_name == "PoolError" and "fused colocate" in e.value.message
            peer.call("attach", shm_name)                            # the page table alone ...
            for op in ("read", "validate"):                          # ... never the pages
                with pytest.raises(PeerError) as e:
                    peer.call(op, shm_name, d)
                assert e.value.code == "device_pages_elsewhere"
            with pytest.raises(PeerError) as e:
                peer.call("write", shm_name, d, torch.zeros(LAY.kv_shape(6)))
            assert e.value.code == "device_pages_elsewhere"
            assert peer.call("release", shm_name, d) == 2          # table operations still work
            assert producer.stats()["pages_used"] == 0
            peer.call("close", shm_name)
    finally:
        peer.stop()


def test_device_transport_wants_a_device_pool(shm_name):
    with LocalShmTransport.create(shm_name, LAY, 2 * LAY.page_bytes, FP):
        with pytest.raises(HandleError) as e:
            DeviceTransport.attach(shm_name)
        assert e.value.code == "wrong_transport"
    with pytest.raises(ValueError, match="'device'"):
        create_producer("gpu", shm_name, LAY, LAY.page_bytes, FP)


def test_device_pool_takes_no_host_memory_for_its_pages(shm_name):
    from shm_transfer.pool import segment_bytes
    with DeviceTransport.create(shm_name, LAY, 1024 * LAY.page_bytes, FP, device="cpu") as producer:
        assert os.path.getsize(f"/dev/shm/{shm_name}") == segment_bytes(LAY, 1024 * LAY.page_bytes, device_pages=True)
        assert segment_bytes(LAY, 1024 * LAY.page_bytes, device_pages=True) < 1024 * LAY.page_bytes
        with pytest.raises(PoolError, match="no network transport"):
            producer.pool.memory_map()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_to_device_on_cuda(shm_name):
    """On the GPU: the pages are CUDA memory; export (engine KV on the GPU) and import (into a GPU buffer) never
    touch the host; bit-exact."""
    lay = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_tokens=64)
    producer = create_producer("device", shm_name, lay, 64 * lay.page_bytes, FP, device="cuda")
    exporter = attach_exporter(shm_name, FP)
    consumer = DeviceTransport.attach(shm_name, expected_fingerprint=FP)
    try:
        assert producer.pool.pages.is_cuda and consumer.pool.pages.data_ptr() == producer.pool.pages.data_ptr()
        g = torch.Generator().manual_seed(0)
        kv_pool = torch.randn(lay.kv_shape(2048), generator=g).to("cuda", torch.bfloat16)
        d, want = _export(exporter, producer, kv_pool, 365, g)
        h = KVHandle.from_dict(d)
        dst = torch.zeros(lay.kv_shape(400), dtype=torch.bfloat16, device="cuda")
        consumer.import_kv(h, dst)
        assert torch.equal(dst[:, :, :365], want)
        assert consumer.release(h) == len(h.page_ids)
    finally:
        consumer.close()
        exporter.close()
        producer.close()


def test_an_interleaved_answers_float_image_goes_back_through_the_device_pool(shm_name):
    """generation writes the final float image into pages beside the job's prefix (float_image.export);
    understanding reads it back: both in this process, the pages on the device."""
    from services.generation import float_image
    from shm_transfer.tensors import unpack
    with create_producer("device", shm_name, LAY, 64 * LAY.page_bytes, FP, device="cpu") as producer:
        source = PrefixSource(shm_name, FP, torch.device("cpu"))
        try:
            near = producer.allocate(3, lease_s=30)
            x = torch.randn(3, 8, 8)
            d = float_image.export(source, x, wire(near))
            assert d["transport"] == "device" and d["pool_name"] == shm_name
            got = unpack(producer.read_kv(KVHandle.from_dict(d)), (3, 8, 8))
            assert torch.equal(got, x)
        finally:
            source.close()
