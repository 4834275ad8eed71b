"""HTTP byte ranges (RFC 9110 §14): the one `Range: bytes=...` a resumable download sends."""
from __future__ import annotations

import re
from typing import Optional

from .errors import APIError

_ONE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")
_HUGE = 10 ** 19              # beyond any file: a longer number is read as this (int() of 4,300 digits raises)


def _number(digits: str) -> int:
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) < 19 else _HUGE


def byte_range(header: Optional[str], size: int) -> Optional[tuple[int, int]]:
    """[start, end) asked by a `Range` header of one range (`a-b`, `a-`, `-n`); None when there is none or it is
    one the server may ignore and answer whole (another unit, several ranges). 416 when it lies past the end."""
    if not header:
        return None
    m = _ONE.match(header)
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:                                    # the last n bytes
        start, end = max(size - _number(last), 0), size
    else:
        start = _number(first)
        end = min(_number(last) + 1, size) if last else size
        if last and _number(last) < start:
            return None                              # malformed: ignored, as the RFC says
    if start >= end:
        raise APIError(416, f"range {header.strip()[:80]!r} is outside the {size} bytes", param="range",
                       code="range_not_satisfiable", headers={"content-range": f"bytes */{size}"})
    return start, end
