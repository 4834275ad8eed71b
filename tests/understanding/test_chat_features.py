"""Chat features through the real server: think mode split, seeded sampling, stop strings, native API."""
from __future__ import annotations


import httpx

from services.kit import sse
from services.model import prompts as PR
from services.model import reference as R

from .conftest import HEADERS


def _chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 12, **body},
                   headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_enable_thinking_splits_reasoning(server, ref):
    model, tok = ref
    msgs = [{"role": "user", "content": "think about it"}]
    out = _chat(server, messages=msgs, temperature=0, max_tokens=20, return_token_ids=True,
                chat_template_kwargs={"enable_thinking": True})
    ids = R.generate_text(model, tok, PR.chat_input(tok, msgs, True), max_new_tokens=20, keep_stop=True)
    assert out["choices"][0]["token_ids"] == ids
    msg = out["choices"][0]["message"]
    if tok.end_think_id in ids:
        cut = ids.index(tok.end_think_id)
        assert msg["reasoning_content"] == tok.decode(ids[:cut], skip_special_tokens=True)
        assert msg["content"] == tok.decode(ids[cut + 1:], skip_special_tokens=True)
    else:   # the random tiny model never closed the block: everything is reasoning
        assert msg["reasoning_content"] == tok.decode(ids, skip_special_tokens=True) and msg["content"] == ""


def test_seeded_sampling_is_reproducible(server):
    body = dict(messages=[{"role": "user", "content": "random please"}], temperature=1.0, top_p=0.9, top_k=50,
                seed=1234, return_token_ids=True, max_tokens=16)
    a, b = _chat(server, **body), _chat(server, **body)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    c = _chat(server, **{**body, "seed": 99})
    assert c["choices"][0]["token_ids"] != a["choices"][0]["token_ids"]


def test_stop_string_truncates(server):
    base = _chat(server, messages=[{"role": "user", "content": "abc"}], temperature=0, max_tokens=16)
    text = base["choices"][0]["message"]["content"]
    printable = [i for i, ch in enumerate(text) if ch.isalnum() and i > 0]
    if not printable:
        return   # nothing usable as a stop string in this random output
    i = printable[0]
    out = _chat(server, messages=[{"role": "user", "content": "abc"}], temperature=0, max_tokens=16,
                stop=[text[i]])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["message"]["content"] == text[:text.index(text[i])]


def test_generate_stream_native(server):
    body = {"inputs": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
            "parameters": {"max_new_tokens": 5, "do_sample": False}}
    plain = httpx.post(server.url + "/generate", json=body, headers=HEADERS, timeout=60).json()
    events = []
    with httpx.stream("POST", server.url + "/generate_stream", json=body, headers=HEADERS, timeout=60) as r:
        events += sse.events(r.iter_lines())
    assert events[-1]["finished"] and events[-1]["finish_reason"] == plain["finish_reason"]
    assert "".join(e["token"]["text"] for e in events) == plain["generated_text"][0]
