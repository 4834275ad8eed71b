"""Per-request sampling parameters and the batched sampler (runs on the engine's rank 0)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                   # <= 0 = off
    repetition_penalty: float = 1.0   # HF style, over prompt + output tokens
    presence_penalty: float = 0.0     # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> Optional[tuple[str, str]]:
        """(message, param) for the first invalid field, else None."""
        if self.max_tokens < 1:
            return "max_tokens must be at least 1", "max_tokens"
        if not (0.0 <= self.temperature <= 2.0):
            return "temperature must be between 0 and 2", "temperature"
        if not (0.0 < self.top_p <= 1.0):
            return "top_p must be in (0, 1]", "top_p"
        if self.top_k == 0 or self.top_k < -1:
            return "top_k must be -1 (off) or >= 1", "top_k"
        if not (0.0 < self.repetition_penalty <= 10.0):
            return "repetition_penalty must be in (0, 10]", "repetition_penalty"
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                return f"{name} must be between -2 and 2", name
        if len(self.stop) > 16 or any((not isinstance(s, str)) or not s for s in self.stop):
            return "stop must be up to 16 non-empty strings", "stop"
        return None

    def make_generator(self, device) -> Optional[torch.Generator]:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(int(self.seed))
        else:
            g.seed()
        return g


def _apply_penalties(row: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]):
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
        seen = seen[(seen >= 0) & (seen < vocab)]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=row.device),
                                minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _filter_top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < row.shape[0]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = (cum - probs) > top_p   # keep the smallest set whose mass reaches top_p
        drop[0] = False
        row = row.scatter(0, idx[drop], float("-inf"))
    return row


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list,
           prompt_ids: list[list[int]], output_ids: list[list[int]]) -> list[int]:
    """logits fp32 [B, V] -> one token id per row."""
    out: list[int] = []
    greedy_rows = [i for i, p in enumerate(params)
                   if p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty
                   and not p.frequency_penalty]
    if len(greedy_rows) == len(params):   # the common all-greedy batch: one argmax, one sync
        return torch.argmax(logits, dim=-1).tolist()
    fast = torch.argmax(logits[greedy_rows], dim=-1).tolist() if greedy_rows else []
    fast_map = dict(zip(greedy_rows, fast))
    for i, p in enumerate(params):
        if i in fast_map:
            out.append(fast_map[i])
            continue
        row = _apply_penalties(logits[i].clone(), p, prompt_ids[i], output_ids[i])
        if p.greedy:
            out.append(int(torch.argmax(row)))
            continue
        row = _filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out
