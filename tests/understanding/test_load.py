"""64 concurrent streaming chats of random lengths, some cancelled mid-stream, plus image-prefix streams
(some cancelled, the rest released): everything finishes or aborts cleanly and afterwards no request
holds KV and the shared-memory pool is empty."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from openai import AsyncOpenAI

from services.kit import sse
from .conftest import TOKEN


async def _chat(client: AsyncOpenAI, i: int, rng: random.Random, cancel_after: int | None):
    text = "".join(rng.choice("qrstuvwxyz ") for _ in range(rng.randint(1, 120)))
    # a request to be cancelled runs long (no EOS) and sends a chunk per token, so it is surely mid-stream
    extra = {"ignore_eos": True, "return_token_ids": True} if cancel_after is not None else {}
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}],
        max_tokens=32 if cancel_after is not None else rng.randint(1, 32),
        temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=i, stream=True,
        extra_body=extra)
    n, finish = 0, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        n += 1
        if cancel_after is not None and n >= cancel_after:
            await stream.close()
            return "cancelled"
    assert finish in ("stop", "length"), finish
    return finish


async def _prefix(url: str, i: int, cancel: bool):
    body = {"request_id": f"load-{i}", "mode": "t2i", "prompt": f"picture {i}", "guidance_scale": 4.0,
            "think": True, "max_think_tokens": 40, "stream": True}
    headers = {"X-U1-Internal-Token": TOKEN}
    async with httpx.AsyncClient(timeout=300) as c:
        async with c.stream("POST", url + "/internal/image_prefix", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for ev in sse.aevents(r.aiter_lines()):
                if cancel and ev["type"] == "think_delta":
                    return "cancelled"
                if ev["type"] == "handles":
                    handles = list(ev["handles"].values())
                    break
            else:
                raise AssertionError("prefix stream ended without handles")
        rel = await c.post(url + "/internal/release", json={"handles": handles}, headers=headers)
        assert rel.status_code == 200
        return "done"


def test_64_streams_with_cancellations_leave_nothing_behind(server):
    rng = random.Random(1234)

    async def main():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=300)
        try:
            chats = [_chat(client, i, random.Random(i), rng.randint(1, 4) if i % 4 == 0 else None)
                     for i in range(64)]
            prefixes = [_prefix(server.url, i, cancel=i % 2 == 0) for i in range(4)]
            return await asyncio.gather(*chats, *prefixes)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results.count("cancelled") == 16 + 2
    h = server.wait_idle()
    assert h["kv_in_use"] == 0 and h["shm_pages_used"] == 0 and h["running"] == 0
    assert h["kv_free"] + h["kv_cached"] == h["kv_total"]
    # still serving
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3, "temperature": 0},
        headers={"X-U1-Internal-Token": TOKEN}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "u1_und_time_to_first_token_seconds_count" in metrics
    assert "u1_und_prefix_cache_hit_rate" in metrics


def test_non_stream_prefix_client_gone_frees_pages(server):
    body = {"request_id": "gone-1", "mode": "t2i", "prompt": "a long think", "guidance_scale": 4.0, "think": True,
            "max_think_tokens": 2500}  # seconds of decoding: outlasts the client on any CPU
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/internal/image_prefix", json=body, headers={"X-U1-Internal-Token": TOKEN},
                   timeout=0.5)
    h = server.wait_idle()
    assert h["shm_pages_used"] == 0 and h["kv_in_use"] == 0
