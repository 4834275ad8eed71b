"""CUDA graphs for decode-only steps: one graph per padded batch size, replayed with the step's inputs
copied into static buffers. Padding rows write their K/V into a scratch slot and read one scratch token.

Without graphs an 8B decode step is bound by ~1,000 kernel launches, not by reading the weights."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("u1serve.understanding.graphs")

_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        dev = runner.device
        self.sizes = [s for s in _SIZES if s <= max_bs] or [1]
        n = self.max_bs = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.rows = torch.full((n,), runner.scratch_row, dtype=torch.long, device=dev)
        self.seq_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        from kernels.decode_attention import default_num_splits
        width = runner.req_to_token.shape[1]
        for bs in reversed(self.sizes):   # largest first: later graphs reuse its memory
            meta = dict(rows=self.rows[:bs], b_seq_len=self.seq_len[:bs],
                        num_splits=default_num_splits(bs, runner.num_kv_heads, width, dev))
            args = (self.ids[:bs], self.pos[:, :bs], [], self.slots[:bs], 0, None, meta, None)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):
                    runner.core(*args)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"), torch.no_grad():
                out = runner.core(*args)
            self.graphs[bs] = (g, out)
        self._self_check()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _self_check(self) -> None:
        """Replay vs eager on the scratch slot: a wrong capture must never serve tokens."""
        r = self.runner
        g, out = self.graphs[self.sizes[0]]
        with torch.no_grad():
            g.replay()
            meta = dict(rows=self.rows[:1], b_seq_len=self.seq_len[:1])
            ref = r.core(self.ids[:1], self.pos[:, :1], [], self.slots[:1], 0, None, meta, None)
        torch.cuda.synchronize()
        if not torch.allclose(out[:1], ref, atol=5e-2, rtol=5e-2):
            raise RuntimeError("CUDA graph replay differs from the eager forward")

    def can_run(self, plan) -> bool:
        b = int(plan.d_rows.numel())
        return (plan.num_prefill_rows == 0 and 0 < b <= self.max_bs and not plan.images
                and int(plan.logit_rows.numel()) == b)

    def run(self, plan) -> torch.Tensor:
        b = int(plan.d_rows.numel())
        bs = next(s for s in self.sizes if s >= b)
        r = self.runner
        self.ids[:b].copy_(plan.input_ids, non_blocking=True)
        self.pos[:, :b].copy_(plan.positions, non_blocking=True)
        self.slots[:b].copy_(plan.out_slots, non_blocking=True)
        self.rows[:b].copy_(plan.d_rows, non_blocking=True)
        self.seq_len[:b].copy_(plan.d_seq_len, non_blocking=True)
        if bs > b:   # padding rows: scratch slot, scratch row, one token
            self.ids[b:bs].zero_()
            self.pos[:, b:bs].zero_()
            self.slots[b:bs].fill_(r.scratch_slot)
            self.rows[b:bs].fill_(r.scratch_row)
            self.seq_len[b:bs].fill_(1)
        g, out = self.graphs[bs]
        g.replay()
        # logit_rows of a decode-only plan are 0..b-1 in order
        return out[:b]
