"""OpenAI chat details through the real understanding server: the official default prompt, logprobs and
top_logprobs against the reference model's own distribution, logit_bias, n choices (seeds seed + i), and the
usage chunk of a stream."""
from __future__ import annotations

import httpx
import pytest
import torch

from services.kit import sse
from services.model import prompts as PR
from services.model import reference as R

from tests.metrics import metric

from .conftest import HEADERS

MSGS = [{"role": "user", "content": "Tell me a story"}]


def _chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, **body},
                   headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, **body) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=HEADERS, timeout=120,
                      json={"model": "tiny", "max_tokens": 8, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return list(sse.events(r.iter_lines()))


def test_default_prompt_is_the_official_template(ref):
    """No chat_template_kwargs: the prompt ends at 'assistant\\n' (official chat()); false adds the empty think
    block, true opens <think>."""
    _, tok = ref
    official = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n"
    assert PR.chat_input(tok, MSGS).input_ids == tok.encode(official)
    assert PR.chat_input(tok, MSGS, None).input_ids == tok.encode(official)
    assert PR.chat_input(tok, MSGS, False).input_ids == tok.encode(official + "<think>\n\n</think>\n\n")
    assert PR.chat_input(tok, MSGS, True).input_ids == tok.encode(official + "<think>\n")


@pytest.mark.parametrize("kwargs, suffix", [(None, ""), ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
                                            ({"enable_thinking": True}, "<think>\n")])
def test_served_prompt_follows_enable_thinking(server, ref, kwargs, suffix):
    model, tok = ref
    body = {"messages": MSGS, "temperature": 0, "max_tokens": 10, "return_token_ids": True}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    out = _chat(server, **body)
    official = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n" + suffix
    want = R.generate_text(model, tok, PR.PromptInput(tok.encode(official)), max_new_tokens=10, keep_stop=True)
    assert out["choices"][0]["token_ids"] == want


def _reference_logprobs(model, tok, ids_prompt: list[int], out_ids: list[int]) -> list[torch.Tensor]:
    """log_softmax of the reference's logits at each generated position."""
    cache, positions, hidden = R.prefill(model, PR.PromptInput(ids_prompt))
    t_last = int(positions[0].max())
    rows = [torch.log_softmax(model.lm_logits(hidden[-1:])[0], -1)]
    for t in out_ids[:-1]:
        hidden, t_last = R._append_text(model, cache, [t], t_last)
        rows.append(torch.log_softmax(model.lm_logits(hidden[-1:])[0], -1))
    return rows


def test_logprobs_and_top_logprobs_match_the_reference(server, ref):
    model, tok = ref
    out = _chat(server, messages=MSGS, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3,
                return_token_ids=True, ignore_eos=True)
    choice = out["choices"][0]
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    assert len(entries) == len(ids) == 6
    ref_rows = _reference_logprobs(model, tok, PR.chat_input(tok, MSGS).input_ids, ids)
    text = b""
    for tid, entry, row in zip(ids, entries, ref_rows):
        assert entry["logprob"] == pytest.approx(float(row[tid]), abs=1e-4)
        assert len(entry["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)
        best = torch.topk(row, 3)
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert bytes(entry["bytes"]) == tok.token_bytes(tid)
        text += bytes(entry["bytes"])
    assert text.decode("utf-8", errors="replace") == choice["message"]["content"]


def test_no_logprobs_unless_asked(server):
    out = _chat(server, messages=MSGS, temperature=0, max_tokens=3)
    assert out["choices"][0]["logprobs"] is None
    bad = httpx.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                     json={"messages": MSGS, "top_logprobs": 2})
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]


def test_logprobs_stream_per_token(server):
    events = _stream(server, messages=MSGS, temperature=0, max_tokens=5, logprobs=True, ignore_eos=True)
    entries = [e for ev in events if ev.get("choices") for c in ev["choices"] if c.get("logprobs")
               for e in c["logprobs"]["content"]]
    assert len(entries) == 5 and all(e["top_logprobs"] == [] for e in entries)


def test_logit_bias_forces_a_token(server, ref):
    _, tok = ref
    target = tok.encode("Q")[0]
    out = _chat(server, messages=MSGS, temperature=0, max_tokens=4, logit_bias={str(target): 100},
                return_token_ids=True)
    assert out["choices"][0]["token_ids"] == [target] * 4
    bad = httpx.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                     json={"messages": MSGS, "logit_bias": {"999999": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_n_choices_are_seeded_samples(server):
    body = dict(messages=MSGS, temperature=1.0, seed=77, max_tokens=8, return_token_ids=True, ignore_eos=True)
    out = _chat(server, n=3, **body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for i, c in enumerate(out["choices"]):
        alone = _chat(server, **{**body, "seed": 77 + i})
        assert c["token_ids"] == alone["choices"][0]["token_ids"], i
    assert out["usage"]["completion_tokens"] == 24
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 24


def test_n_choices_stream_with_usage(server):
    events = _stream(server, messages=MSGS, temperature=0, n=2, max_tokens=4, ignore_eos=True,
                     stream_options={"include_usage": True})
    finishes = {c["index"]: c["finish_reason"] for ev in events for c in ev.get("choices", []) if c["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    text = {0: "", 1: ""}
    for ev in events:
        for c in ev.get("choices", []):
            text[c["index"]] += c["delta"].get("content") or ""
    assert text[0] == text[1]                          # greedy: the same answer twice
    usage = [ev["usage"] for ev in events if ev.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 8
    assert events[-1]["choices"] == [] and server.wait_idle()["running"] == 0


def _prefilled_prompt_tokens(server) -> tuple[float, float]:
    """(prompt tokens admitted, of them found in the prefix cache) from the service's /metrics."""
    return (metric(server.url, "u1_und_prompt_tokens_total", HEADERS),
            metric(server.url, "u1_und_prompt_tokens_cached_total", HEADERS))


def test_n_choices_prefill_the_prompt_once(server):
    """The n choices share the prompt's KV: choice 0 computes it, every other one finds it in the prefix cache
    and computes only the last prompt token (a cache match always leaves one), so n = 3 costs two tokens more
    than n = 1 (each in its own cache_salt domain: nothing cached before)."""
    computed = {}
    for n, salt in ((1, "n-once-a"), (3, "n-once-b")):
        admitted, cached = _prefilled_prompt_tokens(server)
        out = _chat(server, messages=MSGS, temperature=1.0, seed=5, max_tokens=4, n=n, cache_salt=salt)
        assert len(out["choices"]) == n
        admitted2, cached2 = _prefilled_prompt_tokens(server)
        prompt = out["usage"]["prompt_tokens"]
        assert admitted2 - admitted == n * prompt
        computed[n] = (admitted2 - admitted) - (cached2 - cached)
    assert computed[1] == prompt and computed[3] == prompt + 2, computed
    server.wait_idle()
