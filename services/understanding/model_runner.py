"""Executes a StepPlan on one rank: the paged KV pool, the req_to_token table and the forward pass.

The model does no attention itself; `attend` writes the new tokens' K/V into `kv_pool[layer]` and runs the
hybrid-mask prefill kernel for the prefill rows and the decode kernel for the decode rows. On CUDA,
decode-only steps replay CUDA graphs captured per batch size (cuda_graphs.py), and prefill-only steps of a few
text sequences graphs captured per padded token count (prefill_graphs.py); a step of both kinds runs as the
two (`split_prefill_decode`) when each part has its graph.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from kernels.decode_attention import decode_attention
from kernels.kv_copy import kv_write_
from kernels.prefill_attention import prefill_attention

from services.base import knobs
from services.contract.health import EnginePhase
from services.model import row_blocks
from services.model.lora_batched import lora_rows

from .step_plan import StepPlan, one_sequence_plan, split_prefill_decode

log = logging.getLogger("u1serve.understanding.runner")


class ModelRunner:
    def __init__(self, model, num_slots: int, max_running: int, max_model_len: int, device, dtype,
                 cuda_graph_max_bs: int = 0, warmup: bool | None = None, prefill_graph_max_tokens: int = 0,
                 on_phase: Callable[[EnginePhase], None] = lambda phase: None):
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads     # this rank's shard
        self.head_dim = model.head_dim
        self.scale = self.head_dim ** -0.5
        # One extra slot and table row are scratch space for the padding rows of CUDA-graph batches.
        self.scratch_slot = num_slots
        self.scratch_row = max_running
        self.kv_pool = torch.zeros(self.num_layers, 2, num_slots + 1, self.num_kv_heads, self.head_dim,
                                   dtype=dtype, device=self.device)
        # Page table of every running request: row -> slot of each position (int32, on device).
        self.req_to_token = torch.zeros(max_running + 1, max_model_len + 1, dtype=torch.int32, device=self.device)
        self.req_to_token[self.scratch_row].fill_(self.scratch_slot)
        self.graphs = None
        self.prefill_graphs = None
        if warmup if warmup is not None else self.device.type == "cuda":
            on_phase(EnginePhase.WARMING)
            self.warmup()
        if cuda_graph_max_bs > 0 and self.device.type == "cuda":   # A3B too: its MoE has no host sync
            from .cuda_graphs import DecodeGraphs
            on_phase(EnginePhase.CAPTURING_CUDA_GRAPHS)
            try:
                self.graphs = DecodeGraphs(self, min(cuda_graph_max_bs, max_running))
            except Exception:
                log.exception("CUDA graph capture failed; decoding eagerly")
                self.graphs = None
        if prefill_graph_max_tokens > 0 and self.device.type == "cuda" and row_blocks.enabled(self.device):
            log.info("exact rows (%s): prefill runs eagerly, no prefill CUDA graphs", knobs.EXACT_ROWS.name)
        elif prefill_graph_max_tokens > 0 and self.device.type == "cuda":
            from .prefill_graphs import PrefillGraphs
            try:
                self.prefill_graphs = PrefillGraphs(self, prefill_graph_max_tokens)
                log.info("captured prefill CUDA graphs for %s tokens (%.0f MiB)", self.prefill_graphs.buckets,
                         self.prefill_graphs.pool_bytes / 2**20)
            except Exception:
                log.exception("prefill CUDA graph capture failed; prefilling eagerly")
                self.prefill_graphs = None

    @torch.no_grad()
    def warmup(self, lengths=(16, 512)) -> None:
        """Run the prefill (text rows, then with an image span) and eager decode kernels once per
        length before the engine reports ready (Triton JIT, cuBLAS handles, allocator growth), so
        the first request runs at steady speed. Every row reads and writes only the scratch slot."""
        i64 = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        width = self.req_to_token.shape[1] - 1
        for n in sorted({max(2, min(t, width)) for t in lengths}):
            for image in (False, True):
                plan = one_sequence_plan(torch.zeros(n, dtype=torch.long),
                                         torch.full((n,), self.scratch_slot, dtype=torch.long), self.scratch_row)
                if image and n >= 4:
                    plan.image_end[1:n - 1] = n - 1   # rows 1..n-2: one image span
                self.forward(plan)
        plan = StepPlan(
            input_ids=i64([0]), positions=torch.zeros(3, 1, dtype=torch.long),
            image_end=torch.zeros(1, dtype=torch.int32), images=[],
            out_slots=i64([self.scratch_slot]), num_prefill_rows=0, p_rows=i64([]), p_start=i64([]),
            p_seq_len=i64([]), p_cu_q=i64([0]), d_rows=i64([self.scratch_row]), d_seq_len=i64([1]),
            logit_rows=i64([0]))
        self.forward(plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def apply_table_writes(self, plan: StepPlan) -> None:
        if plan.tw_rows is not None and plan.tw_rows.numel():
            dev = self.device
            self.req_to_token[plan.tw_rows.to(dev), plan.tw_cols.to(dev)] = plan.tw_vals.to(dev, torch.int32)

    def core(self, input_ids, positions, images, out_slots, n_p: int, p_meta, d_meta, logit_rows,
             image_rows=None):
        """The forward on device tensors. d_meta["rows"] is gathered from the table here (graph-safe).
        `image_rows`: the rows the images fill (see forward)."""
        kv_pool, scale, table = self.kv_pool, self.scale, self.req_to_token
        d_table = table.index_select(0, d_meta["rows"]) if d_meta is not None else None

        def attend(layer: int, q, k, v):
            kv = kv_pool[layer]
            kv_write_(kv, out_slots, k.to(kv.dtype), v.to(kv.dtype))   # one launch for K and V
            outs = []
            if p_meta is not None:
                m = p_meta
                outs.append(prefill_attention(q[:n_p], kv[0], kv[1], m["req_to_token"], m["b_start"],
                                              m["b_seq_len"], m["cu_seqlens_q"], m["image_end"], scale,
                                              max_seqlen_q=m["max_seqlen_q"]))
            if d_meta is not None:
                outs.append(decode_attention(q[n_p:], kv[0], kv[1], d_table, d_meta["b_seq_len"], scale,
                                             num_splits=d_meta.get("num_splits")))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        model = self.model
        x = model.embed(input_ids, images, image_rows)
        hidden = model.und_forward(x, model.rope(positions), attend)
        if logit_rows is None:
            return model.lm_logits(hidden)
        if logit_rows.numel() == 0:
            return None
        return model.lm_logits(hidden.index_select(0, logit_rows))

    @torch.no_grad()
    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the step; returns fp32 logits for plan.logit_rows (or None when no row needs them)."""
        self.apply_table_writes(plan)
        if plan.lora_slots is None:
            for graphs in (self.graphs, self.prefill_graphs):
                if graphs is not None and graphs.can_run(plan):
                    return graphs.run(plan)
            parts = self._graphed_parts(plan)
            if parts is not None:
                prefill, decode = parts
                return torch.cat([self.prefill_graphs.run(prefill), self.graphs.run(decode)])
        return self.eager_forward(plan)

    def _graphed_parts(self, plan: StepPlan) -> tuple[StepPlan, StepPlan] | None:
        """A mixed step (new prompts beside decoding ones, the usual step under chat load) as a prefill graph then a
        decode graph: the weights are read twice, but an eager mixed step is bound by its ~600 launches."""
        if self.graphs is None or self.prefill_graphs is None:
            return None
        parts = split_prefill_decode(plan)
        if parts is None or not (self.prefill_graphs.can_run(parts[0]) and self.graphs.can_run(parts[1])):
            return None
        return parts

    def eager_forward(self, plan: StepPlan) -> torch.Tensor | None:
        """`forward` without graphs (its table writes already applied)."""
        dev = self.device
        n_p = plan.num_prefill_rows
        has_image = bool((plan.image_end[:n_p] > 0).any()) if n_p else False
        p_meta = None
        if n_p:
            p_meta = dict(
                req_to_token=self.req_to_token.index_select(0, plan.p_rows.to(dev)),
                b_start=plan.p_start.to(dev, torch.int32), b_seq_len=plan.p_seq_len.to(dev, torch.int32),
                cu_seqlens_q=plan.p_cu_q.to(dev, torch.int32),
                image_end=plan.image_end[:n_p].to(dev, torch.int32) if has_image else None,
                max_seqlen_q=int((plan.p_cu_q[1:] - plan.p_cu_q[:-1]).max()))
        d_meta = None
        if plan.d_rows.numel():
            d_meta = dict(rows=plan.d_rows.to(dev), b_seq_len=plan.d_seq_len.to(dev, torch.int32))
            if dev.type == "cuda":
                from kernels.decode_attention import default_num_splits
                d_meta["num_splits"] = default_num_splits(int(plan.d_rows.numel()), self.num_kv_heads,
                                                          int(plan.d_seq_len.max()), dev)
        # the input images' rows are the prompt's image spans (image_end > 0); a generated <IMG_CONTEXT> is text
        image_rows = (plan.image_end > 0).to(dev) if plan.images else None
        # each sequence's rows: its prefill chunk, or its one decode row (row_blocks: the bits of it alone)
        rows = ((plan.p_cu_q[1:] - plan.p_cu_q[:-1]).tolist() if n_p else []) + [1] * int(plan.d_rows.numel())
        with lora_rows(self.model, plan.lora_slots), row_blocks.per_sequence(rows, dev):
            return self.core(plan.input_ids.to(dev), plan.positions.to(dev), plan.images, plan.out_slots.to(dev),
                             n_p, p_meta, d_meta, plan.logit_rows.to(dev), image_rows)
