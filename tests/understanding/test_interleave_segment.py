"""/internal/interleave_segment against the reference interleave loop (interleave_spec.md §2.8): the segment's
greedy text, the cond / tu / iu prefix KV (values and t offsets) of each image, and the generated images
re-entering from their float pixels in the KV pool at the positions of their gen tokens. The random tiny model
never predicts <img> on its own: logit_bias on <img> makes it do so (the reference gets the same bias)."""
from __future__ import annotations

import httpx
import pytest
import torch

from services.kit import sse
from services.model import reference as R
from services.contract.image import SamplerParams
from shm_transfer import KVLayout
from shm_transfer.tensors import tokens_for

from .conftest import HEADERS, MAX_LEN
from .test_image_prefix import _read_back as _read

MSGS = [{"role": "user", "content": "draw a cat, then tell its story"}]
SIZE = 64
BIAS = 0.2          # on the tiny model: <img>, then two text tokens between images (found with the reference)


@pytest.fixture(scope="module")
def both(tiny_dir):
    """The reference needs both branches (it denoises)."""
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    return load_model(tiny_dir, "both", dtype=torch.float32), NeoTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def answer(both):
    model, tok = both
    prefixes = {}
    params = SamplerParams(mode="edit", num_inference_steps=1, guidance_scale=3.0, image_guidance_scale=2.0)
    ans = R.interleave(model, tok, MSGS, params, SIZE, SIZE, seed=5, max_new_tokens=40, max_images=2,
                       logit_bias={tok.img_start_id: BIAS}, on_image=lambda k, p: prefixes.__setitem__(k, p))
    assert len(ans.images) == 2 and any(ans.segments[1:]), ans.segments
    return ans, prefixes


def _float_handle(server, x: torch.Tensor) -> dict:
    """What generation does with a finished image: its float pixels into pool pages of its own."""
    from shm_transfer import ShmKVPool, write_kv
    from shm_transfer.tensors import pack, tokens_for
    pool = ShmKVPool.attach(server.pool_name)
    try:
        h = pool.allocate(tokens_for(pool.layout, x.numel()), 60, branch="image")
        write_kv(pool, h, pack(x, pool.layout))
        return h.to_dict()
    finally:
        pool.close()


def _segment(server, rid: str, transcript: list, bias: float = BIAS, **kw) -> list[dict]:
    body = {"request_id": rid, "messages": MSGS, "transcript": transcript, "max_tokens": 40, "images_left": 2,
            "guidance_scale": 3.0, "image_guidance_scale": 2.0, "logit_bias": {"262": bias}, **kw}
    with httpx.stream("POST", server.url + "/internal/interleave_segment", json=body, headers=HEADERS,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        return list(sse.events(r.iter_lines()))


def _release(server, handles: list[dict]) -> None:
    r = httpx.post(server.url + "/internal/release", json={"handles": handles}, headers=HEADERS, timeout=30)
    assert r.status_code == 200


def test_segments_and_prefixes_follow_the_reference_loop(server, both, answer):
    ans, ref_prefixes = answer
    _, tok = both
    transcript, floats = [], []
    for k in range(len(ans.images)):
        events = _segment(server, f"seg-{k}", transcript)
        last = events[-1]
        assert last["type"] == "handles", events
        assert last["token_ids"] == ans.segments[k]
        assert set(last["handles"]) == {"cond", "img_cond", "uncond"}     # g != g_i, both != 1: three branches
        for branch, ref in ref_prefixes[k].items():
            h = last["handles"][branch]
            assert h["t_offset"] == ref.t_offset, (k, branch)
            torch.testing.assert_close(_read(server, h), ref.kv, atol=2e-4, rtol=1e-3)
        _release(server, list(last["handles"].values()))
        floats.append(_float_handle(server, ans.images[k][0]))
        transcript += [{"token_ids": last["token_ids"]}, {"image": floats[-1], "width": SIZE, "height": SIZE}]
    # the cap: the next <img> ends the answer, as the reference did
    events = _segment(server, "seg-last", transcript, images_left=0)
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == ans.finish_reason == "stop"
    assert events[-1]["token_ids"] == ans.segments[-1]
    _release(server, floats)
    server.wait_idle()


def test_text_events_and_the_end_of_an_answer(server, both):
    _, tok = both
    events = _segment(server, "seg-text", [], bias=0.0, max_tokens=6)
    text = "".join(e.get("content", "") for e in events if e["type"] == "text")
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length" and len(done["token_ids"]) == 6
    assert text == tok.decode(done["token_ids"], skip_special_tokens=True)
    server.wait_idle()


def test_bad_float_handles_are_refused(server):
    gone = {"handle_id": 999999, "pool_name": server.pool_name, "pool_generation": "0" * 16, "page_ids": [0],
            "num_tokens": 1, "t_offset": 0, "model_fingerprint": "x", "layout_version": 2,
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "page_tokens": 16},
            "branch": "image", "lease_deadline": 0}
    r = httpx.post(server.url + "/internal/interleave_segment", headers=HEADERS, timeout=30, json={
        "request_id": "bad", "messages": MSGS, "max_tokens": 4, "images_left": 1,
        "transcript": [{"token_ids": []}, {"image": gone, "width": 64, "height": 64}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_handle" and err["param"] == "transcript[1].image", r.text
    stale = {**gone, "num_tokens": tokens_for(KVLayout(**gone["layout"]), 3 * 64 * 64)}
    r = httpx.post(server.url + "/internal/interleave_segment", headers=HEADERS, timeout=30, json={
        "request_id": "bad1", "messages": MSGS, "max_tokens": 4, "images_left": 1,
        "transcript": [{"image": stale, "width": 64, "height": 64}]})
    err = r.json()["error"]
    assert r.status_code == 410 and err["code"] == "kv_stale_generation" and err["param"] == "transcript[0].image"
    r = httpx.post(server.url + "/internal/interleave_segment", headers=HEADERS, timeout=30, json={
        "request_id": "bad2", "messages": MSGS, "max_tokens": 4, "images_left": 1,
        "transcript": [{"image": {}, "width": 64, "height": 64}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "kv_malformed_handle" and err["param"] == "transcript[0].image"
    server.wait_idle()


def test_a_segment_is_checked_as_a_chat_is(server):
    """The segment's text is an ordinary text request: the chat's checks (inputs.text_params) answer for it."""
    def post(**kw):
        body = {"request_id": "chk", "messages": MSGS, "max_tokens": 4, "images_left": 1, **kw}
        return httpx.post(server.url + "/internal/interleave_segment", headers=HEADERS, timeout=60, json=body)
    r = post(logit_bias={"99999999": 1.0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias" and "ids are 0.." in err["message"], r.text
    r = post(messages=[{"role": "user", "content": "fox " * MAX_LEN}])
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    server.wait_idle()
