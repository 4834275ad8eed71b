"""The HTTP process's hold on the prefix KV of accepted jobs until the engine imports it.

At acceptance the HTTP process claims the job's pages (shm_transfer `claim`): they are then no longer
reclaimed at their lease deadline but only when this process dies, so a job may wait behind any number of
long steps (or a stopped engine) without its KV turning into a 410, and a dead service still gives its pages
back at once. The engine frees them right after its import. This module also frees the pages of jobs that
will never import them (rejected, aborted, timed out, caught in an engine crash). Every pool operation runs
on one thread here: the event loop only queues commands.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterable, Optional

log = logging.getLogger("u1serve.generation")


class HandleKeeper:
    def __init__(self, pool_name: str, fingerprint: Optional[str], follow_handles: bool = False):
        self.pool_name = pool_name
        self.follow_handles = follow_handles
        self.fingerprint = fingerprint or ""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._source = None
        self._thread: Optional[threading.Thread] = None

    # -- any thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="u1-gen-kv-keeper", daemon=True)
        self._thread.start()

    def hold(self, handles: Iterable[dict]) -> None:
        """Claim these handles' pages for this process (until the engine imports or someone releases them)."""
        self._commands.put(("claim", list(handles)))

    def release(self, handles: Iterable[dict]) -> None:
        """Free their pages. Idempotent: a handle frees only pages it still owns."""
        self._commands.put(("release", list(handles)))

    def pending(self) -> int:
        return self._commands.qsize()

    def stop(self, timeout: float = 5.0) -> None:
        self._commands.put(("stop", []))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the keeper thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:    # open the pool if it is there (one look): its modules load now, not on the first request's claim
            self._pool_source().transport("shm", wait_s=0)
        except Exception:
            pass    # not there yet: the first claim opens it
        while True:
            kind, handles = self._commands.get()
            if kind == "stop":
                break
            try:
                if kind == "claim":
                    self._pool_source().claim(handles)
                else:
                    self._pool_source().release(handles)
            except Exception:
                log.exception("KV keeper: %s failed", kind)
        if self._source is not None:
            self._source.close()

    def _pool_source(self):
        if self._source is None:
            import torch

            from .kv_source import PrefixSource
            self._source = PrefixSource(self.pool_name, self.fingerprint, torch.device("cpu"),
                                        follow_handles=self.follow_handles)
        return self._source
