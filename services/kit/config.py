"""Secrets and settings for the services' command lines: values from a flag, a file or the environment —
never only argv, which /proc shows to every local user."""
from __future__ import annotations

from typing import Optional

from services.base.knobs import Knob


def read_secret(value: Optional[str], file: Optional[str], env: Knob) -> Optional[str]:
    """The secret from `--x-file PATH` (first line), else `--x VALUE`, else the environment knob `env`."""
    if file:
        with open(file, encoding="utf-8") as f:
            text = f.readline().strip()
        if not text:
            raise SystemExit(f"{file}: the secret file is empty")
        return text
    return value or env.raw() or None


def read_secrets(value: Optional[str], file: Optional[str], env: Knob) -> list[str]:
    """Several secrets (e.g. API keys): one per line of `--x-file PATH` (blank lines and `#` comments skipped),
    else the one `--x VALUE`, else the environment knob `env`."""
    if file:
        with open(file, encoding="utf-8") as f:
            keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise SystemExit(f"{file}: the secret file has no entries")
        return keys
    one = value or env.raw()
    return [one] if one else []
