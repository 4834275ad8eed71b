"""KV copies on a side stream under random GPU-side delays: every consumer waits for what it reads (CUDA only).

The ordering rules of shm_transfer/copy.py: an export on a side stream waits for the compute stream that produced
the KV; the consumer of an import on a side stream waits on its CopyDone (`wait_stream`) before reading the
destination. A missing wait shows only when the stream it should have waited for is late, so each trial queues a
sleep of random length on that stream first (torch.cuda._sleep) and checks the bits. On the CPU every copy is
synchronous (copy.py runs it at once), so there is nothing to order there.
"""
from __future__ import annotations

import random

import pytest
import torch

from shm_transfer import KVLayout, ShmKVPool, import_kv, read_kv, write_kv

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: streams"),
              pytest.mark.timeout(120)]

FP = "tiny-u1:test-fingerprint"
TRIALS = 20
MAX_SLEEP_CYCLES = 4_000_000          # about 2 ms at the H100's clock: far longer than a copy of this size


def _late(stream: torch.cuda.Stream, rnd: random.Random) -> None:
    """Queue a GPU-side sleep of random length on `stream`: work queued after it runs late."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(rnd.randrange(MAX_SLEEP_CYCLES))


@pytest.fixture
def pool(shm_name):
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, page_tokens=16)
    with ShmKVPool.create(shm_name, lay, 64 * lay.page_bytes, FP) as p:
        yield p


def test_side_stream_export_waits_for_the_kv_it_copies(pool, test_seed):
    rnd = random.Random(test_seed)
    dev, side, main = torch.device("cuda"), torch.cuda.Stream(), torch.cuda.current_stream()
    for trial in range(TRIALS):
        n = rnd.randrange(1, 200)
        src = torch.randn(pool.layout.kv_shape(n), device=dev).to(torch.bfloat16)
        torch.cuda.synchronize()
        _late(main, rnd)
        kv = src * 1                                  # produced on the compute stream, after the sleep
        h = pool.allocate(n, 60, branch="cond", t_offset=n)
        write_kv(pool, h, kv, stream=side).wait()
        assert torch.equal(read_kv(pool, h, dev), src), f"trial {trial}: the export read KV not yet written"
        pool.release(h)


def test_side_stream_import_orders_its_consumer(pool, test_seed):
    rnd = random.Random(test_seed)
    dev, side = torch.device("cuda"), torch.cuda.Stream()
    for trial in range(TRIALS):
        n = rnd.randrange(1, 200)
        src = torch.randn(pool.layout.kv_shape(n), device=dev).to(torch.bfloat16)
        h = pool.allocate(n, 60, branch="cond", t_offset=n)
        write_kv(pool, h, src)
        dst = torch.full(pool.layout.kv_shape(n), float("nan"), dtype=torch.bfloat16, device=dev)
        _late(side, rnd)
        done = import_kv(pool, h, dst, stream=side)
        done.wait_stream()                            # the consumer's stream waits for the copy, the host does not
        seen = dst.clone()
        done.wait()
        assert torch.equal(seen, src), f"trial {trial}: the consumer read the destination before the import"
        pool.release(h)
