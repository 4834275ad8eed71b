"""The per-iteration plan rank 0 builds and (with TP) broadcasts: what every rank computes this step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepPlan:
    input_ids: torch.Tensor            # [T] int64, prefill rows first, then decode rows
    positions: torch.Tensor            # [3, T] int64
    image_end: torch.Tensor            # [T] int32 (absolute, 0 = causal row)
    images: list                       # ImageTensor, in the order their spans appear in input_ids
    out_slots: torch.Tensor            # [T] int64: where each new token's K/V goes
    num_prefill_rows: int              # rows [0, num_prefill_rows) use the prefill kernel
    # prefill part (one entry per request)
    p_rows: torch.Tensor               # [Bp] rows of the req_to_token table
    p_start: torch.Tensor              # [Bp] tokens already in the cache
    p_seq_len: torch.Tensor            # [Bp] cache length after this step
    p_cu_q: torch.Tensor               # [Bp + 1] cumulative query counts
    # decode part
    d_rows: torch.Tensor               # [Bd]
    d_seq_len: torch.Tensor            # [Bd]
    logit_rows: torch.Tensor           # rows whose logits are needed (last row of sampling requests)
    tw_rows: torch.Tensor = None       # req_to_token updates: table[tw_rows, tw_cols] = tw_vals (no duplicates)
    tw_cols: torch.Tensor = None
    tw_vals: torch.Tensor = None
    exports: list = field(default_factory=list)        # (rid, slots [n], handle dict, t_offset)
    lora_slots: torch.Tensor = None    # [T] int32 LoRA slot of each row (-1 = base); None: no adapter (lora.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def split_prefill_decode(plan: StepPlan) -> tuple[StepPlan, StepPlan] | None:
    """A step of prefill and decode rows as two steps, its prefill rows then its decode rows, whose logits in
    that order are the step's (each row attends to its own sequence alone, so nothing crosses the split); None
    where the step is not of both kinds, has input images or adapters, or wants logits out of row order. The
    table writes stay with the step (applied before either part runs)."""
    n, rows = plan.num_prefill_rows, plan.logit_rows
    if not 0 < n < plan.num_tokens or plan.images or plan.lora_slots is not None:
        return None
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        return None
    none = torch.zeros(0, dtype=torch.long)
    prefill = StepPlan(input_ids=plan.input_ids[:n], positions=plan.positions[:, :n], image_end=plan.image_end[:n],
                       images=[], out_slots=plan.out_slots[:n], num_prefill_rows=n, p_rows=plan.p_rows,
                       p_start=plan.p_start, p_seq_len=plan.p_seq_len, p_cu_q=plan.p_cu_q, d_rows=none,
                       d_seq_len=none, logit_rows=rows[rows < n])
    decode = StepPlan(input_ids=plan.input_ids[n:], positions=plan.positions[:, n:], image_end=plan.image_end[n:],
                      images=[], out_slots=plan.out_slots[n:], num_prefill_rows=0, p_rows=none, p_start=none,
                      p_seq_len=none, p_cu_q=torch.zeros(1, dtype=torch.long), d_rows=plan.d_rows,
                      d_seq_len=plan.d_seq_len, logit_rows=rows[rows >= n] - n)
    return prefill, decode


def one_sequence_plan(ids: torch.Tensor, slots: torch.Tensor, row: int) -> StepPlan:
    """A prefill step of one sequence (`ids` on `slots`, table row `row`), logits of its last row."""
    n = int(ids.numel())
    i64 = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return StepPlan(input_ids=ids.long(), positions=torch.arange(n).repeat(3, 1),
                    image_end=torch.zeros(n, dtype=torch.int32), images=[], out_slots=slots.long(),
                    num_prefill_rows=n, p_rows=i64([row]), p_start=i64([0]), p_seq_len=i64([n]), p_cu_q=i64([0, n]),
                    d_rows=i64([]), d_seq_len=i64([]), logit_rows=i64([n - 1] if n else []))
