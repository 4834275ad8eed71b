"""CUDA graphs for prefill-only steps: one graph per padded token count, replayed with the step's rows and
sequence metadata copied into one static buffer.

An 8B prefill of a few hundred tokens is bound by its ~600 kernel launches, not by its GEMMs (an image prefix of
365 tokens: 13 ms of kernels in 42 ms on an H100; docs/benchmarks/generation.md), and every image request runs
one. A step qualifies when it prefills at most MAX_SEQS text sequences (no decode rows, no input images, no LoRA
rows, logits only for sequences' last rows) of at most the largest bucket's tokens in all. Each graph is captured
for a bucket of L rows and MAX_SEQS + 1 sequences: the step's sequences, empty ones up to MAX_SEQS (no query rows:
the attention kernel returns at once for them), then one padding sequence holding the rows past the step's own,
on the scratch row and slot (as decode graphs pad their batch). Every length and position is device data, so the
attention kernel's grid (L rows) is all the graph bakes in; a chunk of a long prompt and a prompt that hit the
prefix cache (rows that start past 0) replay too. The padding rows cost compute (at most a bucket step), and the
GEMMs over L rows may round differently from n rows: bits are not promised in bf16 on GPUs (row_blocks.py), and
exact-row mode (U1SERVE_EXACT_ROWS, the CPU's default) runs every prefill eagerly.

Captured at start after the decode graphs (largest bucket first, one memory pool: later buckets reuse its memory),
each replayed once (a graph's first launch is slow), then checked: the smallest bucket's replay must give the eager
step's logits and KV, or prefill stays eager.
"""
from __future__ import annotations

import torch

from services.model import row_blocks

from .cuda_graphs import GraphCaptures, Recorded
from .step_plan import StepPlan, one_sequence_plan

BUCKETS = (32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
MAX_SEQS = 4          # sequences of one graphed step (a CFG pair's two prefixes, a few chats arriving together)


class PrefillGraphs(GraphCaptures):
    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        width = runner.req_to_token.shape[1] - 1
        self.buckets = [b for b in BUCKETS if b <= min(max_tokens, width)]
        if not self.buckets:
            raise ValueError(f"no prefill graph bucket fits {min(max_tokens, width)} tokens")
        self.max_tokens = self.buckets[-1]
        self.graphs: dict[int, tuple[torch.Tensor, object, torch.Tensor]] = {}
        self.replays = 0
        before = _reserved(runner.device)
        self._begin()
        for L in reversed(self.buckets):          # largest first: later graphs reuse its memory
            buf = torch.zeros(_size(L), dtype=torch.long, device=runner.device)
            buf.copy_(self._host(L, _idle_plan()))
            replay, out = self._capture(lambda buf=buf, L=L: self._body(buf, L))
            self.graphs[L] = (buf, replay, out)
        self._upload(replay for _, replay, _ in self.graphs.values())   # idle buffers: every row is padding
        self._self_check()
        self.pool_bytes = _reserved(runner.device) - before     # what the graphs' memory pool holds (GPU)

    # -- the graphed forward ------------------------------------------------------------------------------
    def _body(self, buf: torch.Tensor, L: int) -> torch.Tensor:
        """The forward over the static buffer's rows: [MAX_SEQS, vocab] fp32 logits of each sequence's last row."""
        r = self.runner
        ids, pos, slots, rows, start, seq_len, cu, last = _views(buf, L)
        p_meta = dict(req_to_token=r.req_to_token.index_select(0, rows), b_start=start.int(),
                      b_seq_len=seq_len.int(), cu_seqlens_q=cu.int(), image_end=None, max_seqlen_q=L)
        return r.core(ids, pos, [], slots, L, p_meta, None, last, None)

    def can_run(self, plan) -> bool:
        n = plan.num_prefill_rows
        b = int(plan.p_rows.numel())
        if not (0 < n <= self.max_tokens and n == plan.num_tokens and 0 < b <= MAX_SEQS):
            return False
        if plan.images or plan.lora_slots is not None or row_blocks.enabled(self.runner.device):
            return False
        if bool((plan.image_end[:n] > 0).any()):
            return False
        lasts = set((plan.p_cu_q[1:] - 1).tolist())
        return all(int(i) in lasts for i in plan.logit_rows.tolist())

    def run(self, plan) -> torch.Tensor:
        n = plan.num_prefill_rows
        L = next(b for b in self.buckets if b >= n)
        buf, replay, out = self.graphs[L]
        buf.copy_(self._host(L, plan))            # one host -> device copy of everything the step varies
        replay()
        self.replays += 1
        lasts = (plan.p_cu_q[1:] - 1).tolist()
        want = [lasts.index(int(i)) for i in plan.logit_rows.tolist()]
        if want == list(range(len(want))):
            return out[:len(want)]
        return out.index_select(0, torch.tensor(want, dtype=torch.long, device=out.device))

    def _host(self, L: int, plan) -> torch.Tensor:
        """The static buffer's contents for `plan` (module doc: its sequences, empty ones, the padding one)."""
        r = self.runner
        host = torch.zeros(_size(L), dtype=torch.long)
        ids, pos, slots, rows, start, seq_len, cu, last = _views(host, L)
        n, b = plan.num_prefill_rows, int(plan.p_rows.numel())
        ids[:n] = plan.input_ids[:n]
        pos[:, :n] = plan.positions[:, :n]
        slots[:n] = plan.out_slots[:n]
        slots[n:] = r.scratch_slot
        rows[:b] = plan.p_rows
        rows[b:] = r.scratch_row
        start[:b] = plan.p_start
        seq_len[:b] = plan.p_seq_len
        seq_len[MAX_SEQS] = L - n                 # the padding sequence: causal over its own rows
        cu[:b + 1] = plan.p_cu_q
        cu[b + 1:MAX_SEQS + 1] = n
        cu[MAX_SEQS + 1] = L
        last[:b] = plan.p_cu_q[1:] - 1
        return host

    def _self_check(self) -> None:
        """The smallest bucket's replay vs the eager step on a few real slots (free before the engine serves):
        a wrong capture must never serve tokens or KV. Raises, and the runner prefills eagerly."""
        r = self.runner
        n = max(2, self.buckets[0] // 2 + 1)      # a padding sequence and an empty one take part
        ids = torch.arange(1, n + 1) % 97
        slots = torch.arange(n)
        r.req_to_token[0, :n] = slots.to(r.req_to_token.device, torch.int32)
        plan = one_sequence_plan(ids, slots, row=0)
        kv = r.kv_pool[:, :, :n]
        with torch.no_grad():
            got = self.run(plan).clone()
            got_kv = kv.clone()
            ref = r.eager_forward(plan)
        ok = torch.allclose(got, ref, atol=5e-2, rtol=5e-2) and torch.allclose(got_kv.float(), kv.float(),
                                                                               atol=5e-2, rtol=5e-2)
        self.replays = 0
        r.req_to_token[0].zero_()
        kv.zero_()
        if not ok:
            raise RuntimeError("prefill CUDA graph replay differs from the eager forward")


class RecordedPrefillGraphs(Recorded, PrefillGraphs):
    """PrefillGraphs on a CPU (cuda_graphs.Recorded: tests, the benchmark's CPU smoke)."""


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _size(L: int) -> int:
    return 5 * L + 4 * (MAX_SEQS + 1) + 1 + MAX_SEQS


def _views(buf: torch.Tensor, L: int):
    """ids [L], positions [3, L], out slots [L], then per sequence (MAX_SEQS + the padding one): table rows, cached
    tokens, lengths after the step, cumulative query rows [MAX_SEQS + 2], and each real sequence's last row."""
    S = MAX_SEQS + 1
    parts = torch.split(buf, [L, 3 * L, L, S, S, S, S + 1, MAX_SEQS])
    ids, pos, slots, rows, start, seq_len, cu, last = parts
    return ids, pos.view(3, L), slots, rows, start, seq_len, cu, last


def _idle_plan() -> StepPlan:
    """What a buffer holds before its first replay: no sequence (every row is padding)."""
    p = one_sequence_plan(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0)
    p.p_rows = p.p_start = p.p_seq_len = torch.zeros(0, dtype=torch.long)
    p.p_cu_q = torch.zeros(1, dtype=torch.long)
    return p
