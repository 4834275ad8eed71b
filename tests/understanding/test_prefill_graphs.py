"""Prefill CUDA graphs (services/understanding/prefill_graphs.py) on the CPU, through its recording stand-in
(RecordedPrefillGraphs): "capture" keeps the closure, "replay" runs it again on the same static buffer.
What is under test is everything around the capture: the padded rows and sequences, the one buffer a step copies
in, the steps that qualify, the logits picked, and the KV the padded step writes (what an image prefix exports).
Whether CUDA's capture and replay match eager is checked on the GPU at every start (`_self_check`) and measured by
bench/bench_understanding.py (its prefix rows, graphs and eager side by side)."""
from __future__ import annotations

import random

import pytest
import torch

from services.base import knobs
from services.understanding.cuda_graphs import RecordedDecodeGraphs
from services.understanding.prefill_graphs import MAX_SEQS, RecordedPrefillGraphs
from services.understanding.step_plan import one_sequence_plan


class WrongPrefillGraphs(RecordedPrefillGraphs):
    def _capture(self, fn):
        replay, out = super()._capture(fn)
        return (lambda: (replay(), out.add_(1.0))), out


@pytest.fixture
def packed_rows(monkeypatch):
    """Graphs run where packed rows are computed whole (GPUs): the CPU's exact-row mode prefills eagerly."""
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "0")


def _runner(model, slots: int, running: int, max_len: int):
    from services.understanding.model_runner import ModelRunner
    return ModelRunner(model, slots, running, max_len, "cpu", torch.float32, warmup=False)


def test_graphed_steps_give_the_eager_logits_and_kv_step_by_step(ref, packed_rows):
    """One scheduler, two runners in lockstep: every step's logits and the whole KV pool after it agree, over
    batched prompts, chunks of long ones (rows that start past 0), prefix-cache hits, decode steps and mixed
    steps (new prompts beside decoding ones: a prefill graph, then a decode graph)."""
    from services.model import prompts as PR
    from services.understanding.protocol import SubmitRequest
    from services.understanding.sampling import SamplingParams, sample
    from services.understanding.scheduler import Scheduler
    model, tok = ref
    rng = random.Random(3)
    shared = "w" * 30
    texts = [shared + "x" * rng.randint(1, 60) for _ in range(4)] + ["y" * rng.randint(60, 90) for _ in range(2)] + \
        ["z" * rng.randint(1, 20) for _ in range(3)]
    inps = [PR.chat_input(tok, [{"role": "user", "content": t}], False) for t in texts]
    slots, running, max_len = 2048, 8, 2048
    sch = Scheduler(slots, running, max_len, 64, tok.img_context_id, True)
    eager = _runner(model, slots, running, max_len)
    graphed = _runner(model, slots, running, max_len)
    graphed.prefill_graphs = RecordedPrefillGraphs(graphed, 256)
    graphed.graphs = RecordedDecodeGraphs(graphed, running)
    assert graphed.prefill_graphs.buckets == [32, 64, 128, 192, 256]
    counts = {"graphable": 0, "past_zero": 0, "batched": 0, "split": 0, "decode": 0}

    def drain(steps: int = 500):
        for _ in range(steps):
            step = sch.schedule()
            if step is None:
                return
            plan, entries = step
            if graphed.prefill_graphs.can_run(plan):
                counts["graphable"] += 1
                counts["past_zero"] += bool((plan.p_start > 0).any())
                counts["batched"] += int(plan.p_rows.numel()) > 1
            counts["split"] += graphed._graphed_parts(plan) is not None
            counts["decode"] += graphed.graphs.can_run(plan)
            want = eager.forward(plan)
            got = graphed.forward(plan)
            if want is None:
                assert got is None or got.numel() == 0
            else:
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            # every slot but the scratch one (the padding rows write there)
            torch.testing.assert_close(graphed.kv_pool[:, :, :slots], eager.kv_pool[:, :, :slots], atol=1e-5, rtol=1e-5)
            reqs = sch.sampling_requests(entries)
            toks = sample(want, [r.params for r in reqs], [None] * len(reqs), [[]] * len(reqs),
                          [[]] * len(reqs)) if reqs else []
            sch.process(entries, {r.rid: t for r, t in zip(reqs, toks)}, {})
            sch.take_outputs()

    params = SamplingParams(max_tokens=4, temperature=0.0)
    for i, p in enumerate(inps[:6]):          # one at a time: alone, chunked (64 rows a step), cache hits
        sch.add(SubmitRequest(f"r{i}", p.input_ids, [], params))
        drain()
    for i, p in enumerate(inps[6:]):          # together: one batched prefill
        sch.add(SubmitRequest(f"b{i}", p.input_ids, [], params))
    drain()
    sch.add(SubmitRequest("long", inps[4].input_ids, [], SamplingParams(max_tokens=12, temperature=0.0)))
    step = 0
    while sch.has_work:                        # prompts arriving while one decodes: mixed steps
        if step in (2, 4):
            sch.add(SubmitRequest(f"m{step}", inps[step].input_ids, [], params))
        step += 1
        drain(steps=1)
    assert not sch.has_work
    assert counts["past_zero"] >= 2 and counts["batched"] >= 1
    assert counts["split"] >= 2 and counts["decode"] >= 4, counts
    assert graphed.prefill_graphs.replays == counts["graphable"] + counts["split"]
    assert graphed.graphs.replays == counts["decode"] + counts["split"]
    assert counts["graphable"] >= 8


def test_which_steps_replay(ref, packed_rows, monkeypatch):
    from services.understanding.step_plan import StepPlan
    model, _ = ref
    runner = _runner(model, 1024, 8, 1024)
    graphs = RecordedPrefillGraphs(runner, 100)
    assert graphs.buckets == [32, 64] and graphs.max_tokens == 64
    one = one_sequence_plan(torch.arange(40), torch.arange(40), 1)
    assert graphs.can_run(one)
    assert not graphs.can_run(one_sequence_plan(torch.arange(65), torch.arange(65), 1))   # past the largest bucket

    def packed(lengths, logit_rows=None):
        cu = torch.tensor([0] + lengths).cumsum(0)
        n = int(cu[-1])
        i64 = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return StepPlan(input_ids=torch.arange(n) % 50, positions=torch.arange(n).repeat(3, 1),
                        image_end=torch.zeros(n, dtype=torch.int32), images=[], out_slots=torch.arange(n),
                        num_prefill_rows=n, p_rows=i64(list(range(len(lengths)))), p_start=i64([0] * len(lengths)),
                        p_seq_len=i64(lengths), p_cu_q=cu, d_rows=i64([]), d_seq_len=i64([]),
                        logit_rows=cu[1:] - 1 if logit_rows is None else i64(logit_rows))

    assert graphs.can_run(packed([5] * MAX_SEQS))
    assert not graphs.can_run(packed([5] * (MAX_SEQS + 1)))            # more sequences than a graph holds
    assert not graphs.can_run(packed([5, 7], logit_rows=[3]))          # a row that is not a sequence's last
    assert graphs.can_run(packed([5, 7], logit_rows=[11]))             # the second sequence's logits alone
    mixed = packed([5])
    mixed.d_rows, mixed.d_seq_len = torch.tensor([2]), torch.tensor([9])
    mixed.input_ids = torch.arange(6)
    assert not graphs.can_run(mixed)                                   # decode rows: eager
    image = packed([8])
    image.image_end[2:6] = 6
    assert not graphs.can_run(image)
    lora = packed([8])
    lora.lora_slots = torch.zeros(8, dtype=torch.int32)
    assert not graphs.can_run(lora)
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "1")
    assert not graphs.can_run(one)                                     # exact rows: every prefill eager

    # logits of a subset, in the plan's order
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "0")
    plan = packed([5, 7, 3], logit_rows=[14, 4])
    for b, (lo, hi) in enumerate([(0, 5), (5, 12), (12, 15)]):
        runner.req_to_token[b, :hi - lo] = torch.arange(lo, hi, dtype=torch.int32)
    got = graphs.run(plan)
    want = runner.eager_forward(plan)
    assert got.shape == (2, want.shape[1])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_replay_that_differs_from_eager_is_refused_at_start(ref, packed_rows):
    model, _ = ref
    runner = _runner(model, 512, 4, 512)
    with pytest.raises(RuntimeError, match="differs from the eager forward"):
        WrongPrefillGraphs(runner, 64)
    # the self-check leaves no trace outside the scratch slot (the padding rows write there, as the warm-up does)
    assert int(runner.req_to_token[0].abs().sum()) == 0 and float(runner.kv_pool[:, :, :512].abs().sum()) == 0.0


def test_a_mixed_step_splits_into_its_prefill_and_its_decode_rows():
    from services.understanding.step_plan import StepPlan, split_prefill_decode
    i64 = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    n, d = 7, 3                                # 7 prefill rows (two prompts: 4 + 3), then 3 decode rows
    plan = StepPlan(input_ids=torch.arange(n + d), positions=torch.arange(n + d).repeat(3, 1),
                    image_end=torch.zeros(n + d, dtype=torch.int32), images=[], out_slots=torch.arange(100, 110),
                    num_prefill_rows=n, p_rows=i64([0, 1]), p_start=i64([0, 5]), p_seq_len=i64([4, 8]),
                    p_cu_q=i64([0, 4, 7]), d_rows=i64([2, 3, 4]), d_seq_len=i64([9, 9, 9]),
                    logit_rows=i64([6, 7, 8, 9]))
    prefill, decode = split_prefill_decode(plan)
    assert prefill.num_tokens == n and prefill.logit_rows.tolist() == [6] and prefill.out_slots[-1] == 106
    assert decode.num_prefill_rows == 0 and decode.num_tokens == d and decode.logit_rows.tolist() == [0, 1, 2]
    assert decode.out_slots.tolist() == [107, 108, 109] and decode.d_rows.tolist() == [2, 3, 4]
    plan.logit_rows = i64([7, 6, 8, 9])        # logits wanted out of row order: not split
    assert split_prefill_decode(plan) is None
    plan.logit_rows = i64([6, 7, 8, 9])
    plan.images = ["an image"]                 # input images: not split (the vision rows are the step's)
    assert split_prefill_decode(plan) is None
    plan.images, plan.num_prefill_rows = [], n + d
    assert split_prefill_decode(plan) is None  # one kind of rows only


def test_exact_rows_decode_several_rows_eagerly(ref, monkeypatch):
    """Exact-row mode computes each sequence's rows alone; a graph computes a batch whole, so only a one-row decode
    step replays there (the prefill graphs take no step at all: test_which_steps_replay)."""
    from services.understanding.cuda_graphs import RecordedDecodeGraphs
    from services.understanding.step_plan import StepPlan
    model, _ = ref
    runner = _runner(model, 256, 4, 256)
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "0")
    graphs = RecordedDecodeGraphs(runner, 4)
    i64 = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731

    def decode(b):
        return StepPlan(input_ids=torch.zeros(b, dtype=torch.long), positions=torch.zeros(3, b, dtype=torch.long),
                        image_end=torch.zeros(b, dtype=torch.int32), images=[], out_slots=torch.arange(b),
                        num_prefill_rows=0, p_rows=i64([]), p_start=i64([]), p_seq_len=i64([]), p_cu_q=i64([0]),
                        d_rows=torch.arange(b), d_seq_len=torch.ones(b, dtype=torch.long), logit_rows=torch.arange(b))

    assert graphs.can_run(decode(1)) and graphs.can_run(decode(3))
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "1")
    assert graphs.can_run(decode(1)) and not graphs.can_run(decode(3))
