"""No deadlock under bursts: the real server, supervisor and engine rank on CPU (tiny checkpoint).

The old failure: submissions written to the engine's pipe from the event loop (under the lock the event reader
needed) while the engine blocked writing finished images into the other pipe. Now only dedicated threads touch
the pipes, so a burst of submissions and cancels against a stream of images must all end, and leave nothing
behind: no pool pages, no queued commands or held leases, no extra threads."""
from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest

from services.kit import sse

from tests.waiting import wait_until
from .conftest import make_pool
from .genhelp import HEADERS, GenServer, body, prefixes, publish


@pytest.fixture(scope="module")
def burst_pool(ref_model):
    p = make_pool(ref_model[0], size_mb=256)     # 250 prefixes of ~1200 tokens
    yield p
    p.close()


@pytest.fixture(scope="module")
def burst_server(tiny_dir, burst_pool):
    s = GenServer(tiny_dir, burst_pool.name, "--max-queued-requests", "400", "--max-running-jobs", "16").start()
    yield s
    s.stop()


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def _run(url: str, b: dict, cancel_after_queued: float | None = None) -> tuple[int, list]:
    """One streamed generate; optionally cancel it (POST /internal/abort) a moment after `queued`."""
    events: list = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        async with client.stream("POST", url + "/internal/generate", json=b, headers=HEADERS) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, [r.json()]
            async for ev in sse.aevents(r.aiter_lines(), done=True):
                events.append(ev)
                if ev != sse.DONE and ev["type"] == "queued" and cancel_after_queued is not None:
                    await asyncio.sleep(cancel_after_queued)
                    c = await client.post(url + "/internal/abort", json={"request_id": b["request_id"]},
                                          headers=HEADERS)
                    assert c.status_code == 200
    return 200, events


def _settled(server, pool) -> bool:
    _, h = server.health()
    return (pool.stats()["pages_used"] == 0 and h["queued"] == 0 and h["running"] == 0
            and h["pending_commands"] == 0 and h["kv_commands"] == 0)


def _check_outcomes(results, cancelled: set[str]) -> None:
    for rid, (status, events) in results.items():
        assert status == 200, (rid, events)
        assert events[-1] == "[DONE]", (rid, events[-3:])
        errs = [e for e in events if isinstance(e, dict) and e["type"] == "error"]
        images = [e for e in events if isinstance(e, dict) and e["type"] == "image"]
        if errs:
            assert rid in cancelled and errs[0]["error"]["code"] == "cancelled", (rid, errs)
        else:
            assert len(images) == 4, (rid, len(images))


def test_200_jobs_n4_with_50_cancels(burst_server, burst_pool, ref_model):
    pool = burst_pool
    random.seed(0)
    pre = prefixes(ref_model, guidance_scale=1.0)
    _, h = burst_server.health()
    assert h["max_queued"] == 400
    # warm up the encoder threads, then take the baseline
    status, _ = asyncio.run(_run(burst_server.url, body("warm", publish(pool, pre), guidance_scale=1.0,
                                                          width=32, height=32, n=4, num_inference_steps=1)))
    assert status == 200
    baseline = _threads(burst_server.proc.pid)
    # 32x32 and one step: the tiny model's patch embedding dominates a CPU step; the pipes see the same traffic
    bodies = {f"burst-{i}": body(f"burst-{i}", publish(pool, pre), guidance_scale=1.0, width=32, height=32,
                                 n=4, num_inference_steps=1, seed=i) for i in range(200)}
    cancelled = set(random.sample(sorted(bodies), 50))

    async def all_at_once():
        rids = list(bodies)
        outs = await asyncio.gather(*(
            _run(burst_server.url, bodies[r], random.uniform(0, 0.5) if r in cancelled else None) for r in rids))
        return dict(zip(rids, outs))

    results = asyncio.run(asyncio.wait_for(all_at_once(), 300))
    _check_outcomes(results, cancelled)
    assert wait_until(lambda: _settled(burst_server, pool), 30), (burst_server.health(), pool.stats())
    assert _threads(burst_server.proc.pid) <= baseline + 1     # + the encoder pool's second thread, at most


def test_submissions_during_a_step_while_big_images_return(burst_server, burst_pool, ref_model):
    """The old reproduction (it hung the old server): ~100 submissions, more than the 64 KiB pipe holds, land
    during a step whose finished images (3 MB per job here, 12 MB per image at 2048²) then flow back."""
    pool = burst_pool
    pre = prefixes(ref_model, guidance_scale=1.0)
    big = {f"big-{i}": body(f"big-{i}", publish(pool, pre), guidance_scale=1.0, width=512, height=512, n=4,
                            num_inference_steps=1, seed=i) for i in range(4)}
    small = {f"small-{i}": body(f"small-{i}", publish(pool, pre), guidance_scale=1.0, width=32, height=32, n=4,
                                num_inference_steps=1, seed=i) for i in range(96)}

    async def burst():
        big_tasks = [asyncio.create_task(_run(burst_server.url, b)) for b in big.values()]
        await asyncio.sleep(0.2)   # the first big step is running: now the submissions
        small_out = await asyncio.gather(*(_run(burst_server.url, b) for b in small.values()))
        return dict(zip(big, await asyncio.gather(*big_tasks))), dict(zip(small, small_out))

    big_out, small_out = asyncio.run(asyncio.wait_for(burst(), 300))
    _check_outcomes({**big_out, **small_out}, set())
    for _, events in big_out.values():
        img = next(e for e in events if isinstance(e, dict) and e["type"] == "image")
        assert (img["width"], img["height"]) == (512, 512)
    assert wait_until(lambda: _settled(burst_server, pool), 30)
