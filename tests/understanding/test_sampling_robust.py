"""The sampler cannot break for any value the contract accepts: a seeded sweep over extreme parameters and
hostile logits (huge, NaN, inf, all masked) always yields a token id in the vocabulary; a row that raises
anyway fails only its request; fatal GPU errors are told apart from recoverable ones; engine devices always
carry a CUDA index."""
from __future__ import annotations

import random

import pytest
import torch

from services.contract import limits as L
from services.contract.chat import TextSampling
from services.understanding.devices import rank_device
from services.understanding.protocol import SubmitRequest
from services.understanding.sampling import SamplingFailure, SamplingParams, is_fatal_device_error, sample
from services.understanding.scheduler import Scheduler

V = 64
BIG = torch.finfo(torch.float32).max

EXTREMES = {
    "temperature": [0.0, 1e-7, L.GREEDY_TEMPERATURE, 1e-3, 0.7, L.MAX_TEMPERATURE],
    "top_p": [5e-324, 1e-9, 0.5, 1.0],
    "top_k": [-1, 0, 1, 2, 10**9],
    "min_p": [0.0, 1e-12, 0.5, 1.0],
    "repetition_penalty": [1e-300, 1e-6, 1.0, L.MAX_REPETITION_PENALTY],
    "presence_penalty": [-L.MAX_ABS_PENALTY, 0.0, L.MAX_ABS_PENALTY],
    "frequency_penalty": [-L.MAX_ABS_PENALTY, 0.0, L.MAX_ABS_PENALTY],
    "seed": [None, 0, L.SEED_MAX],
}


def _rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(V, generator=g)
    huge = torch.full((V,), BIG)
    huge[::2] = -BIG
    rows = {
        "normal": normal,
        "huge_positive": torch.full((V,), 3e38),
        "huge_mixed": huge,
        "one_nan": normal.clone().index_fill_(0, torch.tensor([3]), float("nan")),
        "nan_and_inf": normal.clone().index_fill_(0, torch.tensor([1]), float("inf"))
                                     .index_fill_(0, torch.tensor([2]), float("nan")),
        "all_neg_inf": torch.full((V,), float("-inf")),
        "all_nan": torch.full((V,), float("nan")),
        "one_finite": torch.full((V,), float("-inf")).index_fill_(0, torch.tensor([7]), 1e30),
        "tiny_spread": torch.full((V,), 1e-38),
    }
    return rows


def _params(rng: random.Random) -> SamplingParams:
    fields = {k: rng.choice(v) for k, v in EXTREMES.items()}
    req = TextSampling.model_validate(fields)          # only values the contract accepts
    return SamplingParams.from_request(req, max_tokens=8)


def test_sweep_over_extreme_values_always_gives_a_valid_token(test_seed):
    rng = random.Random(test_seed)          # varies with U1SERVE_TEST_SEED; printed on failure
    rows = _rows()
    names = list(rows)
    prompt = [1, 5, 9, 63, 10**6, -4]                  # ids outside the vocabulary are ignored, not indexed
    output = [5, 5, 9, 2]
    for trial in range(400):
        batch = [rng.choice(names) for _ in range(3)]
        logits = torch.stack([rows[n] for n in batch])
        params = [_params(rng) for _ in batch]
        gens = [p.make_generator("cpu") for p in params]
        toks = sample(logits.clone(), params, gens, [prompt] * 3, [output] * 3)
        for name, p, t in zip(batch, params, toks):
            assert isinstance(t, int) and 0 <= t < V, (trial, name, p, t)


@pytest.mark.parametrize("field", list(EXTREMES))
def test_each_extreme_value_on_every_hostile_row(field):
    """Every extreme of one field, the others at their defaults, on every hostile row."""
    for value in EXTREMES[field]:
        p = SamplingParams.from_request(TextSampling.model_validate({field: value, "temperature": 1.0}
                                                                      if field != "temperature" else {field: value}),
                                        max_tokens=4)
        for name, row in _rows().items():
            t = sample(row[None].clone(), [p], [p.make_generator("cpu")], [[1, 2, 3]], [[2, 2]])[0]
            assert isinstance(t, int) and 0 <= t < V, (field, value, name, t)


def test_the_best_token_survives_every_filter():
    row = torch.arange(V, dtype=torch.float32)[None]      # token V-1 is the best
    for p in [SamplingParams(temperature=1e-5, seed=1), SamplingParams(temperature=2.0, top_p=5e-324, seed=2),
              SamplingParams(temperature=2.0, min_p=1.0, seed=3), SamplingParams(temperature=1.0, top_k=1)]:
        assert sample(row.clone(), [p], [p.make_generator("cpu")], [[]], [[]]) == [V - 1], p


def test_greedy_below_the_epsilon_and_min_p():
    assert SamplingParams(temperature=L.GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=L.GREEDY_TEMPERATURE).greedy
    # min_p = 0.5 keeps only tokens at least half as likely as the best: here tokens 0 and 1
    row = torch.full((1, V), -30.0)
    row[0, 0], row[0, 1] = 0.0, -0.1
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=5)
    g = p.make_generator("cpu")
    assert {sample(row.clone(), [p], [g], [[]], [[]])[0] for _ in range(60)} == {0, 1}


def test_a_row_that_raises_fails_only_its_request():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    good, bad = SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)
    toks = sample(logits, [good, bad, SamplingParams(temperature=0.0)], [good.make_generator("cpu"), object(), None],
                  [[]] * 3, [[]] * 3)
    assert isinstance(toks[0], int) and isinstance(toks[1], SamplingFailure) and toks[2] == int(logits[2].argmax())
    # the scheduler fails that request alone; its batch-mate goes on
    sch = Scheduler(64, 4, 64, 0, img_context_id=9999)
    sch.add(SubmitRequest("a", [1, 2, 3], [], SamplingParams(max_tokens=4)))
    sch.add(SubmitRequest("b", [4, 5, 6], [], SamplingParams(max_tokens=4)))
    plan, entries = sch.schedule()
    sch.process(entries, {"a": 7, "b": toks[1]}, {})
    outs = {o.rid: o for o in sch.take_outputs()}
    assert outs["b"].finish_reason == "error" and outs["b"].error_code == "sampling_error"
    assert outs["a"].finish_reason is None and outs["a"].new_ids == [7]
    assert [r.rid for r in sch.running] == ["a"]


def test_fatal_device_errors_are_recognised():
    assert is_fatal_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    if hasattr(torch, "AcceleratorError"):
        assert is_fatal_device_error(torch.AcceleratorError("CUDA error: unspecified launch failure"))
    assert not is_fatal_device_error(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_fatal_device_error(RuntimeError("probability tensor contains either inf, nan or element < 0"))
    assert not is_fatal_device_error(ValueError("CUDA error"))


def test_engine_devices_always_carry_a_cuda_index():
    """torch.cuda.set_per_process_memory_fraction rejects an index-less 'cuda' (the 1-GPU colocate crash)."""
    current = lambda: 3   # noqa: E731  (torch.cuda.current_device on a GPU machine)
    assert rank_device("cuda", 1, 0, current) == "cuda:3"
    assert rank_device("cuda:1", 1, 0, current) == "cuda:1"
    assert rank_device("cuda", 2, 1, current) == "cuda:1"
    assert rank_device("cuda:5", 4, 2, current) == "cuda:2"
    assert rank_device("cpu", 2, 1, current) == "cpu"
    with pytest.raises(ValueError):
        rank_device("cuda:x", 1, 0, current)
    for device in ("cuda", "cuda:0", "cuda:7"):
        assert torch.device(rank_device(device, 1, 0, current)).index is not None


def test_logit_bias_is_built_once_per_request_with_the_same_tokens():
    """The engine samples every step with the request's own params: its logit_bias tensors are made at the
    first step and reused (ids outside the vocabulary dropped), and the tokens equal a rebuild at every step."""
    logits = torch.randn(20, V, generator=torch.Generator().manual_seed(4))
    bias = {5: 3.0, 9: -100.0, 40: 2.5, V + 7: 1.0}
    kept = SamplingParams(temperature=1.0, seed=11, logit_bias=bias, presence_penalty=0.5)
    g_kept, g_fresh = kept.make_generator("cpu"), kept.make_generator("cpu")
    out: list[int] = []
    for row in logits:
        fresh = SamplingParams(temperature=1.0, seed=11, logit_bias=dict(bias), presence_penalty=0.5)
        a = sample(row[None].clone(), [kept], [g_kept], [[1, 2]], [out])[0]
        b = sample(row[None].clone(), [fresh], [g_fresh], [[1, 2]], [out])[0]
        assert a == b and a != 9
        out.append(a)
    first = kept.bias_tensors(V, "cpu")
    assert first[0].tolist() == [5, 9, 40] and kept.bias_tensors(V, "cpu") is first
    assert SamplingParams(logit_bias={V: 1.0}).bias_tensors(V, "cpu") is None
    assert kept == fresh and "tensor" not in repr(kept)         # a cache, not a parameter
