"""What the gateway sends to the engines and relays back, against a scripted HTTP peer standing in for both
engines (conftest.Peer): the bodies it sends (cache salt, flow_shift on chat images, extension fields, the
internal token), engine 429s passed on with Retry-After, unknown event fields relayed, malformed generation and
prefix-stream events refused, and the prefix handles released on every early end once the gateway owns them (a
release not answered 200 sent again)."""
import asyncio
import hashlib
import time

import httpx
import pytest
from fastapi.responses import JSONResponse

from services.kit import sse
from tests.waiting import wait_until

from .conftest import API_KEY, API_KEY_2, fake_handles, sse_response

CHAT = "/v1/chat/completions"
GEN = "/v1/images/generations"
TOKEN = "tok-forwarding"


@pytest.fixture()
def keyfile(tmp_path):
    p = tmp_path / "keys"
    p.write_text(f"{API_KEY}\n{API_KEY_2}\n")
    t = tmp_path / "token"
    t.write_text(TOKEN + "\n")
    return str(p), str(t)


def gw(side_gateway, peer, keyfile, *flags):
    keys, token = keyfile
    g = side_gateway(peer.url, peer.url, "--api-key-file", keys, "--internal-token-file", token,
                     "--upstream-idle-timeout-s", "2", *flags)
    return g.base


def post(base, path, body, key=API_KEY, **kw):
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30, **kw)


def events(r: httpx.Response) -> list:
    return list(sse.events(r.text.splitlines(), done=True))


def test_chat_is_forwarded_with_its_known_fields_the_salt_and_the_token(side_gateway, peer, keyfile):
    base = gw(side_gateway, peer, keyfile, "--no-cache-salt-by-api-key")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 5, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": True}, "cache_salt": "tenant-a"}
    r = post(base, CHAT, {**body, "an_extension": {"x": [1] * 1000}})
    assert r.status_code == 200, r.text
    seen = peer.seen["/v1/chat/completions"][-1]
    assert seen["body"] == body           # what the contract does not declare stays at the gateway
    assert seen["headers"]["x-u1-internal-token"] == TOKEN
    r = post(base, GEN, {"prompt": "p", "cache_salt": "tenant-a", "size": "64x64"})
    assert r.status_code == 200, r.text
    assert peer.bodies("/internal/image_prefix")[-1]["cache_salt"] == "tenant-a"
    assert all(s["headers"]["x-u1-internal-token"] == TOKEN for ss in peer.seen.values() for s in ss)


def test_cache_salt_by_api_key_is_the_default_with_keys(side_gateway, peer, keyfile):
    base = gw(side_gateway, peer, keyfile)
    msgs = [{"role": "user", "content": "hi"}]
    salts = []
    for key in (API_KEY, API_KEY_2, API_KEY):
        assert post(base, CHAT, {"messages": msgs, "cache_salt": "shared"}, key=key).status_code == 200
        salts.append(peer.bodies("/v1/chat/completions")[-1]["cache_salt"])
        assert post(base, GEN, {"prompt": "p", "cache_salt": "shared"}, key=key).status_code == 200
        assert peer.bodies("/internal/image_prefix")[-1]["cache_salt"] == salts[-1]
    assert salts[0] == salts[2] != salts[1] and "shared" not in salts
    assert API_KEY not in salts[0] and hashlib.sha256(API_KEY.encode()).hexdigest() not in salts[0]


def test_flow_shift_and_options_of_a_chat_image_reach_generation(side_gateway, peer, keyfile):
    base = gw(side_gateway, peer, keyfile, "--no-cache-salt-by-api-key")
    body = {"messages": [{"role": "user", "content": "a lighthouse"}], "modalities": ["image"], "flow_shift": 1.5,
            "seed": 42, "cache_salt": "s1", "image_config": {"steps": 3, "aspect_ratio": "2:1", "cfg_scale": 2.0}}
    r = post(base, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["images"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    prefix = peer.bodies("/internal/image_prefix")[-1]
    assert (prefix["mode"], prefix["prompt"], prefix["cache_salt"], prefix["guidance_scale"]) == ("t2i", "a lighthouse",
                                                                                                 "s1", 2.0)
    gen = peer.bodies("/internal/generate")[-1]
    assert (gen["timestep_shift"], gen["num_inference_steps"], gen["seed"]) == (1.5, 3, 42)
    assert (gen["width"], gen["height"]) == (96, 32) and set(gen["handles"]) == {"cond", "uncond"}


def test_engine_429_passes_on_with_retry_after(side_gateway, peer, keyfile):
    base = gw(side_gateway, peer, keyfile)
    busy = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "overloaded"}}
    peer.replies["/internal/image_prefix"] = lambda body: JSONResponse(busy, 429, headers={"Retry-After": "7"})
    for stream in (False, True):
        r = post(base, GEN, {"prompt": "p", "stream": stream})
        assert r.status_code == 429 and r.headers["retry-after"] == "7", r.text
        assert r.json()["error"]["code"] == "overloaded"
    # a 429 as the first event of the engine's stream is still the response status
    peer.replies["/internal/image_prefix"] = lambda body: sse_response({"type": "error", "status": 429, **busy,
                                                                        "retry_after": 3})
    for stream in (False, True):
        r = post(base, GEN, {"prompt": "p", "stream": stream})
        assert r.status_code == 429 and r.headers["retry-after"] == "3", r.text
    peer.replies["/v1/chat/completions"] = lambda body: JSONResponse(busy, 429)
    r = post(base, CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    peer.replies["/v1/chat/completions"] = lambda body: sse_response({"status": 429, **busy, "retry_after": 4})
    r = post(base, CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"] == "4", r.text
    # generation's 429: the prefix pages the gateway holds go back at once
    del peer.replies["/internal/image_prefix"]
    peer.replies["/internal/generate"] = lambda body: JSONResponse(busy, 429, headers={"Retry-After": "5"})
    r = post(base, GEN, {"prompt": "p"})
    assert r.status_code == 429 and r.headers["retry-after"] == "5"
    assert wait_until(lambda: peer.bodies("/internal/release"), 10)[-1]["handles"] == \
        list(peer.bodies("/internal/generate")[-1]["handles"].values())


def test_unknown_event_fields_are_relayed_unknown_events_skipped_malformed_ones_refused(side_gateway, peer,
                                                                                       keyfile):
    base = gw(side_gateway, peer, keyfile)
    peer.replies["/internal/generate"] = lambda body: sse_response(
        {"type": "queued", "position": 2}, {"type": "heartbeat"}, {"type": "progress", "step": 1, "total": 1,
                                                                  "eta_s": 0.5},
        {"type": "image", "index": 0, "b64": "aGk=", "format": "png", "width": 64, "height": 64, "seed": 1,
         "nsfw": False})
    r = post(base, GEN, {"prompt": "p", "stream": True, "size": "64x64"})
    assert r.status_code == 200
    evs = events(r)
    assert [e["type"] for e in evs[:-1]] == ["image_generation.progress", "image_generation.completed"]
    assert evs[0]["eta_s"] == 0.5 and evs[0]["step"] == 1 and evs[1]["nsfw"] is False
    assert evs[1]["b64_json"] == "aGk=" and "b64" not in evs[1] and evs[-1] == "[DONE]"
    # an event of a declared type whose fields do not fit the contract (an image without its b64) ends the job with
    # a 502 naming the field (an error event once the stream started), never a KeyError's 500; the handles go back
    peer.replies["/internal/generate"] = lambda body: sse_response(
        {"type": "queued"}, {"type": "image", "index": 0, "format": "png", "width": 64, "height": 64})
    for stream in (False, True):
        before = len(peer.bodies("/internal/release"))
        r = post(base, GEN, {"prompt": "p", "stream": stream, "size": "64x64"})
        assert r.status_code == (200 if stream else 502), r.text
        err = events(r)[-2]["error"] if stream else r.json()["error"]
        assert err["code"] == "upstream_protocol_error" and "image event (b64: Field required)" in err["message"]
        released = wait_until(lambda: peer.bodies("/internal/release")[before:], 15)
        assert released[0]["handles"] == list(peer.bodies("/internal/generate")[-1]["handles"].values())


def test_prefix_stream_events_are_read_through_the_contract(side_gateway, peer, keyfile):
    """Understanding's prefix stream is parsed as the contract's PrefixEvent: an undeclared event type is skipped,
    a declared one whose fields do not fit (a handles event without its handles, a think_delta without text)
    ends the job with a 502 naming the field, before generation is asked anything."""
    base = gw(side_gateway, peer, keyfile)
    peer.replies["/internal/image_prefix"] = lambda body: sse_response(
        {"type": "keepalive"}, {"type": "think_delta", "text": "a cube"},
        {"type": "handles", "handles": fake_handles(body), "think_text": "a cube"})
    r = post(base, GEN, {"prompt": "p", "size": "64x64", "think": True, "stream": True})
    assert r.status_code == 200, r.text
    evs = events(r)
    assert [e["type"] for e in evs[:-1]] == ["image_generation.think_delta", "image_generation.think_done",
                                             "image_generation.progress", "image_generation.completed"]
    asked = len(peer.bodies("/internal/generate"))
    for bad, where in (({"type": "handles", "think_text": None}, "handles event (handles: Field required)"),
                       ({"type": "think_delta"}, "think_delta event (text: Field required)")):
        peer.replies["/internal/image_prefix"] = lambda body, bad=bad: sse_response(bad)
        r = post(base, GEN, {"prompt": "p", "size": "64x64"})
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "upstream_protocol_error" and where in err["message"], err
    assert len(peer.bodies("/internal/generate")) == asked


def test_every_early_end_releases_the_handles_the_gateway_owns(side_gateway, peer, keyfile):
    """Generation fails the job / hangs before answering / hangs mid-stream: the handles go back to
    understanding (generation never confirmed a cancel), and the client gets an error, never a hang."""
    base = gw(side_gateway, peer, keyfile)

    async def hang_head(body):
        await asyncio.sleep(30)

    def hang_stream(body):
        async def gen():
            yield b'data: {"type":"queued"}\n\n'
            yield b'data: {"type":"progress","step":1,"total":50}\n\n'
            await asyncio.sleep(30)
        from fastapi.responses import StreamingResponse
        return StreamingResponse(gen(), media_type="text/event-stream")

    failing = lambda body: sse_response({"type": "queued"}, {"type": "error", "status": 500, "error": {  # noqa: E731
        "message": "boom", "type": "server_error", "param": None, "code": "engine_error"}})
    cases = [(failing, False, 500, "engine_error"), (hang_head, False, 504, "upstream_timeout"),
             (hang_stream, True, 200, "upstream_timeout")]
    for reply, stream, status, code in cases:
        peer.replies["/internal/generate"] = reply
        before = len(peer.bodies("/internal/release"))
        r = post(base, GEN, {"prompt": "p", "stream": stream})
        assert r.status_code == status, r.text
        err = events(r)[-2]["error"] if stream else r.json()["error"]
        assert err["code"] == code
        released = wait_until(lambda: peer.bodies("/internal/release")[before:], 15)
        assert released[0]["handles"] == list(peer.bodies("/internal/generate")[-1]["handles"].values())
        if code == "upstream_timeout":
            assert peer.bodies("/internal/abort")[-1]["request_id"] == peer.bodies("/internal/generate")[-1][
                "request_id"]
    # understanding hangs before its handles: it is told to abort, nothing to release
    peer.replies["/internal/image_prefix"] = hang_head
    before, aborts = len(peer.bodies("/internal/release")), len(peer.bodies("/internal/abort"))
    r = post(base, GEN, {"prompt": "p"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert wait_until(lambda: peer.bodies("/internal/abort")[aborts:], 15)
    assert len(peer.bodies("/internal/release")) == before


def test_a_release_understanding_does_not_answer_goes_again(side_gateway, peer, keyfile):
    """Release frees only the pages still the handles' (idempotent), so the gateway sends one that understanding did
    not answer 200 (busy, restarting) again with backoff instead of leaving the pages to their 300 s lease; a 4xx
    (handles it cannot read) is not repeated."""
    base = gw(side_gateway, peer, keyfile)
    busy = JSONResponse({"error": {"message": "busy", "type": "server_error", "code": "overloaded"}}, 503)
    answers = iter([busy, busy])                               # the first two tries, then the default 200
    peer.replies["/internal/release"] = lambda body: next(answers, {"released_pages": 2})
    peer.replies["/internal/generate"] = lambda body: JSONResponse({"error": {"message": "full"}}, 429)
    r = post(base, GEN, {"prompt": "p"})
    assert r.status_code == 429
    tries = wait_until(lambda: len(peer.bodies("/internal/release")) >= 3 and peer.bodies("/internal/release"), 15)
    handles = list(peer.bodies("/internal/generate")[-1]["handles"].values())
    assert [t["handles"] for t in tries] == [handles] * 3      # the same handles each time
    peer.replies["/internal/release"] = lambda body: JSONResponse({"error": {"message": "bad handles"}}, 400)
    before = len(peer.bodies("/internal/release"))
    assert post(base, GEN, {"prompt": "p"}).status_code == 429
    wait_until(lambda: len(peer.bodies("/internal/release")) > before, 15)
    time.sleep(1.0)                                            # longer than the first backoff (0.5 s)
    assert len(peer.bodies("/internal/release")) == before + 1
