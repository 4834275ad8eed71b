"""Colocate QoS in understanding's scheduler (prefill.py): a chat's prefill goes before image-prefix prefills queued
ahead of it, and while chats decode an image prefix gets at most IMAGE_PREFILL_WITH_DECODES tokens a step, so every
decode step stays short (asserted on the plans the real scheduler builds, step by step, not on wall time)."""
from __future__ import annotations

import torch

from services.model.images import ImageTensor
from services.understanding.prefill import IMAGE_PREFILL_WITH_DECODES as CAP
from services.understanding.protocol import SubmitRequest
from services.understanding.sampling import SamplingParams
from services.understanding.scheduler import Scheduler

IMG = 9999


def chat(rid: str, n: int = 20, max_tokens: int = 50) -> SubmitRequest:
    return SubmitRequest(rid, list(range(1, n + 1)), [], SamplingParams(max_tokens=max_tokens))


def prefix(rid: str, n: int, image_tokens: int = 0) -> SubmitRequest:
    """An image job's prefix: n text tokens, then (optionally) one input image of `image_tokens` tokens."""
    ids, images = list(range(100, 100 + n)), []
    if image_tokens:
        side = int((image_tokens * 4) ** 0.5)
        images = [ImageTensor(torch.zeros(side * side, 768), (side, side))]
        ids += [IMG] * (side * side // 4) + [5]
    return SubmitRequest(rid, ids, images, SamplingParams(max_tokens=1), kind="prefix")


def step(sch: Scheduler) -> dict[str, tuple[int, int]]:
    """One scheduled step, advanced as the engine would (token 7 sampled for each request that samples): the
    (start, end) of every request in it."""
    plan, entries = sch.schedule()
    sch.process(entries, {r.rid: 7 for r in sch.sampling_requests(entries)}, {})
    return {r.rid: (s, e) for r, s, e in entries}


def decoding_chat(sch: Scheduler, rid: str = "a") -> None:
    sch.add(chat(rid))
    step(sch)                         # its prompt
    assert sch.reqs[rid].is_decode


def test_a_chat_prefill_goes_before_image_prefixes_queued_ahead_of_it():
    sch = Scheduler(4096, 8, 4096, 512, IMG)
    sch.add(prefix("img1", 300))
    sch.add(prefix("img2", 300))
    sch.add(chat("b"))               # arrives last
    first = step(sch)
    assert list(first)[0] == "b" and first["b"] == (0, 20)           # whole, first in the step
    assert first["img1"] == (0, 300) and first["img2"] == (0, 512 - 20 - 300)   # the rest of the budget, FIFO


def test_while_chats_decode_an_image_prefix_takes_at_most_the_cap_per_step():
    sch = Scheduler(8192, 8, 8192, 4096, IMG)
    decoding_chat(sch)
    sch.add(prefix("img", 1000))
    rows, image_tokens = [], []
    while "img" in sch.reqs and sch.reqs["img"].pending > 0 and len(rows) < 20:
        got = step(sch)
        rows.append("a" in got and got["a"][1] - got["a"][0] == 1)   # the chat decoded in this step
        s, e = got.get("img", (0, 0))
        image_tokens.append(e - s)
    assert all(rows), rows                                            # every step kept the chat decoding
    assert max(image_tokens) == CAP and sum(image_tokens) == 1000      # the prefix still finished
    assert len(image_tokens) == -(-1000 // CAP)
    assert sch.prefill.image_tokens_held > 0


def test_without_decodes_an_image_prefix_takes_the_whole_budget():
    sch = Scheduler(8192, 8, 8192, 4096, IMG)
    sch.add(prefix("img", 1000))
    assert step(sch)["img"] == (0, 1000)
    assert sch.prefill.image_tokens_held == 0


def test_an_image_span_larger_than_the_cap_goes_whole_as_the_steps_only_image_chunk():
    sch = Scheduler(8192, 8, 8192, 4096, IMG)
    decoding_chat(sch)
    sch.add(prefix("edit", 10, image_tokens=400))          # 10 text tokens, then a 400-token image span
    sch.add(prefix("img2", 100))
    spans = []
    for _ in range(4):
        got = step(sch)
        assert got["a"][1] - got["a"][0] == 1              # the chat decodes in every step
        spans.append({k: e - s for k, (s, e) in got.items() if k != "a"})
    assert spans[0] == {"edit": 10, "img2": 100}           # text up to the span, then the next prefix's tokens
    assert spans[1] == {"edit": 400}                       # the span whole (never split), alone
    assert spans[2] == {"edit": 1}                         # then the text after it
    assert all(sum(s.values()) <= CAP for i, s in enumerate(spans) if i != 1)
