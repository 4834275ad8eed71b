"""Per-request sampling parameters and the sampler (runs on the engine's rank 0).

The parameters come from the request contract (`services.contract.chat.TextSampling`, validated at the edge);
this module only has to make every accepted value safe. The math runs in fp32, every intermediate is kept
finite (NaN -> -inf, +inf -> the largest float), the best candidate of a row always survives every filter,
and a row without a finite logit falls back to argmax — so no accepted value can produce NaN probabilities
or a device-side assert in `multinomial`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from services.contract.limits import GREEDY_TEMPERATURE

_NEG = float("-inf")
_MAX = torch.finfo(torch.float32).max


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # below GREEDY_TEMPERATURE = greedy (vLLM)
    top_p: float = 1.0
    top_k: int = -1                   # <= 0 = off
    min_p: float = 0.0                # drop tokens below min_p * p(best token)
    repetition_penalty: float = 1.0   # HF style, over prompt + output tokens
    presence_penalty: float = 0.0     # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: Optional[int] = None    # None: none; k: the sampled token's log probability and the top k
    # logit_bias as device tensors, built at the request's first sampled step and reused at every later one
    _bias: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_request(cls, req, max_tokens: int, logprobs: Optional[int] = None) -> "SamplingParams":
        """From a validated `TextSampling` (chat body or native parameters)."""
        return cls(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                   top_k=req.top_k if req.top_k > 0 else -1, min_p=req.min_p,
                   repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                   frequency_penalty=req.frequency_penalty, seed=req.seed, stop=req.stop_list,
                   stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
                   logit_bias=req.bias_map, logprobs=logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Anything that changes the logits before the choice (penalties, logit_bias)."""
        return (self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
                or bool(self.logit_bias))

    def bias_tensors(self, vocab: int, device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(token ids, biases) of logit_bias on `device`, ids outside the vocabulary dropped; None without any.
        Built once per request (these params are the request's own: the engine samples every step with them)."""
        key = (vocab, str(device))
        if self._bias is None or self._bias[0] != key:
            ids = [t for t in self.logit_bias if 0 <= t < vocab]
            tensors = (torch.tensor(ids, dtype=torch.long, device=device),
                       torch.tensor([self.logit_bias[t] for t in ids], dtype=torch.float32, device=device)) \
                if ids else None
            self._bias = (key, tensors)
        return self._bias[1]

    def make_generator(self, device) -> Optional[torch.Generator]:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(int(self.seed))
        else:
            g.seed()
        return g


GREEDY = SamplingParams(temperature=0.0)


class SamplingFailure:
    """A row whose sampling raised: only its request fails."""

    def __init__(self, message: str):
        self.message = message


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=_NEG, posinf=_MAX, neginf=_NEG)


def _apply_penalties(row: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]):
    vocab = row.shape[0]
    bias = p.bias_tensors(vocab, row.device) if p.logit_bias else None
    if bias is not None:
        row = _finite(row.index_add(0, *bias))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
        seen = seen[(seen >= 0) & (seen < vocab)]
        vals = row[seen].double()          # a tiny penalty overflows fp32 in the division: inf -> max below
        row[seen] = _finite(torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty).float())
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        ids = torch.tensor(output_ids, dtype=torch.long, device=row.device)
        ids = ids[(ids >= 0) & (ids < vocab)]
        counts = torch.bincount(ids, minlength=vocab)[:vocab].float()
        row = _finite(row - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()))
    return row


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator, prompt_ids, output_ids) -> int:
    raw = _finite(logits.float())
    row = _apply_penalties(raw.clone(), p, prompt_ids, output_ids) if p.penalised else raw
    top = row.max()
    if not bool(torch.isfinite(top)):       # nothing finite left: the plain best token
        return int(torch.argmax(raw))
    if p.greedy:
        return int(torch.argmax(row))
    return int(torch.multinomial(_processed_probs(row, top, p), 1, generator=generator))


def processed_logprob(logits: torch.Tensor, p: SamplingParams, token: int, prompt_ids=(), output_ids=()) -> float:
    """log P(token) under the distribution `token` was drawn from: penalties and logit_bias, then temperature,
    top-k, min-p and top-p applied (renormalised), as RL over sampled text needs (not the raw logits')."""
    raw = _finite(logits.float())
    row = _apply_penalties(raw.clone(), p, list(prompt_ids), list(output_ids)) if p.penalised else raw
    probs = _processed_probs(row, row.max(), p)
    return float(torch.log(probs[token] / probs.sum()))


def _processed_probs(row: torch.Tensor, top: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The unnormalised sampling weights of a logits row (finite max `top`) after the sampling filters."""
    z = (row - top) / max(p.temperature, GREEDY_TEMPERATURE)   # <= 0, the best token exactly 0
    vocab = z.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, _NEG)
    probs = torch.softmax(z, dim=-1)          # finite: the best token has exp(0) = 1 before normalising
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) > p.top_p * cum[-1]   # the smallest set whose mass reaches top_p
        drop[0] = False
        probs = probs.scatter(0, idx[drop], 0.0)
    return probs


def is_fatal_device_error(exc: BaseException) -> bool:
    """A GPU error after which the CUDA context is unusable (device-side assert, illegal address): the
    engine must exit and be restarted, never keep serving."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text
                                              or "illegal memory access" in text)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[tuple]:
    """Per row: (log probability of the sampled token, [(id, log probability)] of the `top[i]` most likely
    tokens), from the model's own distribution (the raw logits, before penalties and sampling filters)."""
    lp = torch.log_softmax(_finite(logits.float()), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    k = min(max(top, default=0), lp.shape[-1])
    best_v, best_i = torch.topk(lp, k, dim=-1) if k else (None, None)
    out = []
    for i, (c, n) in enumerate(zip(chosen, top)):
        alts = list(zip(best_i[i, :n].tolist(), best_v[i, :n].tolist())) if n else []
        out.append((c, alts))
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list,
           prompt_ids: list[list[int]], output_ids: list[list[int]]) -> list:
    """logits fp32 [B, V] -> one token id per row, or a SamplingFailure for a row that raised (its request
    fails alone). A fatal device error propagates."""
    plain = [i for i, p in enumerate(params) if p.greedy and not p.penalised]
    if len(plain) == len(params):   # the common all-greedy batch: one argmax, one sync
        return torch.argmax(logits, dim=-1).tolist()
    fast = dict(zip(plain, torch.argmax(logits[plain], dim=-1).tolist())) if plain else {}
    out: list = []
    for i, p in enumerate(params):
        if i in fast:
            out.append(fast[i])
            continue
        try:
            out.append(_sample_row(logits[i], p, generators[i], prompt_ids[i], output_ids[i]))
        except Exception as e:
            if is_fatal_device_error(e):
                raise
            out.append(SamplingFailure(f"sampling failed: {type(e).__name__}: {e}"))
    return out
