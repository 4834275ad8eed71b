"""The `PATH[:STRENGTH]` syntax of `--lora` / `U1SERVE_LORA`, without torch (the launcher parses it too)."""
from __future__ import annotations


def parse_lora_spec(text: str) -> tuple[str, float]:
    """'PATH' or 'PATH:STRENGTH' -> (path, strength)."""
    path, sep, tail = text.rpartition(":")
    if sep:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return text, 1.0
