"""The prefill phase of a step: chunks of running requests, then of newly admitted ones, up to the step's budget.

Chat first (colocate QoS): image-prefix requests (kind "prefix": the prompt of an image job, an edit's input image)
are taken after chat ones, so a chat's first token never waits behind image prefills queued before it, and in a
step that also decodes they get at most `IMAGE_PREFILL_WITH_DECODES` tokens: a decode step's time, and so every
running chat's inter-token latency, is not stretched by a long image prefill. An image span larger than that is
never split (Req.chunk_end): it goes whole as the step's only image-prefix chunk, so it waits one step at most.
"""
from __future__ import annotations

from .request import Req

Entry = tuple[Req, int, int]     # (request, first token, end) of one prefill chunk
# image-prefix tokens in a step that has decode rows: ~a decode step's worth of prefill at 8B (TTFT of 1,024 tokens
# ~30 ms on one H200 against a ~7 ms decode step), so such a step takes at most ~2x a plain decode step
IMAGE_PREFILL_WITH_DECODES = 256


class PrefillManager:
    """Picks a step's prefill chunks (never splitting an image span, Req.chunk_end)."""

    def __init__(self, sched):
        self.sched = sched      # the Scheduler: running and waiting requests, free KV, admission
        self.image_tokens_held = 0     # image-prefix tokens left for a later step because chats decoded (counter)

    def take(self, budget: int, reserved: int, decoding: bool = False) -> list[Entry]:
        """Chunks of at most `budget` tokens together: chat requests before image-prefix ones; within each, running
        requests first, in arrival order (one that does not fit is passed over), then waiting requests admitted in
        queue order (the first that cannot be admitted or does not fit ends that kind's intake). `reserved`: KV
        slots the step already takes (its decode rows); `decoding`: the step has decode rows (module doc)."""
        batch = _Batch(budget, reserved)
        self._take_kind(batch, chat=True)
        if batch.budget > 0:
            image_budget = min(batch.budget, IMAGE_PREFILL_WITH_DECODES) if decoding else batch.budget
            wanted = self._image_tokens_pending()
            taken = self._take_kind(batch, chat=False, cap=image_budget)
            if decoding and wanted > taken:
                self.image_tokens_held += min(wanted, batch.budget + taken) - taken
        return batch.entries

    def _take_kind(self, batch: "_Batch", chat: bool, cap: int | None = None) -> int:
        """Take chunks of one kind (chat: kind "text"; else image prefixes) within `cap` tokens of the budget (an
        image span that starts the kind's first chunk goes whole). Returns the tokens taken."""
        s = self.sched
        before = batch.used
        limit = _Limit(batch, cap)
        for r in sorted((r for r in s.running if _is_chat(r) == chat and not r.is_decode and r.pending > 0),
                        key=lambda r: r.arrival):
            if limit.budget <= 0:
                break
            limit.add(r, s.available())
        for r in [r for r in s.waiting if _is_chat(r) == chat]:
            if limit.budget <= 0:
                break
            if not (s.admitting or r.admitted_once) or not s.try_admit(r, batch.reserved):
                break
            if not limit.add(r, s.available()):
                break
        return batch.used - before

    def _image_tokens_pending(self) -> int:
        s = self.sched
        return sum(r.pending for r in s.running if not _is_chat(r) and not r.is_decode) + \
            sum(len(r.tokens) for r in s.waiting if not _is_chat(r))


def _is_chat(r: Req) -> bool:
    return r.kind == "text"


class _Batch:
    def __init__(self, budget: int, reserved: int):
        self.budget, self.reserved = budget, reserved   # reserved: slots the step takes (allocated after selection)
        self.entries: list[Entry] = []
        self.used = 0

    def add(self, r: Req, available: int, budget: int | None = None, first: bool | None = None) -> bool:
        """Take r's next chunk if it fits the budget (the step's, or the tighter `budget` of one kind; a first chunk
        may exceed it: an image span) and free KV."""
        budget = self.budget if budget is None else budget
        first = not self.entries if first is None else first
        end = r.chunk_end(budget)
        n = end - r.num_computed
        if (n > budget and not first) or n + self.reserved > available or (n > self.budget and self.entries):
            return False
        self.entries.append((r, r.num_computed, end))
        self.budget -= n
        self.reserved += n
        self.used += n
        return True


class _Limit:
    """One kind's share of a batch: at most `cap` tokens of it (None: the batch's budget)."""

    def __init__(self, batch: _Batch, cap: int | None):
        self.batch, self.cap, self.taken = batch, cap, 0

    @property
    def budget(self) -> int:
        return self.batch.budget if self.cap is None else min(self.batch.budget, self.cap - self.taken)

    def add(self, r: Req, available: int) -> bool:
        before = self.batch.used
        # the kind's first chunk may be an image span larger than the cap (never split): it goes whole
        if not self.batch.add(r, available, budget=max(1, self.budget), first=self.taken == 0):
            return False
        self.taken += self.batch.used - before
        return True
