"""RL think sampling: a token's log-prob is taken under the distribution it was drawn from (temperature and top-p
applied, renormalised), not under the raw logits."""
import math

import torch

from services.understanding.sampling import SamplingParams, processed_logprob, sample


def test_processed_logprob_is_the_sampling_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    p = SamplingParams(temperature=0.5, top_p=0.8)
    probs = torch.softmax(logits / 0.5, dim=0)
    keep = torch.zeros(5, dtype=torch.bool)
    order = torch.argsort(probs, descending=True)
    mass = 0.0
    for i in order.tolist():            # the smallest set whose mass reaches top_p
        keep[i] = True
        mass += float(probs[i])
        if mass >= 0.8:
            break
    want = torch.where(keep, probs, torch.zeros(5))
    want = want / want.sum()
    for tok in range(5):
        lp = processed_logprob(logits, p, tok)
        assert (math.isinf(lp) and lp < 0) if want[tok] == 0 else abs(lp - math.log(float(want[tok]))) < 1e-5
    # the sampler draws only from that set, with those frequencies
    gen = torch.Generator().manual_seed(0)
    draws = [sample(logits[None], [p], [gen], [[]], [[]])[0] for _ in range(2000)]
    assert set(draws) <= {i for i in range(5) if keep[i]}
    freq0 = draws.count(0) / len(draws)
    assert abs(freq0 - float(want[0])) < 0.05
    assert processed_logprob(logits, p, 0) != float(torch.log_softmax(logits, 0)[0])
