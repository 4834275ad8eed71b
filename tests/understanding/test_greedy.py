"""Greedy outputs equal the reference pipeline token for token: 1, 4 and 8 concurrent mixed-length requests
with and without images; prefix-cache hit == miss; chunked == unchunked; TP=2 == TP=1."""
from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from .conftest import TOKEN, whole_pages
from .helpers import chat_body, mixed_requests, reference_ids


async def _run_all(url: str, reqs: list[dict]) -> list[dict]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
    try:
        async def one(r):
            body = chat_body(r)
            resp = await client.chat.completions.create(
                model="tiny", messages=body["messages"], max_tokens=body["max_tokens"], temperature=0.0,
                extra_body={"return_token_ids": True})
            return {"ids": resp.choices[0].model_extra["token_ids"], "usage": resp.usage,
                    "finish": resp.choices[0].finish_reason, "text": resp.choices[0].message.content}
        return await asyncio.gather(*(one(r) for r in reqs))
    finally:
        await client.close()


def _check(ref, reqs, results):
    for r, res in zip(reqs, results):
        expected = reference_ids(ref, r)
        assert res["ids"] == expected, (r["messages"], res["ids"], expected)
        assert res["usage"].completion_tokens >= len(expected)


@pytest.mark.parametrize("n,images", [(1, False), (1, True), (4, True), (8, False), (8, True)])
def test_greedy_concurrent_matches_reference(server, ref, n, images):
    reqs = mixed_requests(n, seed=10 + n + (100 if images else 0), with_images=images)
    if n == 1 and images:
        reqs = mixed_requests(2, seed=5)[1:]
    _check(ref, reqs, asyncio.run(_run_all(server.url, reqs)))


def test_prefix_cache_hit_equals_miss(server, ref):
    reqs = mixed_requests(4, seed=77)
    first = asyncio.run(_run_all(server.url, reqs))
    again = asyncio.run(_run_all(server.url, reqs))
    for a, b in zip(first, again):
        assert a["ids"] == b["ids"]
        # the whole prompt but its last token (images included) comes from the cache the second time, reported in
        # whole pages
        assert b["usage"].prompt_tokens_details.cached_tokens == whole_pages(b["usage"].prompt_tokens - 1)
    _check(ref, reqs, again)


def test_unchunked_no_cache_equals_reference(server_plain, server, ref):
    reqs = mixed_requests(8, seed=31)
    plain = asyncio.run(_run_all(server_plain.url, reqs))
    chunked = asyncio.run(_run_all(server.url, reqs))
    assert [p["ids"] for p in plain] == [c["ids"] for c in chunked]
    assert all(p["usage"].prompt_tokens_details.cached_tokens == 0 for p in plain)
    _check(ref, reqs, plain)


def test_tp2_equals_tp1(server_tp2, server, ref):
    reqs = mixed_requests(8, seed=53)
    tp2 = asyncio.run(_run_all(server_tp2.url, reqs))
    tp1 = asyncio.run(_run_all(server.url, reqs))
    assert [a["ids"] for a in tp2] == [b["ids"] for b in tp1]
    _check(ref, reqs, tp2)
