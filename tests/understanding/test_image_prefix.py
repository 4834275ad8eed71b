"""POST /internal/image_prefix: the KV read back from the shm pool equals the reference pipeline's prefix KV
for every branch (T2I, 2- and 3-branch editing, think mode, TP=2); a full pool is waited for, then 429; release
frees."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from services.contract.image import SamplerParams
from services.kit import sse
from services.model import reference as R

from .conftest import PAGES_WAIT_S, TOKEN
from .helpers import make_image

H = {"X-U1-Internal-Token": TOKEN}


def _post(server, path, body, timeout=300):
    return httpx.post(server.url + path, json=body, headers=H, timeout=timeout)


def _stream_prefix(server, body):
    events = []
    with httpx.stream("POST", server.url + "/internal/image_prefix", json={**body, "stream": True}, headers=H,
                      timeout=300) as r:
        assert r.status_code == 200
        events += sse.events(r.iter_lines(), done=True)
    return events


def _read_back(server, handle: dict) -> torch.Tensor:
    from shm_transfer import KVHandle, ShmKVPool, read_kv
    pool = ShmKVPool.attach(server.pool_name)
    try:
        return read_kv(pool, KVHandle.from_dict(handle))
    finally:
        pool.close()


def _check_against_reference(server, ref, body, handles, think_text, pils=()):
    model, tok = ref
    params = SamplerParams(guidance_scale=body.get("guidance_scale", 4.0), image_guidance_scale=body.get("image_guidance_scale", 1.0),
                             mode=body["mode"])
    expected = R.image_prefixes(model, tok, body["mode"], body["prompt"], list(pils), params,
                                body.get("think", False), body.get("max_think_tokens", 1024))
    assert set(handles) == set(expected) == set(params.branches())
    for branch, pre in expected.items():
        h = handles[branch]
        assert h["branch"] == branch
        assert h["num_tokens"] == pre.num_tokens, branch
        assert h["t_offset"] == pre.t_offset, branch
        kv = _read_back(server, h)
        torch.testing.assert_close(kv, pre.kv.to(kv.dtype), atol=2e-5, rtol=1e-4, msg=branch)
    assert think_text == expected["cond"].think_text
    released = _post(server, "/internal/release", {"handles": list(handles.values())}).json()
    assert released["released_pages"] == sum(len(h["page_ids"]) for h in handles.values())
    again = _post(server, "/internal/release", {"handles": list(handles.values())}).json()
    assert again["released_pages"] == 0   # idempotent


def test_t2i_prefix_matches_reference(server, ref):
    body = {"request_id": "t2i-1", "mode": "t2i", "prompt": "a red cube on a table", "guidance_scale": 4.0}
    r = _post(server, "/internal/image_prefix", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "t2i-1" and out["think_text"] is None
    _check_against_reference(server, ref, body, out["handles"], None)


@pytest.mark.parametrize("n_images,img_cfg", [(1, 1.0), (2, 2.0)])
def test_edit_prefix_matches_reference(server, ref, n_images, img_cfg):
    imgs = [make_image(40 + i, 70 + 30 * i, 50) for i in range(n_images)]
    body = {"request_id": f"edit-{n_images}", "mode": "edit", "prompt": "make it blue",
            "images": [url for _, url in imgs], "guidance_scale": 4.0, "image_guidance_scale": img_cfg}
    r = _post(server, "/internal/image_prefix", body)
    assert r.status_code == 200, r.text
    handles = r.json()["handles"]
    assert len(handles) == (2 if img_cfg == 1.0 else 3)
    _check_against_reference(server, ref, body, handles, None, [p for p, _ in imgs])


def test_think_prefix_streams_and_matches_reference(server, ref):
    body = {"request_id": "think-1", "mode": "t2i", "prompt": "a lighthouse", "guidance_scale": 4.0, "think": True,
            "max_think_tokens": 12}
    events = _stream_prefix(server, body)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["type"] == "handles", events
    deltas = "".join(e["text"] for e in events[:-2] if e["type"] == "think_delta")
    assert deltas == final["think_text"]
    _check_against_reference(server, ref, body, final["handles"], final["think_text"])


def test_tp2_prefix_export_matches_reference(server_tp2, ref):
    body = {"request_id": "tp2-think", "mode": "t2i", "prompt": "two cats", "guidance_scale": 3.0, "think": True,
            "max_think_tokens": 6}
    r = _post(server_tp2, "/internal/image_prefix", body)
    assert r.status_code == 200, r.text
    _check_against_reference(server_tp2, ref, body, r.json()["handles"], r.json()["think_text"])


def test_a_full_pool_is_waited_for_then_429_and_recovers(server_plain):
    """A request finding every page held waits for them (--prefix-pages-wait-s): released meanwhile, it gets them;
    never released, it gets 429 kv_pool_full with Retry-After once the wait is over."""
    body = {"mode": "t2i", "prompt": "a small house", "guidance_scale": 4.0}
    first = _post(server_plain, "/internal/image_prefix", {**body, "request_id": "full-1"})
    assert first.status_code == 200, first.text
    release = threading.Timer(0.6, _post, (server_plain, "/internal/release",
                                           {"handles": list(first.json()["handles"].values())}))
    t0 = time.monotonic()
    release.start()
    second = _post(server_plain, "/internal/image_prefix", {**body, "request_id": "full-2"}, timeout=30)
    assert second.status_code == 200 and time.monotonic() - t0 >= 0.5, second.text
    release.join()
    t0 = time.monotonic()
    third = _post(server_plain, "/internal/image_prefix", {**body, "request_id": "full-3"}, timeout=30)
    waited = time.monotonic() - t0
    assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1, third.text
    assert third.json()["error"]["code"] == "kv_pool_full"
    assert PAGES_WAIT_S - 0.1 <= waited < PAGES_WAIT_S + 20, waited
    _post(server_plain, "/internal/release", {"handles": list(second.json()["handles"].values())})
    fourth = _post(server_plain, "/internal/image_prefix", {**body, "request_id": "full-4"})
    assert fourth.status_code == 200, fourth.text
    _post(server_plain, "/internal/release", {"handles": list(fourth.json()["handles"].values())})
    assert server_plain.wait_idle()["shm_pages_used"] == 0


def test_internal_endpoints_need_the_token(server):
    r = httpx.post(server.url + "/internal/image_prefix", json={"request_id": "x", "mode": "t2i", "prompt": "p"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"


def test_internal_abort_stops_a_prefix_and_frees_its_pages(server):
    body = {"request_id": "abort-me", "mode": "t2i", "prompt": "endless thoughts", "guidance_scale": 4.0,
            "think": True, "max_think_tokens": 500, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/internal/image_prefix", json=body, headers=H, timeout=120) as r:
        assert r.status_code == 200
        for ev in sse.events(r.iter_lines(), done=True):
            events.append(ev)
            if len(events) == 1:
                a = _post(server, "/internal/abort", {"request_id": "abort-me"})
                assert a.status_code == 200 and a.json()["aborted"] >= 1
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert err["type"] == "error" and err["error"]["code"] == "abort", events[-3:]
    assert server.wait_idle()["shm_pages_used"] == 0
