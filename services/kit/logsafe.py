"""Values from clients (paths, ids, headers) made safe to put in a log line: printable, bounded."""
from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^\x20-\x7e]")


def safe(value: object, limit: int = 200) -> str:
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + f"...(+{len(text) - limit})"
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else "?", text)
