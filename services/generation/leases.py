"""The HTTP process's pages in the KV pool, one owner per job: `JobLease`.

At acceptance the HTTP process claims the job's prefix pages (shm_transfer `claim`): they are then no longer
reclaimed at their lease deadline but only when this process dies, so a job may wait behind any number of
long steps (or a stopped engine) without its KV turning into a 410, and a dead service still gives its pages
back at once. The engine frees them right after its import. The float images the engine exports for a job
(interleave) are the client's once its stream delivered them, and this process's to free otherwise.

Each accepted job has one `JobLease`; the call sites say what happened to the job (imported, ended, failed in
or with the engine, its stream closed) and the lease decides which pages to free, each at most once, however
many of those reports come and in whatever order. A request refused before acceptance has no lease: `refuse`
frees what it brought. Every pool operation runs on one thread (`HandleKeeper`): the others only queue.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterable, Optional

log = logging.getLogger("u1serve.generation")


class HandleKeeper:
    """The one thread that claims and frees this process's pages in the pool."""

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

    def lease(self, handles: Iterable[dict]) -> "JobLease":
        """The ledger of one job about to be accepted (nothing claimed until its `hold`)."""
        return JobLease(self, handles)

    def refuse(self, handles: Iterable[dict]) -> None:
        """A request refused before acceptance (it has no lease): free the pages it brought."""
        self._free(list(handles))

    def stray_image(self, handle: dict) -> None:
        """A float image the engine exported for a job that has ended here: nobody will read it back."""
        self._free([handle])

    def _claim(self, handles: list[dict]) -> None:
        self._commands.put(("claim", handles))

    def _free(self, handles: list[dict]) -> None:
        """Idempotent at the pool: a handle frees only pages it still owns."""
        if handles:
            self._commands.put(("release", handles))

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


class JobLease:
    """One accepted job's pages in this process: its prefix KV (claimed at `hold`) and the float images the engine
    exported for it. Any thread; each report is idempotent and each page is freed at most once."""

    def __init__(self, keeper: HandleKeeper, handles: Iterable[dict]):
        self._keeper = keeper
        self._lock = threading.Lock()
        self._prefix: list[dict] = list(handles)
        self._held = False
        self._imported = False                      # the engine imported the prefix: it frees it itself
        self._ended = False
        self._images: list[dict] = []               # exported for the stream, not yet written to its client
        self._shown: list[dict] = []                # written to the client (its own once it reads [DONE])
        self._stream_closed = False

    # -- the prefix KV ---------------------------------------------------------------------------
    def hold(self) -> None:
        """The job is accepted: claim its pages (not if it has ended already: its end freed them)."""
        with self._lock:
            if self._held or self._ended:
                return
            self._held = True
        self._keeper._claim(self._prefix)

    def imported(self) -> None:
        """The engine admitted the job (JobStarted): it imported the prefix and frees it itself."""
        with self._lock:
            self._imported = True

    def ended(self) -> None:
        """The job ended on this side (done, aborted, timed out): its prefix is freed unless the engine imported
        it."""
        self._end(unless_imported=True)

    def failed(self) -> None:
        """The engine failed the job or died with it (or the service shuts down): its prefix is freed whatever
        the engine did with it (it may have died between its import and its free)."""
        self._end(unless_imported=False)

    # -- the exported float images ---------------------------------------------------------------
    def image(self, handle: dict) -> bool:
        """A float image exported for this job's stream, kept until the stream closes. False (and freed at once)
        when the stream has closed already."""
        with self._lock:
            if not self._stream_closed:
                self._images.append(handle)
                return True
        self._keeper._free([handle])
        return False

    def shown(self, handle: dict) -> None:
        """The stream wrote this image's handle to its client."""
        with self._lock:
            if handle in self._images:
                self._images.remove(handle)
                self._shown.append(handle)

    def stream_closed(self, delivered: bool) -> None:
        """The job's stream ended. The images its client read through [DONE] (`delivered`) are the client's to
        release; every other exported image is freed now, and any that comes later at once."""
        with self._lock:
            if self._stream_closed:
                return
            self._stream_closed = True
            free = self._images + ([] if delivered else self._shown)
            self._images, self._shown = [], []
        self._keeper._free(free)

    def _end(self, unless_imported: bool) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            free = [] if unless_imported and self._imported else self._prefix
        self._keeper._free(free)
