"""Process-local copy metrics (bytes moved, latency histogram) as plain dicts."""
from __future__ import annotations

import bisect
import threading

# Upper bounds in seconds; the last bucket is +Inf (Prometheus-style cumulative on export).
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class CopyMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._data = {kind: {"count": 0, "bytes": 0, "seconds_sum": 0.0,
                             "bucket_counts": [0] * (len(LATENCY_BUCKETS_S) + 1)}
                      for kind in ("export", "import")}

    def observe(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            d = self._data[kind]
            d["count"] += 1
            d["bytes"] += int(nbytes)
            d["seconds_sum"] += float(seconds)
            d["bucket_counts"][bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1

    def snapshot(self) -> dict:
        """Per kind: count, bytes, seconds_sum and non-cumulative bucket_counts (last = above the top bound)."""
        with self._lock:
            out = {kind: {k: (list(v) if isinstance(v, list) else v) for k, v in d.items()}
                   for kind, d in self._data.items()}
        out["latency_buckets_s"] = list(LATENCY_BUCKETS_S)
        return out
