"""Reading a real service's Prometheus /metrics in the tests."""
from __future__ import annotations

from typing import Optional

import httpx


def metric(base: str, name: str, headers: Optional[dict] = None, timeout: float = 30.0,
           default: Optional[float] = None) -> float:
    """The sum of the samples of metric `name` (bare or labelled) on `base`/metrics. With no sample: `default`, or
    KeyError without one (a misspelt name fails loudly; a labelled counter has no sample before its first count)."""
    text = httpx.get(base + "/metrics", headers=headers, timeout=timeout).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    if values:
        return sum(values)
    if default is None:
        raise KeyError(name)
    return default
