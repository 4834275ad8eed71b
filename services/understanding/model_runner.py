"""Executes a StepPlan on one rank: the paged KV pool, the req_to_token table and the forward pass.

The model does no attention itself; `attend` writes the new tokens' K/V into `kv_pool[layer]` and runs the
hybrid-mask prefill kernel for the prefill rows and the decode kernel for the decode rows.
"""
from __future__ import annotations

import torch

from kernels.decode_attention import decode_attention
from kernels.prefill_attention import prefill_attention

from .step_plan import StepPlan


class ModelRunner:
    def __init__(self, model, num_slots: int, max_running: int, max_model_len: int, device, dtype):
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads     # this rank's shard
        self.head_dim = model.head_dim
        self.scale = self.head_dim ** -0.5
        self.kv_pool = torch.zeros(self.num_layers, 2, num_slots, self.num_kv_heads, self.head_dim,
                                   dtype=dtype, device=self.device)
        # Page table of every running request: row -> slot of each position (int32, on device).
        self.req_to_token = torch.zeros(max_running, max_model_len + 1, dtype=torch.int32, device=self.device)

    def apply_table_writes(self, writes) -> None:
        for row, start, slots in writes:
            n = int(slots.numel())
            if n:
                self.req_to_token[row, start:start + n] = slots.to(self.device, torch.int32, non_blocking=True)

    @torch.no_grad()
    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the step; returns fp32 logits for plan.logit_rows (or None when no row needs them)."""
        self.apply_table_writes(plan.table_writes)
        dev = self.device
        out_slots = plan.out_slots.to(dev)
        n_p = plan.num_prefill_rows
        has_image = bool((plan.image_end[:n_p] > 0).any()) if n_p else False
        p_meta = None
        if n_p:
            p_meta = dict(
                req_to_token=self.req_to_token[plan.p_rows.to(dev)],
                b_start=plan.p_start.to(dev, torch.int32), b_seq_len=plan.p_seq_len.to(dev, torch.int32),
                cu_seqlens_q=plan.p_cu_q.to(dev, torch.int32),
                image_end=plan.image_end[:n_p].to(dev, torch.int32) if has_image else None,
                max_seqlen_q=int((plan.p_cu_q[1:] - plan.p_cu_q[:-1]).max()))
        d_meta = None
        if plan.d_rows.numel():
            d_meta = dict(req_to_token=self.req_to_token[plan.d_rows.to(dev)],
                          b_seq_len=plan.d_seq_len.to(dev, torch.int32))
        kv_pool, scale = self.kv_pool, self.scale

        def attend(layer: int, q, k, v):
            kv = kv_pool[layer]
            kv[0].index_copy_(0, out_slots, k.to(kv.dtype))
            kv[1].index_copy_(0, out_slots, v.to(kv.dtype))
            outs = []
            if p_meta is not None:
                m = p_meta
                outs.append(prefill_attention(q[:n_p], kv[0], kv[1], m["req_to_token"], m["b_start"],
                                              m["b_seq_len"], m["cu_seqlens_q"], m["image_end"], scale,
                                              max_seqlen_q=m["max_seqlen_q"]))
            if d_meta is not None:
                outs.append(decode_attention(q[n_p:], kv[0], kv[1], d_meta["req_to_token"],
                                             d_meta["b_seq_len"], scale))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        model = self.model
        x = model.embed(plan.input_ids.to(dev), plan.images)
        hidden = model.und_forward(x, model.rope(plan.positions.to(dev)), attend)
        if plan.logit_rows.numel() == 0:
            return None
        return model.lm_logits(hidden[plan.logit_rows.to(dev)])

    def gather_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """This rank's [L, 2, n, Hkv_shard, D] KV of the given slots."""
        return self.kv_pool[:, :, slots.to(self.device)]
