"""Where the engine replicas listen: each replica heartbeats its URL; an entry not renewed within its time to
live is gone (a replica on a lost node cannot say goodbye). The gateway replicas read it every second."""
from __future__ import annotations

import time

KINDS = ("und", "gen")


class Registry:
    """A Serve deployment of one replica (state is rebuilt from the heartbeats when Serve replaces it)."""

    def __init__(self):
        self._entries: dict[str, dict] = {}      # url -> {"kind", "node_id", "expires"}

    def register(self, kind: str, url: str, node_id: str, ttl_s: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._entries[url] = {"kind": kind, "node_id": node_id, "expires": time.monotonic() + ttl_s}

    def unregister(self, url: str) -> None:
        self._entries.pop(url, None)

    def replicas(self) -> dict[str, list[dict]]:
        """{"und": [{"url", "node_id"}, ...], "gen": [...]}, live entries only, in URL order."""
        now = time.monotonic()
        self._entries = {u: e for u, e in self._entries.items() if e["expires"] > now}
        out: dict[str, list[dict]] = {k: [] for k in KINDS}
        for url in sorted(self._entries):
            e = self._entries[url]
            out[e["kind"]].append({"url": url, "node_id": e["node_id"]})
        return out
