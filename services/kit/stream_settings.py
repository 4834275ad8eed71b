"""The slow-reader settings every service takes (kit/streaming.py's SlowReaderGuard enforces them), declared once
as flags (kit.flags): each service's config inherits StreamSettings. Light (no web framework), so a config that
inherits it stays a leaf."""
from __future__ import annotations

from dataclasses import dataclass, field

from .flags import flag

DEFAULT_WRITE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StreamSettings:
    """The slow-reader settings every service takes, as flags (kit.flags; a service config may inherit them)."""
    stream_write_timeout_s: float = field(default=DEFAULT_WRITE_TIMEOUT_S, metadata=flag(
        "a client that takes no byte of its (streamed) response for this long while a chunk waits is cut off and "
        "its work cancelled (slow reader); 0 = never"))
    stream_send_buffer_kb: int = field(default=0, metadata=flag(
        "cap each connection's kernel send buffer (SO_SNDBUF) at this many KiB: how much a client that reads "
        "nothing absorbs before --stream-write-timeout-s counts; 0 = kernel default"))

    def __post_init__(self) -> None:
        if self.stream_write_timeout_s < 0 or self.stream_send_buffer_kb < 0:
            raise ValueError("--stream-write-timeout-s and --stream-send-buffer-kb must be >= 0 (0 = off)")
