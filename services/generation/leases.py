"""The HTTP process's hold on the prefix KV of jobs that have not reached the engine's batch yet.

Until the engine imports a job's prefixes (and frees the pages), the pages are only leased. A thread here,
not the engine loop, keeps those leases at least LEASE_AHEAD_S ahead, so a job waiting behind long steps
(or a stopped engine) never finds its KV reclaimed, while a dead service gives the pages back within
seconds. It also frees the pages of jobs that will never import them (rejected, cancelled, timed out, or
caught in an engine crash). Every pool operation runs on this thread: the event loop only queues commands.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterable

log = logging.getLogger("u1serve.generation")

LEASE_AHEAD_S = 5.0     # short: a dead service must not hold pages long
REFRESH_EVERY_S = 1.5


class HandleKeeper:
    def __init__(self, pool_name: str, fingerprint: str | None, refresh_s: float = REFRESH_EVERY_S,
                 ahead_s: float = LEASE_AHEAD_S):
        self.pool_name = pool_name
        self.fingerprint = fingerprint or ""
        self.refresh_s = refresh_s
        self.ahead_s = ahead_s
        self._held: dict[str, list[dict]] = {}   # request id -> handles still waiting (this thread only)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._source = None
        self._thread: threading.Thread | None = None

    # -- any thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="u1-gen-leases", daemon=True)
        self._thread.start()

    def hold(self, request_id: str, handles: Iterable[dict]) -> None:
        """Keep these handles' leases alive until `taken` or `release`."""
        self._commands.put(("hold", request_id, list(handles)))

    def taken(self, request_id: str) -> None:
        """The engine imported them (it frees the pages itself)."""
        self._commands.put(("taken", request_id, None))

    def release(self, request_id: str | None, handles: Iterable[dict] = ()) -> None:
        """Free the pages of a held job (and/or of the given handles). Idempotent: a handle frees only pages
        it still owns."""
        self._commands.put(("release", request_id, list(handles)))

    def pending(self) -> int:
        return self._commands.qsize()

    def held(self) -> int:
        return len(self._held)

    def stop(self, timeout: float = 5.0) -> None:
        self._commands.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the keeper thread ---------------------------------------------------------------------
    def _run(self) -> None:
        import time
        next_refresh = time.monotonic() + self.refresh_s
        while True:
            try:
                kind, rid, handles = self._commands.get(timeout=max(0.0, next_refresh - time.monotonic()))
            except queue.Empty:
                kind = None
            try:
                if kind == "stop":
                    break
                if kind == "hold":
                    self._held[rid] = handles
                    self._extend(handles)      # at once: the lease it came with may be short
                elif kind == "taken":
                    self._held.pop(rid, None)
                elif kind == "release":
                    self._free(self._held.pop(rid, []) + handles if rid is not None else handles)
                if time.monotonic() >= next_refresh:
                    self._extend([h for hs in self._held.values() for h in hs])
                    next_refresh = time.monotonic() + self.refresh_s
            except Exception:
                log.exception("KV lease keeper: %s failed", kind or "refresh")
        if self._source is not None:
            self._source.close()

    def _pool_source(self):
        if self._source is None:
            import torch

            from .kv_source import PrefixSource
            self._source = PrefixSource(self.pool_name, self.fingerprint, torch.device("cpu"))
        return self._source

    def _extend(self, handles: list[dict]) -> None:
        if handles:
            self._pool_source().keep_alive(handles, self.ahead_s)

    def _free(self, handles: list[dict]) -> None:
        if handles:
            self._pool_source().release(handles)
