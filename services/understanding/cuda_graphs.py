"""CUDA graphs for decode-only steps: one graph per padded batch size, replayed with the step's inputs
copied into static buffers. Padding rows write their K/V into a scratch slot and read one scratch token.

Without graphs an 8B decode step is bound by ~1,000 kernel launches, not by reading the weights.

`GraphCaptures` is how the runner's graphs (these and prefill_graphs.py's) capture: warm-up runs on a side stream,
then a capture into the set's one memory pool; `Recorded` swaps that for a recording, so the same code runs on a
CPU (tests, benchmark smokes): "capture" keeps the closure, "replay" runs it again into the same output."""
from __future__ import annotations

import logging

import torch

from services.model import row_blocks

log = logging.getLogger("u1serve.understanding.graphs")

_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class GraphCaptures:
    """Capture into one memory pool per set of graphs (the largest first: later graphs reuse its memory)."""

    def _begin(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, fn, warm_runs: int = 1):
        """(replay, output): `fn` run `warm_runs` times on a side stream (Triton JIT, cuBLAS plans, the allocator),
        then captured."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warm_runs):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"), torch.no_grad():
            out = fn()
        return g.replay, out

    def _upload(self, replays) -> None:
        """Replay each graph once before serving: a graph's first launch is slower than the next ones (measured on
        an H100: an image prefix's first prefill 66 ms from its graph, 10 ms after), which would fall on the first
        request of each batch size or length."""
        for replay in replays:
            replay()
        self._sync()

    @staticmethod
    def _sync() -> None:
        torch.cuda.synchronize()


class Recorded:
    """Mixed in before a GraphCaptures class: the CPU stand-in (module doc)."""

    def _begin(self) -> None:
        self.pool = None

    def _capture(self, fn, warm_runs: int = 1):
        with torch.no_grad():
            out = fn().clone()
        out.zero_()              # a real capture leaves its output unset until the first replay

        def replay():
            with torch.no_grad():
                out.copy_(fn())
        return replay, out

    @staticmethod
    def _sync() -> None:
        pass


class DecodeGraphs(GraphCaptures):
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
        self.graphs: dict[int, tuple] = {}
        self.replays = 0
        self._begin()
        from kernels.decode_attention import default_num_splits
        width = runner.req_to_token.shape[1]
        for bs in reversed(self.sizes):   # largest first: later graphs reuse its memory
            meta = dict(rows=self.rows[:bs], b_seq_len=self.seq_len[:bs],
                        num_splits=default_num_splits(bs, runner.num_kv_heads, width, dev))
            args = (self.ids[:bs], self.pos[:, :bs], [], self.slots[:bs], 0, None, meta, None)
            self.graphs[bs] = self._capture(lambda args=args: runner.core(*args), warm_runs=2)
        self._upload(replay for replay, _ in self.graphs.values())   # padding rows: the scratch slot only
        self._self_check()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _self_check(self) -> None:
        """Replay vs eager on the scratch slot: a wrong capture must never serve tokens."""
        r = self.runner
        replay, out = self.graphs[self.sizes[0]]
        with torch.no_grad():
            replay()
            meta = dict(rows=self.rows[:1], b_seq_len=self.seq_len[:1])
            ref = r.core(self.ids[:1], self.pos[:, :1], [], self.slots[:1], 0, None, meta, None)
        self._sync()
        if not torch.allclose(out[:1], ref, atol=5e-2, rtol=5e-2):
            raise RuntimeError("CUDA graph replay differs from the eager forward")

    def can_run(self, plan) -> bool:
        """A decode-only step; of several rows only where they are computed whole (exact-row mode runs each
        sequence's rows alone: model/row_blocks.py, eagerly)."""
        b = int(plan.d_rows.numel())
        return (plan.num_prefill_rows == 0 and 0 < b <= self.max_bs and not plan.images
                and int(plan.logit_rows.numel()) == b and (b == 1 or not row_blocks.enabled(self.runner.device)))

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
        replay, out = self.graphs[bs]
        replay()
        self.replays += 1
        # logit_rows of a decode-only plan are 0..b-1 in order
        return out[:b]


class RecordedDecodeGraphs(Recorded, DecodeGraphs):
    """DecodeGraphs on a CPU (module doc)."""
