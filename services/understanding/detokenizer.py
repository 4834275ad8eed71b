"""Incremental detokenisation, think-mode split and stop strings (runs in the HTTP process)."""
from __future__ import annotations

from typing import Optional


# A UTF-8 character is at most 4 bytes and every token adds at least one, so a character still incomplete
# after this many held tokens never completes (stray bytes): emit them as U+FFFD rather than stall the stream
# and re-decode an ever longer tail on every token.
MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    """Emits text deltas as token ids arrive; holds back bytes that do not yet form a whole character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        held = len(self.ids) - self.read_offset
        if len(text) > len(prefix) and (not text.endswith("\ufffd") or held > MAX_HELD_TOKENS):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""


class OutputText:
    """Splits generated ids into reasoning / content, detokenises both and applies stop strings.

    think: True = the prompt ended inside `<think>` (output starts as reasoning); None = the model may open
    a `<think>` block itself; False = no reasoning split at all.
    """

    def __init__(self, tokenizer, think: Optional[bool], stop: list[str], hidden_ids: set[int]):
        self.think_id = tokenizer.think_id
        self.end_think_id = tokenizer.end_think_id
        self.split = think is not False
        self.in_reasoning = think is True
        self.seen_any = False
        self.hidden_ids = hidden_ids          # stop / eos tokens never shown as text
        self.reasoning = IncrementalDetokenizer(tokenizer)
        self.content = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.content_text = ""                # full content (for stop-string search)
        self.content_sent = 0                 # chars of content_text already emitted
        self.reasoning_text = ""
        self.stopped = False
        self.content_positions: list[int] = []   # which of the last push's ids went into the content

    def push(self, ids: list[int]) -> tuple[str, str]:
        """Returns (reasoning_delta, content_delta)."""
        r_delta = ""
        self.content_positions = []
        for pos, tid in enumerate(ids):
            if self.stopped:
                break
            first = not self.seen_any
            self.seen_any = True
            if tid in self.hidden_ids:
                continue
            if self.split and first and tid == self.think_id and not self.in_reasoning:
                self.in_reasoning = True
                continue
            if self.split and self.in_reasoning and tid == self.end_think_id:
                r_delta += self.reasoning.flush()
                self.in_reasoning = False
                continue
            if self.in_reasoning:
                r_delta += self.reasoning.push([tid])
            else:
                self.content_text += self.content.push([tid])
                self.content_positions.append(pos)
        self.reasoning_text += r_delta
        return r_delta, self._content_delta(final=False)

    def finish(self) -> tuple[str, str]:
        r_delta = self.reasoning.flush()
        self.reasoning_text += r_delta
        if not self.stopped:
            self.content_text += self.content.flush()
        return r_delta, self._content_delta(final=True)

    def _content_delta(self, final: bool) -> str:
        if self.stop and not self.stopped:
            search_from = max(0, self.content_sent - self.hold)
            cut = min((i for i in (self.content_text.find(s, search_from) for s in self.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                self.content_text = self.content_text[:cut]
                self.stopped = True
                final = True
        end = len(self.content_text) if (final or self.stopped) else max(
            self.content_sent, len(self.content_text) - self.hold)
        delta = self.content_text[self.content_sent:end]
        self.content_sent = end
        return delta


MIN_LOGPROB = -9999.0     # what OpenAI reports for an impossible token (JSON has no -inf)


class LogprobEntries:
    """Engine log probabilities -> OpenAI's `logprobs.content` entries: {token, logprob, bytes, top_logprobs}."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def _one(self, token_id: int, logprob: float) -> dict:
        raw = self.tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(MIN_LOGPROB, float(logprob)),
                "bytes": list(raw)}

    def entries(self, ids: list[int], logprobs: list, positions: list[int]) -> list[dict]:
        """The entries of ids[p] for p in positions (the tokens that became content)."""
        out = []
        for p in positions:
            if p >= len(logprobs):
                break
            chosen, alts = logprobs[p]
            out.append({**self._one(ids[p], chosen), "top_logprobs": [self._one(t, lp) for t, lp in alts]})
        return out
