"""In-process checks of the engine's parts: KV allocator, radix cache, sampling, detokenisation / think
split / stop strings, and the scheduler's preemption path against the reference (tiny KV cache)."""
from __future__ import annotations

import random

import pytest
import torch

from services.understanding.detokenizer import IncrementalDetokenizer, OutputText
from services.understanding.kv_allocator import KVSlotAllocator, OutOfSlots
from services.understanding.radix_cache import RadixCache, image_digest, image_keys
from services.understanding.sampling import SamplingParams, sample


def test_allocator_never_partially_allocates():
    a = KVSlotAllocator(8)
    s = a.alloc(5)
    assert len(set(s.tolist())) == 5 and a.num_free == 3
    with pytest.raises(OutOfSlots):
        a.alloc(4)
    a.free(s)
    assert a.num_free == 8


def test_radix_cache_match_insert_evict():
    a = KVSlotAllocator(32)
    c = RadixCache(a.free)
    k1 = [1, 2, 3, 4, 5]
    s1 = a.alloc(5)
    assert c.insert(k1, s1) == 0
    got, node = c.match_prefix([1, 2, 3, 9])
    assert got.tolist() == s1[:3].tolist()
    c.lock(node)
    assert c.evictable_tokens == 2 and c.protected_tokens == 3
    s2 = a.alloc(5)
    assert c.insert([1, 2, 3, 7, 8], s2) == 3   # the first 3 were cached; the caller frees its copies
    a.free(s2[:3])
    assert c.evict(100) == 4                    # the unlocked leaves [4, 5] and [7, 8]
    assert c.total_tokens == 3
    c.unlock(node)
    assert c.evict(100) == 3 and a.num_free == 32


def test_image_keys_are_content_hashed():
    pv = torch.randn(16, 768)
    d1 = image_digest(pv, (4, 4))
    assert d1 == image_digest(pv.clone(), (4, 4))
    assert d1 != image_digest(pv + 1e-3, (4, 4)) and d1 != image_digest(pv, (2, 8))
    keys = image_keys(d1, 4)
    assert len(set(keys)) == 4 and all(k < 0 for k in keys)


def test_sampling_greedy_seed_and_filters():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits[:1], [greedy], [None], [[]], [[]]) == [int(logits[0].argmax())]
    p = SamplingParams(temperature=1.0, seed=7, top_k=5)
    runs = [sample(logits[1:2].clone(), [p], [p.make_generator("cpu")], [[]], [[]]) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    top5 = set(torch.topk(logits[1], 5).indices.tolist())
    g = p.make_generator("cpu")
    assert all(sample(logits[1:2].clone(), [p], [g], [[]], [[]])[0] in top5 for _ in range(30))
    tp = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert sample(logits[2:3].clone(), [tp], [tp.make_generator("cpu")], [[]], [[]]) == [int(logits[2].argmax())]
    # a strong repetition penalty moves greedy off an already generated token
    row = torch.zeros(1, 10)
    row[0, 3] = 5.0
    row[0, 4] = 4.0
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(row.clone(), [rep], [None], [[]], [[3]]) == [4]
    freq = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample(row.clone(), [freq], [None], [[]], [[3]]) == [4]


class _Tok:
    """Byte tokenizer stub with two special ids, enough for the output-text logic."""
    think_id, end_think_id, eos = 1000, 1001, 1002

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_detokenizer_holds_partial_characters():
    d = IncrementalDetokenizer(_Tok())
    euro = list("€".encode())
    assert d.push(euro[:1]) == "" and d.push(euro[1:2]) == ""
    assert d.push(euro[2:]) == "€"
    assert d.push(list(b"ab")) == "ab"


def test_detokenizer_does_not_hold_stray_bytes_forever():
    """Continuation bytes with no lead byte never form a character: after a few tokens they stream as U+FFFD."""
    d = IncrementalDetokenizer(_Tok())
    out = [d.push([0x80]) for _ in range(6)]
    assert out[:4] == [""] * 4 and out[4] == "\ufffd" * 5 and out[5] == ""
    assert d.push(list("é".encode())) == "\ufffdé" and d.flush() == ""


def test_think_split_and_stop_strings():
    tok = _Tok()
    out = OutputText(tok, True, ["STOP"], {tok.eos})
    r, c = out.push(list(b"plan") + [tok.end_think_id] + list(b"answer ST"))
    assert r == "plan" and c == "answer"   # "ST" held back: it may start a stop string
    r, c = out.push(list(b"OP tail"))
    assert out.stopped and c == " "
    assert out.content_text == "answer " and out.reasoning_text == "plan"
    auto = OutputText(tok, None, [], {tok.eos})
    r, c = auto.push([tok.think_id] + list(b"hm") + [tok.end_think_id] + list(b"ok") + [tok.eos])
    r2, c2 = auto.finish()
    assert r + r2 == "hm" and c + c2 == "ok"
    plain = OutputText(tok, False, [], {tok.eos})
    _, c = plain.push(list(b"x") + [tok.eos])
    assert c + plain.finish()[1] == "x"


def test_scheduler_preempts_and_still_matches_reference(ref):
    """A KV cache far too small for the batch: requests get preempted (recompute) and outputs stay exact."""
    from services.model import prompts as PR
    from services.model import reference as R
    from services.understanding.model_runner import ModelRunner
    from services.understanding.protocol import SubmitRequest
    from services.understanding.scheduler import Scheduler
    model, tok = ref
    rng = random.Random(0)
    inps = [PR.chat_input(tok, [{"role": "user", "content": "z" * rng.randint(1, 40)}], False) for _ in range(6)]
    expected = [R.generate_text(model, tok, p, max_new_tokens=16) for p in inps]
    slots = 120
    sch = Scheduler(slots, 8, slots, 16, tok.img_context_id)
    runner = ModelRunner(model, slots, 8, slots, "cpu", torch.float32)
    for i, p in enumerate(inps):
        sch.add(SubmitRequest(f"r{i}", p.input_ids, p.images, SamplingParams(max_tokens=16, temperature=0.0),
                              stop_token_ids=[tok.im_end_id]))
    got: dict[str, list[int]] = {}
    for _ in range(2000):
        step = sch.schedule()
        if step is None:
            break
        plan, entries = step
        logits = runner.forward(plan)
        reqs = sch.sampling_requests(entries)
        toks = sample(logits, [r.params for r in reqs], [None] * len(reqs), [[]] * len(reqs),
                      [[]] * len(reqs)) if reqs else []
        sch.process(entries, {r.rid: t for r, t in zip(reqs, toks)}, {})
        for o in sch.take_outputs():
            got.setdefault(o.rid, []).extend(o.new_ids)
    assert not sch.has_work
    assert sch.stats.preemptions > 0
    for i, exp in enumerate(expected):
        assert [t for t in got[f"r{i}"] if t != tok.im_end_id] == exp
    snap = sch.snapshot()
    assert snap.kv_in_use == 0 and snap.kv_free + snap.kv_cached == slots


def test_failed_step_frees_its_slots_and_fails_only_its_requests():
    from services.understanding.protocol import SubmitRequest
    from services.understanding.scheduler import Scheduler
    sch = Scheduler(64, 4, 64, 0, img_context_id=9999)
    sch.add(SubmitRequest("a", list(range(10)), [], SamplingParams(max_tokens=4)))
    plan, entries = sch.schedule()
    assert sch.alloc.num_free == 54
    sch.fail_step(entries, "boom")
    outs = sch.take_outputs()
    assert [(o.rid, o.finish_reason, o.error_code) for o in outs] == [("a", "error", "engine_error")]
    assert sch.alloc.num_free == 64 and not sch.has_work


def test_many_small_prefills_never_overcommit_the_cache():
    """Several waiting prompts that each fit alone but not together: the step takes only what fits."""
    from services.understanding.protocol import SubmitRequest
    from services.understanding.scheduler import Scheduler
    sch = Scheduler(100, 8, 100, 0, img_context_id=9999)
    for i in range(5):
        sch.add(SubmitRequest(f"p{i}", list(range(i, i + 40)), [], SamplingParams(max_tokens=4)))
    plan, entries = sch.schedule()
    assert sum(e - s for _, s, e in entries) <= 100 and len(entries) == 2
    assert sch.alloc.num_free + sum(e - s for _, s, e in entries) == 100


def test_a_generated_image_context_token_is_text_beside_an_image_prefill(ref):
    """A sampled <IMG_CONTEXT> (here forced by logit_bias; a random or hostile-biased model can emit it) is fed
    back as text, as the reference decodes it. A step that also prefilled an input image counted it as an image row
    and failed whole ("N <IMG_CONTEXT> tokens but N-1 image tokens": the intermittent 500s of the load test)."""
    from services.model import prompts as PR
    from services.model import reference as R
    from services.understanding.model_runner import ModelRunner
    from services.understanding.protocol import SubmitRequest
    from services.understanding.scheduler import Scheduler

    from .conftest import IMG_MAX, IMG_MIN
    from .helpers import make_image
    model, tok = ref
    ctx = tok.img_context_id
    pil, _ = make_image(3, 64, 48)
    text = PR.chat_input(tok, [{"role": "user", "content": "say it"}], False)
    image = PR.chat_input(tok, [{"role": "user", "content": [{"type": "image", "image": pil},
                                                             {"type": "text", "text": "what is it"}]}],
                          False, IMG_MIN, IMG_MAX)
    slots = 512
    sch = Scheduler(slots, 4, slots, 0, ctx)
    runner = ModelRunner(model, slots, 4, slots, "cpu", torch.float32)
    sch.add(SubmitRequest("text", text.input_ids, [], SamplingParams(max_tokens=6, temperature=0.0,
                                                                     logit_bias={ctx: 100.0})))
    got: dict[str, list[int]] = {}
    shared = 0
    for step in range(50):
        if step == 2:                         # "text" is decoding <IMG_CONTEXT> by now
            sch.add(SubmitRequest("image", image.input_ids, image.images, SamplingParams(max_tokens=4, temperature=0.0),
                                  stop_token_ids=[tok.im_end_id]))
        scheduled = sch.schedule()
        if scheduled is None:
            break
        plan, entries = scheduled
        shared += bool(plan.images) and bool(((plan.input_ids == ctx) & (plan.image_end == 0)).any())
        logits = runner.forward(plan)
        reqs = sch.sampling_requests(entries)
        toks = sample(logits, [r.params for r in reqs], [None] * len(reqs), [r.tokens for r in reqs],
                      [r.output_ids for r in reqs]) if reqs else []
        sch.process(entries, {r.rid: t for r, t in zip(reqs, toks)}, {})
        for o in sch.take_outputs():
            assert o.finish_reason != "error", o
            got.setdefault(o.rid, []).extend(o.new_ids)
    assert shared, "the image prefill never shared a step with a generated <IMG_CONTEXT>"
    assert got["text"] == [ctx] * 6
    assert [t for t in got["image"] if t != tok.im_end_id] == R.generate_text(model, tok, image, max_new_tokens=4)
