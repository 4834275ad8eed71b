"""Engine-side state of one request: its tokens, cache keys, positions and KV slots.

Only the prompt's (t, h, w) positions and image_end are stored; every later token (decode, think, think
tail) sits at t = base_t + (index - prompt_len), h = w = 0, image_end = 0, so nothing grows per token.
"""
from __future__ import annotations

from typing import Optional

import torch

from services.model import positions as P

from .protocol import SubmitRequest
from .radix_cache import image_digest, image_keys, salt_keys


class Req:
    def __init__(self, msg: SubmitRequest, img_context_id: int, arrival: int):
        self.msg = msg
        self.rid = msg.rid
        self.kind = msg.kind
        self.params = msg.params
        self.arrival = arrival
        ids = list(msg.input_ids)
        self.prompt_len = len(ids)
        grids = [tuple(im.grid_hw) for im in msg.images]
        ids_t = torch.tensor(ids, dtype=torch.long)
        runs = P._runs(ids_t == img_context_id)
        if len(runs[0]) != len(grids):
            raise ValueError(f"the prompt has {len(runs[0])} image-context runs for {len(grids)} images (text may not "
                             "contain the image placeholder token)")
        self.prompt_pos = P.thw_indexes(ids_t, img_context_id, grids)       # [3, P]
        self.prompt_iend = P.image_end(ids_t, img_context_id)               # [P] int32
        self.prompt_t = self.prompt_pos[0].tolist()
        self.base_t = max(self.prompt_t) + 1 if ids else 0                  # t of the first appended token
        if msg.kind == "text":
            extra = msg.params.max_tokens + 1
        else:
            extra = (msg.max_think_tokens + 1 if msg.think else 0) + len(msg.think_tail_ids) + 1
        cap = len(ids) + extra
        # Cache keys: token ids, with image-context tokens replaced by content-hash keys, in the salt's domain.
        keys: list = list(ids)
        self.spans: list[tuple[int, int, int]] = []  # (start, end, image index)
        starts, ends = runs
        for i, (s, e) in enumerate(zip(starts, ends)):
            im = msg.images[i]
            keys[s:e] = image_keys(image_digest(im.pixel_values, im.grid_hw), e - s)
            self.spans.append((s, e, i))
        self.keys = salt_keys(keys, msg.cache_salt)
        self.lora = None                        # the LoRA adapter held (lora.bind), salting the keys further
        self.tokens = ids                       # every token whose id is known (fed or to be fed)
        self.output_ids: list[int] = []         # generated tokens (text) / think tokens (prefix)
        self.num_computed = 0                   # tokens whose KV is in the pool
        self.slots = torch.zeros(cap, dtype=torch.int64)
        self.cached_len = 0                     # leading tokens owned by the prefix cache
        self.node = None                        # locked radix node covering cached_len tokens
        self.table_row: Optional[int] = None    # row in the engine's req_to_token table
        self.prompt_cached = False              # prompt inserted into the prefix cache
        self.hit_tokens = 0                     # prefix-cache hit at first admission
        self.admitted_once = False
        self.strikes = 0                        # failed shared steps it was in (scheduler.step_failed)
        self.enqueued_at = 0.0                  # when the scheduler queued it (queue-wait timeout)
        self.think_done = not msg.think
        self.finished: Optional[str] = None
        self.new_ids: list[int] = []            # produced this step, not yet reported
        self.new_logprobs: Optional[list] = [] if msg.params.logprobs is not None else None
        self.generator = None
        if msg.kind == "prefix" and msg.think and msg.max_think_tokens <= 0:
            self.think_done = True
            self.append_tokens(list(msg.think_tail_ids))

    # ---- token bookkeeping -------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def next_t(self) -> int:
        """t of the next token to append (= max t + 1 of everything known so far)."""
        return self.base_t + len(self.tokens) - self.prompt_len

    def append_tokens(self, ids: list[int]) -> None:
        """Append fed tokens (decode / think / think tail): causal rows at consecutive t."""
        self.tokens.extend(ids)
        self.keys.extend(ids)

    def t_at(self, i: int) -> int:
        return self.prompt_t[i] if i < self.prompt_len else self.base_t + i - self.prompt_len

    def is_image_row(self, i: int) -> bool:
        return i < self.prompt_len and int(self.prompt_iend[i]) > 0

    @property
    def is_decode(self) -> bool:
        """Its next step is one decode row (one token to feed, outside an image span)."""
        return self.pending == 1 and not self.is_image_row(self.num_computed)

    def positions(self, s: int, e: int) -> torch.Tensor:
        """[3, e - s] positions of tokens [s, e)."""
        P_ = self.prompt_len
        if e <= P_:
            return self.prompt_pos[:, s:e]
        tail_from = max(s, P_)
        t = torch.arange(self.base_t + tail_from - P_, self.base_t + e - P_)
        tail = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)])
        return tail if s >= P_ else torch.cat([self.prompt_pos[:, s:P_], tail], dim=1)

    def image_end(self, s: int, e: int) -> torch.Tensor:
        P_ = self.prompt_len
        if e <= P_:
            return self.prompt_iend[s:e]
        tail = torch.zeros(e - max(s, P_), dtype=torch.int32)
        return tail if s >= P_ else torch.cat([self.prompt_iend[s:P_], tail])

    def chunk_end(self, budget: int) -> int:
        """End of the next chunk of at most `budget` tokens that never splits an image span (a span that
        starts the chunk is taken whole even if it exceeds the budget)."""
        start = self.num_computed
        end = min(len(self.tokens), start + max(1, budget))
        for s, e, _ in self.spans:
            if s < end < e:
                end = s if s > start else e
                break
        return end

    def images_in(self, start: int, end: int) -> list:
        return [self.msg.images[i] for s, e, i in self.spans if s >= start and e <= end]

    def safe_prefix_len(self, n: int) -> int:
        """Largest length <= n that does not end inside an image span and leaves >= 1 token to compute."""
        n = min(n, len(self.tokens) - 1)
        for s, e, _ in self.spans:
            if s < n < e:
                n = s
        return max(n, 0)
