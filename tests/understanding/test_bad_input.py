"""Bad input -> a 400 in OpenAI error shape that says what is wrong; the server keeps serving."""
from __future__ import annotations

import base64

import httpx
import pytest

from tests.metrics import metric

from .conftest import MAX_LEN, TOKEN

H = {"X-U1-Internal-Token": TOKEN}

OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
PNG_TEXT = "data:image/png;base64," + base64.b64encode(b"this is not an image at all").decode()


def _img_msg(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is it?"}]}]


CHAT_CASES = {
    "empty messages": ({**OK, "messages": []}, "messages"),
    "unknown role": ({**OK, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    "over context limit": ({**OK, "messages": [{"role": "user", "content": "x" * (MAX_LEN + 10)}]}, "context"),
    "broken base64": ({**OK, "messages": _img_msg("data:image/png;base64,@@@not-base64@@@")}, "base64"),
    "non-image file": ({**OK, "messages": _img_msg(PNG_TEXT)}, "image"),
    "remote url": ({**OK, "messages": _img_msg("http://example.com/cat.png")}, "remote"),
    "negative max_tokens": ({**OK, "max_tokens": -5}, "max_tokens"),
    "temperature out of range": ({**OK, "temperature": 3.5}, "temperature"),
    "top_p out of range": ({**OK, "top_p": 0.0}, "top_p"),
    "n over the limit": ({**OK, "n": 17}, "n"),
    "bad content part": ({**OK, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "type"),
    "no user message": ({**OK, "messages": [{"role": "system", "content": "s"}]}, "user"),
    "seed over int64": ({**OK, "seed": 2**64}, "seed"),
    "negative seed": ({**OK, "seed": -1}, "seed"),
    "stop id outside the vocabulary": ({**OK, "stop_token_ids": [10**9]}, "stop_token_ids"),
    "negative stop id": ({**OK, "stop_token_ids": [-1]}, "stop_token_ids"),
    "repetition_penalty zero": ({**OK, "repetition_penalty": 0}, "repetition_penalty"),
    "min_p over 1": ({**OK, "min_p": 1.5}, "min_p"),
    "top_k below -1": ({**OK, "top_k": -2}, "top_k"),
    "boolean max_tokens": ({**OK, "max_tokens": True}, "max_tokens"),
    "image output": ({**OK, "modalities": ["image"]}, "modalities"),
    "image placeholder in text": ({**OK, "messages": [{"role": "user", "content": "a <IMG_CONTEXT> b"}]},
                                  "placeholder"),
}


@pytest.mark.parametrize("name", list(CHAT_CASES))
def test_chat_bad_input_is_400(server, name):
    body, needle = CHAT_CASES[name]
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=H, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"].lower() or needle in str(err["param"]).lower(), err


def test_other_bad_inputs(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json", **H})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"inputs": "", "parameters": {}}, headers=H, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs"
    r = httpx.post(server.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 0}}, headers=H,
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "parameters.max_new_tokens", r.text
    assert r.json()["error"]["message"].startswith("parameters.max_new_tokens: ")
    for body, param, words in [
            ({"request_id": "b", "mode": "video", "prompt": "p"}, "mode", "'t2i' or 'edit'"),
            ({"request_id": "b", "mode": "video", "prompt": "p"}, "mode", "'t2i' or 'edit'"),
            ({"request_id": "b", "mode": "edit", "prompt": "p", "images": []}, None, "1 to 4 images"),
            ({"request_id": "b", "mode": "t2i", "prompt": "p", "think": True, "max_think_tokens": 0},
             "max_think_tokens", "greater than or equal to 1"),
            ({"request_id": "b", "mode": "t2i", "prompt": "p", "max_think_tokens": 5000}, "max_think_tokens",
             "4096"),
            ({"request_id": "b", "mode": "t2i", "prompt": "p", "nonsense": 1}, "nonsense", "not permitted"),
            ({"request_id": "b", "mode": "edit", "prompt": "p", "images": ["%%%"]}, "images[0]", "base64")]:
        r = httpx.post(server.url + "/internal/image_prefix", json=body, headers=H, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/internal/release", json={"handles": [{"handle_id": 1}]}, headers=H, timeout=30)
    assert r.status_code == 400


def test_server_keeps_serving_after_bad_input(server):
    for body, _ in CHAT_CASES.values():
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=H, timeout=60)
    r = httpx.post(server.url + "/v1/chat/completions", json=OK, headers=H, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    n = httpx.post(server.url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3,
                                                                                  "do_sample": False}},
                   headers=H, timeout=60)
    assert n.status_code == 200 and n.json()["count_output_tokens"] >= 1
    assert httpx.get(server.url + "/v1/models", headers=H).json()["data"][0]["id"]
    assert server.wait_idle()["kv_in_use"] == 0


EXTREME = [dict(temperature=1e-5), dict(temperature=2.0, repetition_penalty=1e-300), dict(presence_penalty=-2,
           frequency_penalty=-2, temperature=2.0), dict(top_p=5e-324, temperature=1.0), dict(top_k=10**9, min_p=1.0),
           dict(temperature=1e-7, repetition_penalty=10.0), dict(seed=2**63 - 1, temperature=1.5, min_p=1e-12)]


def test_extreme_accepted_values_never_break_a_batch(server, ref):
    """Every extreme the contract accepts samples fine, concurrently with a greedy request whose output still
    equals the reference (nothing a batch-mate sends can fail or change it)."""
    from concurrent.futures import ThreadPoolExecutor

    from .helpers import chat_body, mixed_requests, reference_ids
    plain = mixed_requests(1, seed=3, with_images=False)[0]
    text = {"messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 12, "ignore_eos": True}

    def post(body):
        return httpx.post(server.url + "/v1/chat/completions", json=body, headers=H, timeout=120)
    with ThreadPoolExecutor(len(EXTREME) + 1) as ex:
        futures = [ex.submit(post, {**text, **e}) for e in EXTREME] + [ex.submit(post, chat_body(plain))]
        results = [f.result() for f in futures]
    for e, r in zip(EXTREME, results):
        assert r.status_code == 200, (e, r.text)
        assert r.json()["usage"]["completion_tokens"] == 12, (e, r.json())
    assert results[-1].json()["choices"][0]["token_ids"] == reference_ids(ref, plain)
    assert server.wait_idle()["kv_in_use"] == 0


def test_a_request_made_to_emit_the_image_placeholder_never_breaks_an_image_batch_mate(server, ref):
    """logit_bias can make any request emit <IMG_CONTEXT>: fed back, it is text, so the image prefills of its
    batch-mates still succeed and equal the reference, with no failed step (no isolation round, no preemption)."""
    from concurrent.futures import ThreadPoolExecutor

    from .helpers import chat_body, mixed_requests, reference_ids
    _, tok = ref
    images = [r for r in mixed_requests(6, seed=11) if not isinstance(r["messages"][0]["content"], str)]
    biased = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 40, "ignore_eos": True,
              "temperature": 0, "logit_bias": {str(tok.img_context_id): 100}, "return_token_ids": True}

    def post(body):
        return httpx.post(server.url + "/v1/chat/completions", json=body, headers=H, timeout=120)
    preemptions = metric(server.url, "u1_und_preemptions_total", H)
    with ThreadPoolExecutor(len(images) + 1) as ex:
        first = ex.submit(post, biased)
        results = [ex.submit(post, chat_body(r)) for r in images]
        assert first.result().json()["choices"][0]["token_ids"] == [tok.img_context_id] * 40
        for req, fut in zip(images, results):
            r = fut.result()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference_ids(ref, req)
    assert metric(server.url, "u1_und_preemptions_total", H) == preemptions
    assert server.wait_idle()["kv_in_use"] == 0
