"""Who frees an image job's prefix KV pages: one owner object per job, so no exit path can leak them.

Understanding allocates the pages and frees them itself until it hands the handles out (its `handles` event).
From then on the gateway owns them, until generation accepts the job: generation imports and frees them, also
when it is cancelled. They come back to the gateway when generation fails the job (it imports nothing more),
dies, or cannot confirm a cancel. `close()` ends the job and returns what the gateway must release; release is
idempotent and frees only pages still owned by those handle ids, so a second release never hurts anybody.
"""
from __future__ import annotations

from services.kit.errors import unavailable

UNDERSTANDING, GATEWAY, GENERATION, CLOSED = "understanding", "gateway", "generation", "closed"


class PrefixHandles:
    def __init__(self) -> None:
        self.handles: dict[str, dict] = {}
        self.owner = UNDERSTANDING

    def received(self, handles: object) -> None:
        """Understanding's `handles` event: the pages are the gateway's now."""
        if not isinstance(handles, dict) or not handles or not all(isinstance(h, dict) for h in handles.values()):
            raise unavailable("understanding service sent malformed prefix handles", code="upstream_protocol_error")
        self.handles = handles
        self.owner = GATEWAY

    def accepted(self) -> None:
        """Generation answered 200 to /internal/generate: it owns the pages (and frees them)."""
        if self.owner == GATEWAY:
            self.owner = GENERATION

    def returned(self) -> None:
        """Generation failed the job, died, or did not confirm a cancel: the pages are the gateway's again."""
        if self.owner == GENERATION:
            self.owner = GATEWAY

    def close(self) -> list[dict]:
        """End of the job: the handles the gateway must release (none when generation or understanding has
        them, or after the first close)."""
        out = list(self.handles.values()) if self.owner == GATEWAY else []
        self.owner = CLOSED
        return out
