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
