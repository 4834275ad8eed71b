"""Secrets and settings for the services' command lines: values from a flag, a file or the environment —
never only argv, which /proc shows to every local user."""
from __future__ import annotations

import os
from typing import Optional


def read_secret(value: Optional[str], file: Optional[str], env: str) -> Optional[str]:
    """The secret from `--x-file PATH` (first line), else `--x VALUE`, else the environment variable `env`."""
    if file:
        with open(file, encoding="utf-8") as f:
            text = f.readline().strip()
        if not text:
            raise SystemExit(f"{file}: the secret file is empty")
        return text
    return value or os.environ.get(env) or None
