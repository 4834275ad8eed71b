"""Continuous-batching scheduler (rank 0): admission by free KV, chunked prefill that never splits an
image span, decodes every iteration, preemption by recompute, clean aborts — and never a hang.

Every iteration builds one StepPlan holding the decode rows of all running requests (DecodeManager, decode.py)
plus prefill chunks, continuing ones first, then newly admitted ones, up to the chunked-prefill budget, chats before
image prefixes and image prefixes capped while chats decode (PrefillManager, prefill.py: colocate QoS). The
scheduler owns the requests and the KV they hold.
"""
from __future__ import annotations

import collections
import time
from typing import Optional

import torch

from services.model.lora_registry import AdapterNotFound

from . import lora
from .decode import DecodeManager
from .kv_allocator import KVSlotAllocator
from .prefill import PrefillManager
from .protocol import EngineStats, RequestOutput, SubmitRequest
from .radix_cache import RadixCache
from .request import Req
from .sampling import SamplingFailure
from .step_plan import StepPlan

_EMPTY = torch.empty(0, dtype=torch.int64)
MAX_STRIKES = 2     # failed shared steps after which a request fails even though it ran alone fine


class Scheduler:
    def __init__(self, num_slots: int, max_running: int, max_model_len: int, chunk_size: int,
                 img_context_id: int, enable_prefix_cache: bool = True, max_queue_wait_s: float = 0.0):
        self.max_queue_wait_s = max_queue_wait_s
        self.alloc = KVSlotAllocator(num_slots)
        self.cache = RadixCache(self.alloc.free, enabled=enable_prefix_cache)
        self.max_model_len = max_model_len
        self.chunk_size = chunk_size if chunk_size > 0 else 1 << 62
        self.img_context_id = img_context_id
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.free_rows = list(range(max_running - 1, -1, -1))
        self.reqs: dict[str, Req] = {}
        self._aborts: set[str] = set()
        self._arrivals = 0
        self._table_writes: list = []
        self.outputs: list[RequestOutput] = []
        self.stats = EngineStats(kv_total=num_slots)
        self._suspects: set[str] = set()   # requests of a failed step, each to run one step alone (step_failed)
        self.model = None       # the engine's model: its LoRA adapters (lora.py)
        self.decode = DecodeManager(self)
        self.prefill = PrefillManager(self)
        self.admitting = True   # False while a weight update drains (understanding/weights.py): only requests
        #                         that ran before (preempted) come back in

    # ---- intake ------------------------------------------------------------------------------
    def add(self, msg: SubmitRequest) -> None:
        try:
            req = Req(msg, self.img_context_id, self._arrivals)
            lora.bind(req, self.model)
        except AdapterNotFound as e:     # unloaded between the gateway's check and here
            self.outputs.append(RequestOutput(msg.rid, [], "error", error=str(e), error_code="model_not_found"))
            return
        except Exception as e:  # malformed prompt (the HTTP side validates; this is the last guard)
            self.outputs.append(RequestOutput(msg.rid, [], "error", error=f"bad request: {e}",
                                              error_code="invalid_request"))
            return
        self._arrivals += 1
        if len(req.tokens) + 1 > self.alloc.num_slots:
            self.outputs.append(RequestOutput(msg.rid, [], "error", error=(
                f"prompt of {len(req.tokens)} tokens does not fit the KV cache ({self.alloc.num_slots} tokens)"),
                error_code="kv_cache_too_small"))
            return
        req.enqueued_at = time.monotonic()
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        if rid in self.reqs:
            self._aborts.add(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # ---- KV helpers --------------------------------------------------------------------------
    def available(self) -> int:
        return self.alloc.num_free + self.cache.evictable_tokens

    def _alloc(self, n: int) -> torch.Tensor:
        if self.alloc.num_free < n:
            self.cache.evict(n - self.alloc.num_free)
        return self.alloc.alloc(n)

    def _release(self, req: Req) -> None:
        """Give back a request's KV: computed tokens go into the prefix cache (so a preempted or repeated
        request finds them again), duplicates and the rest are freed."""
        n = req.num_computed
        if n > 0:
            if self.cache.enabled:
                already = self.cache.insert(req.keys[:n], req.slots[:n])
                if already > req.cached_len:
                    self.alloc.free(req.slots[req.cached_len:already])
            else:
                self.alloc.free(req.slots[:n])
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node, req.cached_len, req.num_computed, req.prompt_cached = None, 0, 0, False
        if req.table_row is not None:
            row = req.table_row
            # pending writes of this row must not land after its next owner's writes
            self._table_writes = [w for w in self._table_writes if w[0] != row]
            self.free_rows.append(row)
            req.table_row = None

    def _cache_prompt(self, req: Req) -> None:
        """Insert the computed prompt into the prefix cache now, so concurrent requests share it."""
        req.prompt_cached = True
        if not self.cache.enabled:
            return
        n = req.num_computed
        already = self.cache.insert(req.keys[:n], req.slots[:n])
        if already > req.cached_len:
            self.alloc.free(req.slots[req.cached_len:already])
        slots, node = self.cache.match_prefix(req.keys[:n])
        assert slots.numel() == n, "prefix cache lost a just-inserted prompt"
        if already > req.cached_len:
            req.slots[req.cached_len:already] = slots[req.cached_len:already]
            self._table_writes.append((req.table_row, req.cached_len, slots[req.cached_len:already].clone()))
        self.cache.lock(node)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node, req.cached_len = node, n

    # ---- finishing ---------------------------------------------------------------------------
    def finish(self, req: Req, reason: str, error: Optional[str] = None, code: Optional[str] = None,
                handle: Optional[dict] = None) -> None:
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.reqs.pop(req.rid, None)
        self._suspects.discard(req.rid)
        lora.release(req)
        req.finished = reason
        out = RequestOutput(req.rid, req.new_ids, reason, error=error, error_code=code,
                            prompt_tokens=req.prompt_len, cached_tokens=req.hit_tokens, handle=handle,
                            logprobs=self._take_logprobs(req))
        if req.kind == "prefix":
            out.think_ids = list(req.output_ids)
        req.new_ids = []
        self.outputs.append(out)

    @staticmethod
    def _take_logprobs(req: Req) -> Optional[list]:
        if req.new_logprobs is None:
            return None
        out, req.new_logprobs = req.new_logprobs, []
        return out

    def preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        self.stats.preemptions += 1
        # back to the front of the queue, in arrival order
        idx = 0
        while idx < len(self.waiting) and self.waiting[idx].arrival < req.arrival:
            idx += 1
        self.waiting.insert(idx, req)

    def _reap_aborts(self) -> None:
        for rid in list(self._aborts):
            req = self.reqs.get(rid)
            if req is not None:
                self.finish(req, "abort")
        self._aborts.clear()

    def _expire_waiting(self) -> None:
        """Fail requests that waited longer than max_queue_wait_s for their first admission (a preempted
        request already ran and is not timed out): an overloaded engine answers instead of queueing forever."""
        if self.max_queue_wait_s <= 0 or not self.waiting:
            return
        now = time.monotonic()
        for req in [r for r in self.waiting if not r.admitted_once
                    and now - r.enqueued_at > self.max_queue_wait_s]:
            self.finish(req, "error", f"waited {now - req.enqueued_at:.1f} s for admission (limit "
                         f"{self.max_queue_wait_s:g} s): the server is overloaded, retry later", "queue_timeout")

    # ---- admission ---------------------------------------------------------------------------
    def try_admit(self, req: Req, decode_reserve: int) -> bool:
        if not self.free_rows:
            return False
        slots, _ = self.cache.match_prefix(req.keys)
        m = req.safe_prefix_len(int(slots.numel()))
        slots, node = self.cache.match_prefix(req.keys[:m]) if m > 0 else (_EMPTY, None)
        if node is not None:
            self.cache.lock(node)
        remaining = len(req.tokens) - m
        if remaining + 1 + decode_reserve > self.available():
            if node is not None:
                self.cache.unlock(node)
            return False
        req.node = node if m > 0 else None
        req.slots[:m] = slots
        req.cached_len = req.num_computed = m
        req.table_row = self.free_rows.pop()
        if m:
            self._table_writes.append((req.table_row, 0, slots.clone()))
        if not req.admitted_once:
            req.admitted_once = True
            req.hit_tokens = m
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_prompt_tokens += m
        self.waiting.remove(req)
        self.running.append(req)
        return True

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self) -> Optional[tuple[StepPlan, list]]:
        """Returns (plan, entries) or None when there is nothing to run. entries: (req, start, end)."""
        self._reap_aborts()
        self._expire_waiting()
        for _ in range(len(self.running) + len(self.waiting) + 2):
            result = self._schedule_once()
            if result is not None or not self.running:
                return result
            # Running requests exist but none could progress: free memory by preempting the newest one,
            # or fail the last one standing — never spin.
            if len(self.running) > 1:
                self.preempt(max(self.running, key=lambda r: r.arrival))
            else:
                self.finish(self.running[0], "error", "KV cache exhausted: the request does not fit",
                             "kv_cache_exhausted")
        return None

    def _schedule_once(self):
        if self._suspects:
            return self._schedule_alone()
        decodes = self.decode.rows()
        entries = self.prefill.take(self.chunk_size, reserved=len(decodes), decoding=bool(decodes))
        if not entries and not decodes:
            return None
        for r, start, end in entries:
            self._assign_slots(r, start, end)
        d_slots = self._alloc(len(decodes)) if decodes else _EMPTY
        for r, slot in zip(decodes, d_slots.tolist()):
            r.slots[r.num_computed] = slot
        return self._build_plan(entries, decodes, d_slots)

    def _schedule_alone(self):
        """The next step of one suspect with nothing else in it (see step_failed); without room for it, back to
        ordinary steps (isolation is best effort, never a stall)."""
        r = next((r for r in [*self.running, *self.waiting] if r.rid in self._suspects), None)
        if r is not None and r in self.waiting and not self.try_admit(r, 0):
            r = None
        if r is not None and r.is_decode and self.available() >= 1:
            d_slots = self._alloc(1)
            r.slots[r.num_computed] = int(d_slots[0])
            return self._build_plan([], [r], d_slots)
        if r is not None and not r.is_decode:
            end = r.chunk_end(self.chunk_size)
            if end - r.num_computed <= self.available():
                self._assign_slots(r, r.num_computed, end)
                return self._build_plan([(r, r.num_computed, end)], [], _EMPTY)
        self._suspects.clear()
        return self._schedule_once()

    def _assign_slots(self, r: Req, start: int, end: int) -> None:
        slots = self._alloc(end - start)
        r.slots[start:end] = slots
        self._table_writes.append((r.table_row, start, slots))

    def _needs_logits(self, r: Req) -> bool:
        return r.kind == "text" or not r.think_done

    def _build_plan(self, entries, decodes, d_slots):
        """Prefill chunks one by one (few), decode rows in bulk (many: plain lists, one tensor each)."""
        ids, pos, iend, slots, images, logit_rows = [], [], [], [], [], []
        row = 0
        for r, s, e in entries:
            ids.append(torch.tensor(r.tokens[s:e], dtype=torch.int64))
            pos.append(r.positions(s, e))
            iend.append(r.image_end(s, e))
            slots.append(r.slots[s:e])
            images.extend(r.images_in(s, e))
            row += e - s
            if e == len(r.tokens) and self._needs_logits(r):
                logit_rows.append(row - 1)
        n_p = row
        if decodes:
            idx = [r.num_computed for r in decodes]
            ids.append(torch.tensor([r.tokens[i] for r, i in zip(decodes, idx)], dtype=torch.int64))
            t = torch.tensor([r.t_at(i) for r, i in zip(decodes, idx)], dtype=torch.int64)
            pos.append(torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)]))
            iend.append(torch.zeros(len(decodes), dtype=torch.int32))
            slots.append(d_slots)
            logit_rows.extend(n_p + k for k, r in enumerate(decodes) if self._needs_logits(r))
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        cu = [0]
        for _, s, e in entries:
            cu.append(cu[-1] + e - s)
        exports = []
        all_entries = list(entries) + [(r, r.num_computed, r.num_computed + 1) for r in decodes]
        for r, s, e in all_entries:
            if r.kind == "prefix" and r.think_done and e == len(r.tokens):
                exports.append((r.rid, r.slots[:e].clone(), r.msg.handle, r.next_t))
        # req_to_token updates as flat (row, col, slot) triples: earlier pending writes, then this step's
        tw_rows, tw_cols, tw_vals = [], [], []
        for trow, tstart, tslots in self._table_writes:
            n = int(tslots.numel())
            tw_rows.append(torch.full((n,), trow, dtype=torch.int64))
            tw_cols.append(torch.arange(tstart, tstart + n))
            tw_vals.append(tslots)
        if decodes:
            tw_rows.append(i64([r.table_row for r in decodes]))
            tw_cols.append(i64(idx))
            tw_vals.append(d_slots)
        cat = lambda xs: torch.cat(xs) if xs else _EMPTY  # noqa: E731
        plan = StepPlan(
            input_ids=torch.cat(ids), positions=torch.cat(pos, dim=1), image_end=torch.cat(iend),
            images=images, out_slots=torch.cat(slots), num_prefill_rows=n_p,
            p_rows=i64([r.table_row for r, _, _ in entries]), p_start=i64([s for _, s, _ in entries]),
            p_seq_len=i64([e for _, _, e in entries]), p_cu_q=i64(cu),
            d_rows=i64([r.table_row for r in decodes]), d_seq_len=i64([i + 1 for i in idx] if decodes else []),
            logit_rows=i64(logit_rows), tw_rows=cat(tw_rows), tw_cols=cat(tw_cols), tw_vals=cat(tw_vals),
            exports=exports)
        self._table_writes = []
        return plan, all_entries

    def step_failed(self, entries, error: str, code: str = "engine_error") -> None:
        """A step that raised (TP=1, not a device fault). With one request, or once the step had advanced some
        (the failure came after the forward), its requests fail (`code`: engine_error, or engine_oom for an
        out-of-memory) and the others go on. With several
        and nothing advanced (the packed forward, the export or the sampling raised), which one broke it cannot be
        told: every running request goes back to the queue (a preemption: its computed tokens stay in the prefix
        cache, only this step is recomputed) and each request of the step then runs one step alone, which fails
        only the one that breaks its own step. A request in MAX_STRIKES failed shared steps fails anyway."""
        live = [(r, s, e) for r, s, e in entries if r.rid in self.reqs]
        if len(live) <= 1 or len(live) < len(entries) or any(r.num_computed > s for r, s, _ in live):
            return self.fail_step(entries, error, code)
        for r, s, e in live:
            self.alloc.free(r.slots[s:e])     # assigned for this step only
            r.strikes += 1
        for r in list(self.running):
            self.preempt(r)
        for r, _, _ in live:
            if r.strikes >= MAX_STRIKES:
                self.finish(r, "error", error, code)
            else:
                self._suspects.add(r.rid)

    def fail_step(self, entries, error: str, code: str = "engine_error") -> None:
        """Fail the requests of a step that raised and free the slots it had assigned (others go on)."""
        for r, s, e in entries:
            if r.rid not in self.reqs:
                continue
            if r.num_computed <= s:   # not advanced yet: the chunk's slots are still only assigned
                self.alloc.free(r.slots[s:e])
            self.finish(r, "error", error, code)

    # ---- results -----------------------------------------------------------------------------
    def sampling_requests(self, entries) -> list[Req]:
        """Requests owning plan.logit_rows, in row order."""
        return [r for r, _, e in entries if e == len(r.tokens) and self._needs_logits(r)]

    def process(self, entries, sampled: dict, exported: dict, logprobs: Optional[dict] = None) -> None:
        """Advance requests after the forward. sampled: rid -> token; exported: rid -> (handle | error);
        logprobs: rid -> (logprob, top alternatives) of the sampled token, for requests that asked."""
        logprobs = logprobs or {}
        self.stats.steps += 1
        for r, s, e in entries:
            self._suspects.discard(r.rid)     # its step ran
            r.num_computed = e
            if not r.prompt_cached and r.num_computed >= r.prompt_len:
                self._cache_prompt(r)
            if e != len(r.tokens):
                continue
            tok = sampled.get(r.rid)
            if isinstance(tok, SamplingFailure):
                self.finish(r, "error", tok.message, "sampling_error")
            elif r.kind == "text":
                if r.new_logprobs is not None and r.rid in logprobs:
                    r.new_logprobs.append(logprobs[r.rid])
                self._advance_text(r, tok)
            elif not r.think_done:
                kept = len(r.output_ids)
                self._advance_think(r, tok)
                if r.new_logprobs is not None and len(r.output_ids) > kept and r.rid in logprobs:
                    r.new_logprobs.append(logprobs[r.rid])
            else:
                res = exported.get(r.rid)
                if isinstance(res, dict):
                    self.finish(r, "exported", handle=res)
                else:
                    self.finish(r, "error", f"KV export failed: {res}", "kv_export_failed")

    def _advance_text(self, r: Req, tok: int) -> None:
        self.stats.generated_tokens += 1
        r.output_ids.append(tok)
        r.new_ids.append(tok)
        p = r.params
        if tok in r.msg.stop_token_ids:
            self.finish(r, "stop")
        elif len(r.output_ids) >= p.max_tokens or len(r.tokens) + 1 > self.max_model_len:
            self.finish(r, "length")
        else:
            r.append_tokens([tok])

    def _advance_think(self, r: Req, tok: int) -> None:
        """Greedy think decode of an image prefix: </think> is fed and ends the block, <|im_end|> ends it
        unfed, the budget ends it too; then the tail ("\n\n<img>") follows as one causal block."""
        self.stats.generated_tokens += 1
        m = r.msg
        if tok == m.think_stop_id:
            r.think_done = True
            r.append_tokens(list(m.think_tail_ids))
            return
        r.output_ids.append(tok)
        r.new_ids.append(tok)
        if tok == m.think_end_id or len(r.output_ids) >= m.max_think_tokens:
            r.think_done = True
            r.append_tokens([tok] + list(m.think_tail_ids))
        else:
            r.append_tokens([tok])

    # ---- reporting ---------------------------------------------------------------------------
    def take_outputs(self) -> list[RequestOutput]:
        outs = self.outputs
        for r in self.running:
            if r.new_ids:
                outs.append(RequestOutput(r.rid, r.new_ids, prompt_tokens=r.prompt_len,
                                          cached_tokens=r.hit_tokens, logprobs=self._take_logprobs(r)))
                r.new_ids = []
        self.outputs = []
        return outs

    def snapshot(self) -> EngineStats:
        s = self.stats
        s.running, s.waiting = len(self.running), len(self.waiting)
        s.kv_free = self.alloc.num_free
        s.kv_cached = self.cache.evictable_tokens
        s.kv_in_use = self.alloc.num_used - self.cache.evictable_tokens
        return s
