"""Prefix-cache isolation: requests with different `cache_salt`s never share radix-cache entries (no salt is
the shared default domain); within one salt `cached_tokens` counts the cached prefix in whole KV pages. Chat body field, native
`parameters.cache_salt`, and the engine's keys (image prefixes take the same path)."""
from __future__ import annotations

import uuid

import httpx
import torch

from services.understanding.kv_allocator import KVSlotAllocator
from services.understanding.radix_cache import RadixCache, image_digest, salt_keys

from .conftest import HEADERS, whole_pages


def _chat(server, text, **kw):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True, **kw}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["usage"]["prompt_tokens_details"]["cached_tokens"], j["usage"]["prompt_tokens"], \
        j["choices"][0]["token_ids"]


def test_salts_never_share_cached_prefixes(server):
    tag = uuid.uuid4().hex
    alpha, beta = f"alpha-{tag}", f"beta-{tag}"          # fresh domains: nothing cached in them yet
    text = f"{tag} isolation check " + "lorem ipsum dolor " * 40
    cached, n, ids = _chat(server, text, cache_salt=alpha)
    assert cached == 0 and n > 100
    assert _chat(server, text, cache_salt=alpha)[0] == whole_pages(n - 1)   # same domain: all but one token
    cached_b, _, ids_b = _chat(server, text, cache_salt=beta)
    assert cached_b == 0 and ids_b == ids                           # other salt: nothing shared, same answer
    # the default domain shares only what other unsalted chats sent (the template's opening), not alpha's
    assert _chat(server, text)[0] < 10
    assert _chat(server, text)[0] == whole_pages(n - 1)
    assert _chat(server, text, cache_salt=beta)[0] == whole_pages(n - 1)


def test_native_api_takes_the_salt_in_parameters(server):
    prompt = f"<|im_start|>user\n{uuid.uuid4().hex} native salt<|im_end|>\n<|im_start|>assistant\n"

    def gen(**params):
        r = httpx.post(server.url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 2,
                       "do_sample": False, **params}}, headers=HEADERS, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first = gen(cache_salt="tenant-1")
    assert first["cached_tokens"] == 0
    assert gen(cache_salt="tenant-1")["cached_tokens"] == whole_pages(first["prompt_tokens"] - 1)
    assert gen(cache_salt="tenant-2")["cached_tokens"] == 0
    r = httpx.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=30, json={
        "messages": [{"role": "user", "content": "x"}], "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_salted_keys_live_in_their_own_domain():
    a = KVSlotAllocator(64)
    c = RadixCache(a.free)
    keys = [5, 6, 7, 8]
    c.insert(salt_keys(keys, "s1"), a.alloc(4))
    assert c.match_prefix(salt_keys(keys, "s1"))[0].numel() == 4
    assert c.match_prefix(salt_keys(keys, "s2"))[0].numel() == 0
    assert c.match_prefix(keys)[0].numel() == 0
    assert salt_keys(keys, None) == keys and salt_keys(keys, "s1")[1:] == keys[1:]
    assert image_digest(torch.ones(4, 768), (2, 2)).bit_length() > 64    # 128-bit image keys
