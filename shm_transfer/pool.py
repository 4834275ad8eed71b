"""ShmKVPool: a page pool of prefix KV in one named POSIX shared-memory segment.

Segment layout (all little-endian):
  [0, 128)        header words (int64[16]): magic, version, state, counters, generation ...
  [128, 256)      owner record (segment.py): owning stack id, creator pid, random token
  [256, 4096)     JSON: layout, model fingerprint, generation, creator pid
  [4096, ...)     page table: owner handle id int64[P] (0 = free), lease deadline float64[P] (epoch s),
                  claimer slot int64[P], claimer nonce int64[P] (0 = not claimed); then the claimer slot
                  table: nonce int64[S], pid int64[S]
  [data_off, end) pages [P, L, 2, page_tokens, Hkv, D] in the layout dtype (data_off 64 KiB aligned)

Device pages (`create(..., pages_device=...)`, the "device" transport): the segment ends at data_off (header and
page table only) and the pages are a tensor on that device owned by the creator, registered in this process
(shm_transfer.device_pages) so a consumer in the same process attaches the pool by name as usual and reads them
there. Every page-table rule (ownership, leases, claims, release, reclaim, generation) is the same code either way;
in another process the table still works but copies are refused (HandleError `device_pages_elsewhere`).

Liveness (creator, claimers) is an OFD byte-range lock per slot (shm_transfer.locks): slot 0 is the
creator's; a consumer that claims a handle takes a free slot and writes a fresh nonce into the slot table.
Claimed pages are reclaimable once that slot's lock is gone or holds another nonce (the claimer died).

Both the producer (understanding, creator) and the consumer (generation, attacher) allocate/release; every
page-table operation holds an flock on the segment's fd (released by the kernel if a holder dies, so a
killed process cannot wedge the pool) plus a thread lock (flock does not exclude threads of one process).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import threading
import time
import weakref

import numpy as np
import torch

from . import device_pages, locks, pinning
from .errors import HandleError, PoolError, PoolFull
from .handle import KVHandle, check_static
from .layout import LAYOUT_VERSION, KVLayout
from .metrics import CopyMetrics
from .segment import CREATOR_SLOT, Segment, take_name

MAGIC = int.from_bytes(b"U1KVPOOL", "little")
_STATE_READY = 0x5EAD1
_HEADER_WORDS = 16      # [128, 256): the owner record (segment.py)
_JSON_OFF = 256
_TABLE_OFF = 4096
_DATA_ALIGN = 1 << 16
NUM_SLOTS = 1024  # processes that may hold claims at once (slot 0: the creator)

# header word indices
_W_MAGIC, _W_VERSION, _W_STATE, _W_JSON_LEN = 0, 1, 2, 3
_W_DATA_OFF, _W_NUM_PAGES, _W_NEXT_HANDLE, _W_GENERATION = 4, 5, 6, 7
_W_BYTES_EXPORTED, _W_BYTES_IMPORTED, _W_ALLOCS, _W_ALLOC_FULL = 8, 9, 10, 11
_W_PAGES_RECLAIMED, _W_PAGES_RELEASED = 12, 13


def _data_offset(num_pages: int) -> int:
    table_end = _TABLE_OFF + 32 * num_pages + 16 * NUM_SLOTS
    return -(-table_end // _DATA_ALIGN) * _DATA_ALIGN


def segment_bytes(layout: KVLayout, size_bytes: int, *, device_pages: bool = False) -> int:
    """The shared-memory segment a pool of `size_bytes` takes: its whole pages after the header and page table
    (with `device_pages`, the header and page table only: the pages live on the device)."""
    num_pages = int(size_bytes) // layout.page_bytes
    return _data_offset(num_pages) + (0 if device_pages else num_pages * layout.page_bytes)


class ShmKVPool:
    """Use `ShmKVPool.create` (producer) or `ShmKVPool.attach` (consumer); close() when done."""

    def __init__(self, segment: Segment, *, pin: bool | None, pages: torch.Tensor | None = None):
        """`pages`: the creator's device pages (create); an attacher of a device pool finds them registered."""
        self._seg = segment
        self._tlock = threading.RLock()
        self.metrics = CopyMetrics()
        mm = segment.mm
        self._hdr = np.frombuffer(mm, dtype=np.int64, count=_HEADER_WORDS, offset=0)
        if int(self._hdr[_W_MAGIC]) != MAGIC or int(self._hdr[_W_STATE]) != _STATE_READY:
            self._drop_views()
            raise PoolError(f"segment {segment.name!r} is not a ready u1serve KV pool")
        if int(self._hdr[_W_VERSION]) != LAYOUT_VERSION:
            version = int(self._hdr[_W_VERSION])
            self._drop_views()
            raise PoolError(f"KV pool {segment.name!r} has layout version {version}, "
                            f"this build understands {LAYOUT_VERSION}")
        meta = json.loads(bytes(mm[_JSON_OFF:_JSON_OFF + int(self._hdr[_W_JSON_LEN])]))
        self.name = segment.name
        self.layout = KVLayout.from_dict(meta["layout"])
        self.fingerprint: str = meta["model_fingerprint"]
        self.generation: str = meta["generation"]
        self.creator_pid: int = meta["creator_pid"]
        self.num_pages = int(self._hdr[_W_NUM_PAGES])
        data_off = int(self._hdr[_W_DATA_OFF])
        self._owner = np.frombuffer(mm, dtype=np.int64, count=self.num_pages, offset=_TABLE_OFF)
        self._deadline = np.frombuffer(mm, dtype=np.float64, count=self.num_pages,
                                       offset=_TABLE_OFF + 8 * self.num_pages)
        self._claim_slot = np.frombuffer(mm, dtype=np.int64, count=self.num_pages,
                                         offset=_TABLE_OFF + 16 * self.num_pages)
        self._claim_nonce = np.frombuffer(mm, dtype=np.int64, count=self.num_pages,
                                          offset=_TABLE_OFF + 24 * self.num_pages)
        slots_off = _TABLE_OFF + 32 * self.num_pages
        self._slot_nonce = np.frombuffer(mm, dtype=np.int64, count=NUM_SLOTS, offset=slots_off)
        self._slot_pid = np.frombuffer(mm, dtype=np.int64, count=NUM_SLOTS, offset=slots_off + 8 * NUM_SLOTS)
        self._slot: int | None = CREATOR_SLOT if segment.created else None  # our liveness slot, once taken
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        # where the pages are: None (in the segment) or the device of a device pool ("cuda:0", "cpu", ...)
        self.pages_device: str | None = meta.get("pages_device")
        if self.pages_device is None:
            data = self._bytes[data_off:data_off + self.num_pages * self.layout.page_bytes]
            self.pages = data.view(self.layout.torch_dtype).view(self.num_pages, *self.layout.page_shape)
        else:   # None in another process than the creator's: the page table works, copies are refused
            self.pages = pages if pages is not None else device_pages.lookup(self.name, self.generation)
        self._pin_box: list = [None]  # shared with the finalizer: the registered mapping, if any
        # Only the creating process unlinks (a forked child that exits normally must not).
        unlink_in = os.getpid() if segment.created else None
        registered = (self.name, self.generation) if segment.created and self.pages_device is not None else None
        self._finalizer = weakref.finalize(self, _finalize, segment, self._pin_box, unlink_in, registered)
        if pin is None:
            pin = pinning.cuda_usable()
        if pin:
            self.pin()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
               pin: bool | None = None, owner: str = "", pages_device: str | torch.device | None = None
               ) -> "ShmKVPool":
        """Create (replacing a segment of that name whose creator died) a pool of size_bytes // page_bytes pages;
        `owner`, the stack's id, is recorded in the segment (segment.py). `pages_device`: keep the pages in a
        tensor on that device (size_bytes of its memory) instead of the segment (see the module doc)."""
        if not isinstance(model_fingerprint, str) or not model_fingerprint:
            raise ValueError("model_fingerprint must be a non-empty string")
        num_pages = int(size_bytes) // layout.page_bytes
        if num_pages < 1:
            raise PoolError(f"KV pool size {size_bytes} B is smaller than one page ({layout.page_bytes} B)")
        device = _resolve_device(pages_device)
        meta = json.dumps({
            "layout": layout.to_dict(), "model_fingerprint": model_fingerprint,
            "generation": secrets.token_hex(8), "creator_pid": os.getpid(), "created_at": time.time(),
            **({"pages_device": str(device)} if device is not None else {}),
        }).encode()
        if len(meta) > _TABLE_OFF - _JSON_OFF:
            raise ValueError("model_fingerprint too long for the pool header")
        data_off = _data_offset(num_pages)
        take_name(name, "KV pool")
        seg = Segment.create(name, segment_bytes(layout, size_bytes, device_pages=device is not None), owner)
        try:
            mm = seg.mm
            mm[_JSON_OFF:_JSON_OFF + len(meta)] = meta
            slots_off = _TABLE_OFF + 32 * num_pages
            np.frombuffer(mm, dtype=np.int64, count=1, offset=slots_off)[0] = _nonce()
            np.frombuffer(mm, dtype=np.int64, count=1, offset=slots_off + 8 * NUM_SLOTS)[0] = os.getpid()
            hdr = np.frombuffer(mm, dtype=np.int64, count=_HEADER_WORDS, offset=0)
            hdr[_W_VERSION] = LAYOUT_VERSION
            hdr[_W_JSON_LEN] = len(meta)
            hdr[_W_DATA_OFF] = data_off
            hdr[_W_NUM_PAGES] = num_pages
            hdr[_W_NEXT_HANDLE] = 1
            hdr[_W_MAGIC] = MAGIC
            hdr[_W_STATE] = _STATE_READY  # last: attachers wait for it
            del hdr
            pages = None if device is None else _device_pages(layout, num_pages, device)
            pool = cls(seg, pin=pin, pages=pages)
            if pages is not None:
                device_pages.register(name, pool.generation, pages)
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        return pool

    @classmethod
    def attach(cls, name: str, *, expected_fingerprint: str | None = None, pin: bool | None = None,
               timeout_s: float = 5.0) -> "ShmKVPool":
        """Attach to an existing pool (waits up to timeout_s for a pool being created)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                seg = Segment.attach(name)
                try:
                    pool = cls(seg, pin=pin)
                except BaseException:
                    seg.close()
                    raise
                break
            except PoolError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        if expected_fingerprint is not None and pool.fingerprint != expected_fingerprint:
            fp = pool.fingerprint
            pool.close()
            raise PoolError(f"KV pool {name!r} was created for model {fp!r}, this engine runs "
                            f"{expected_fingerprint!r}")
        return pool

    @property
    def is_creator(self) -> bool:
        return self._seg.created

    @property
    def closed(self) -> bool:
        return self._seg.mm is None

    def is_stale(self) -> bool:
        """True when the name now refers to another segment (producer restarted) or to none."""
        return not self._seg.is_current()

    def close(self) -> None:
        """Unmap. The creator also unlinks (a consumer never does)."""
        self._drop_views()
        self._finalizer()

    def unlink(self) -> None:
        """Remove the segment's name now (only if it is still ours); the mapping stays usable until close()."""
        self._seg.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _drop_views(self) -> None:
        self._hdr = self._owner = self._deadline = None
        self._claim_slot = self._claim_nonce = self._slot_nonce = self._slot_pid = None
        self._bytes = self.pages = None

    # ------------------------------------------------------------------ CUDA
    def pin(self) -> None:
        """Register the whole mapping as pinned, mapped memory in this process (idempotent; nothing to do for a
        pool whose pages are on a device)."""
        if self.pages_device is not None:
            return
        if self._pin_box[0] is None and pinning.register(self._bytes):
            self._pin_box[0] = self._bytes

    @property
    def pinned(self) -> bool:
        return self._pin_box[0] is not None

    def require_pages(self) -> None:
        """HandleError `device_pages_elsewhere` unless this process can address the pages (always, unless they
        are a device pool's and its creator is another process)."""
        if self.pages is None and not self.closed:
            raise HandleError(
                f"KV pool {self.name!r} keeps its pages on {self.pages_device} of process {self.creator_pid} (KV "
                f"transport 'device'); this process ({os.getpid()}) cannot read or write them: the device "
                "transport needs both engines in one process (fused colocate), else use --kv-transport shm",
                "device_pages_elsewhere")

    # ------------------------------------------------------------------ allocator
    @contextlib.contextmanager
    def _locked(self):
        if self.closed:
            raise PoolError(f"KV pool {self.name!r} is closed")
        with self._tlock:
            fcntl.flock(self._seg.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._seg.fd, fcntl.LOCK_UN)

    def allocate(self, num_tokens: int, lease_s: float, *, branch: str = "cond", t_offset: int = 0) -> KVHandle:
        """Reserve pages for num_tokens tokens until now + lease_s. Never blocks: raises PoolFull."""
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        need = self.layout.pages_for(num_tokens)
        with self._locked():
            now = time.time()
            expired = self._expired(now)
            n_expired = int(expired.sum())
            if n_expired:  # reclaim pages of consumers/producers that died or forgot to release
                self._owner[expired] = 0
                self._claim_nonce[expired] = 0
                self._hdr[_W_PAGES_RECLAIMED] += n_expired
            free = np.flatnonzero(self._owner == 0)
            if len(free) < need:
                self._hdr[_W_ALLOC_FULL] += 1
                why = ("the request is larger than the whole pool" if need > self.num_pages
                       else "pages are in use; retry later")
                raise PoolFull(
                    f"KV pool {self.name!r} full: need {need} pages of {self.layout.page_tokens} tokens for "
                    f"{num_tokens} tokens, {len(free)} of {self.num_pages} free ({why})",
                    pages_needed=need, pages_free=len(free), pages_total=self.num_pages)
            pids = free[:need]
            handle_id = int(self._hdr[_W_NEXT_HANDLE])
            self._hdr[_W_NEXT_HANDLE] = handle_id + 1
            deadline = now + float(lease_s)
            self._owner[pids] = handle_id
            self._deadline[pids] = deadline
            self._claim_nonce[pids] = 0
            self._hdr[_W_ALLOCS] += 1
        return KVHandle(
            handle_id=handle_id, pool_name=self.name, pool_generation=self.generation,
            page_ids=tuple(int(p) for p in pids), num_tokens=num_tokens, t_offset=int(t_offset),
            model_fingerprint=self.fingerprint, layout_version=LAYOUT_VERSION, layout=self.layout.to_dict(),
            branch=branch, lease_deadline=deadline)

    def release(self, handle: KVHandle) -> int:
        """Free the handle's pages that it still owns. Idempotent; handles of other generations are ignored.
        Returns the number of pages freed."""
        if handle.pool_name != self.name or handle.pool_generation != self.generation:
            return 0  # its pages died with the pool it came from
        pids = self._valid_page_ids(handle)
        if not len(pids):
            return 0
        with self._locked():
            mine = pids[self._owner[pids] == handle.handle_id]
            self._owner[mine] = 0
            self._claim_nonce[mine] = 0
            self._hdr[_W_PAGES_RELEASED] += len(mine)
        return len(mine)

    def extend_lease(self, handle: KVHandle, seconds: float) -> KVHandle:
        """Hold the pages until at least now + seconds (a later deadline is kept: never shortens).
        HandleError if the pages are no longer the handle's."""
        self._check_static(handle, None)
        pids = np.asarray(handle.page_ids, dtype=np.int64)
        with self._locked():
            self._check_owned(handle, pids, time.time())
            self._deadline[pids] = np.maximum(self._deadline[pids], time.time() + float(seconds))
            deadline = float(self._deadline[pids].min())
        return handle.replace(lease_deadline=deadline)

    def claim(self, handle: KVHandle) -> KVHandle:
        """Take the handle's pages over for as long as this process lives (and keeps this pool open): they
        are no longer reclaimed at the lease deadline but when this process dies or closes the pool;
        release() frees them as usual. HandleError if the pages are no longer the handle's."""
        self._check_static(handle, None)
        pids = np.asarray(handle.page_ids, dtype=np.int64)
        with self._locked():
            self._check_owned(handle, pids, time.time())
            slot = self._take_slot()
            self._claim_slot[pids] = slot
            self._claim_nonce[pids] = int(self._slot_nonce[slot])
        return handle

    def _take_slot(self) -> int:
        """Our liveness slot (caller holds the page-table lock): a free slot's lock plus a fresh nonce."""
        if self._slot is None:
            for slot in range(1, NUM_SLOTS):
                if locks.try_hold(self._seg.fd, slot):
                    self._slot_nonce[slot] = _nonce()
                    self._slot_pid[slot] = os.getpid()
                    self._slot = slot
                    break
            else:
                raise PoolError(f"KV pool {self.name!r}: all {NUM_SLOTS} claimer slots are taken")
        return self._slot

    def _slot_alive(self, slot: int, nonce: int) -> bool:
        if not 0 <= slot < NUM_SLOTS or int(self._slot_nonce[slot]) != nonce:
            return False
        return slot == self._slot or locks.held_by_other(self._seg.fd, slot)

    def _expired(self, now: float, pids: np.ndarray | None = None) -> np.ndarray:
        """Mask of held pages (of `pids`, or all) that may be reclaimed: unclaimed past their lease, or
        claimed by a process that is gone."""
        sel = slice(None) if pids is None else pids
        owner, nonce, slot = self._owner[sel], self._claim_nonce[sel], self._claim_slot[sel]
        held, claimed = owner != 0, nonce != 0
        expired = held & ~claimed & (self._deadline[sel] < now)
        for s, n in {(int(a), int(b)) for a, b in zip(slot[held & claimed], nonce[held & claimed])}:
            if not self._slot_alive(s, n):
                expired |= held & (slot == s) & (nonce == n)
        return expired

    def validate(self, handle: KVHandle, expected_fingerprint: str | None = None) -> None:
        """Raise HandleError unless the handle's pages are live in this pool with the expected model/layout
        (and readable here: require_pages)."""
        self._check_static(handle, expected_fingerprint)
        self.require_pages()
        pids = np.asarray(handle.page_ids, dtype=np.int64)
        with self._locked():
            self._check_owned(handle, pids, time.time())

    def guard_copy(self, handle: KVHandle, guard_s: float, expected_fingerprint: str | None):
        """validate() and, atomically, hold the lease for at least guard_s more seconds so a concurrent
        allocation cannot reclaim the pages mid-copy. Returns a token for end_copy()."""
        self._check_static(handle, expected_fingerprint)
        self.require_pages()
        pids = np.asarray(handle.page_ids, dtype=np.int64)
        with self._locked():
            now = time.time()
            self._check_owned(handle, pids, now)
            original = self._deadline[pids].copy()
            guard = now + guard_s
            self._deadline[pids] = np.maximum(original, guard)
        return original, guard

    def end_copy(self, handle: KVHandle, token) -> None:
        """Give back the copy guard (the lease returns to what it was) and check the pages are still the
        handle's: a release during the copy means the data may be torn -> HandleError."""
        original, guard = token
        pids = np.asarray(handle.page_ids, dtype=np.int64)
        with self._locked():
            if not np.all(self._owner[pids] == handle.handle_id):
                raise HandleError(f"KV handle {handle.handle_id} ({handle.branch}) was released during the copy",
                                  "pages_freed")
            untouched = self._deadline[pids] == guard
            restore = np.where(untouched & (original < guard), original, self._deadline[pids])
            self._deadline[pids] = restore

    def _check_static(self, handle: KVHandle, expected_fingerprint: str | None) -> None:
        if not isinstance(handle, KVHandle):
            raise HandleError(f"expected a KVHandle, got {type(handle).__name__}", "malformed_handle")
        check_static(handle, pool_name=self.name, generation=self.generation, fingerprint=self.fingerprint,
                     layout=self.layout, num_pages=self.num_pages, expected_fingerprint=expected_fingerprint)

    def _check_owned(self, handle: KVHandle, pids: np.ndarray, now: float) -> None:
        check_pages(handle, self._owner[pids], self._deadline[pids], self._claim_nonce[pids],
                    self._expired(now, pids), now)

    def memory_map(self) -> dict:
        """What a network transport registers and hands out: the whole mapping (base, size), the page
        table and the pages (addresses in this process), and the page count. Host pages only."""
        if self.pages_device is not None:
            raise PoolError(f"KV pool {self.name!r} keeps its pages on {self.pages_device}: no network transport")
        base = self._bytes.data_ptr()
        return {"base_addr": base, "size": self._seg.size, "table_addr": base + _TABLE_OFF,
                "pages_addr": self.pages.data_ptr(), "num_pages": self.num_pages}

    def _valid_page_ids(self, handle: KVHandle) -> np.ndarray:
        pids = np.asarray([p for p in handle.page_ids if 0 <= p < self.num_pages], dtype=np.int64)
        return pids

    # ------------------------------------------------------------------ metrics
    def add_bytes_moved(self, kind: str, nbytes: int, seconds: float) -> None:
        self.metrics.observe(kind, nbytes, seconds)
        word = _W_BYTES_EXPORTED if kind == "export" else _W_BYTES_IMPORTED
        with self._locked():
            self._hdr[word] += int(nbytes)

    def stats(self) -> dict:
        """Pool-wide page and byte counters (shared by all processes) plus this process's copy metrics."""
        with self._locked():
            now = time.time()
            held = self._owner != 0
            expired = self._expired(now)
            claimed = int((held & ~expired & (self._claim_nonce != 0)).sum())
            hdr = [int(x) for x in self._hdr]
            handles_live = len(np.unique(self._owner[held & ~expired]))
        used = int(held.sum()) - int(expired.sum())
        return {
            "pool_name": self.name, "generation": self.generation, "model_fingerprint": self.fingerprint,
            "layout": self.layout.to_dict(), "page_bytes": self.layout.page_bytes,
            "pages_total": self.num_pages, "pages_used": used, "pages_expired": int(expired.sum()),
            "pages_free": self.num_pages - used - int(expired.sum()), "handles_live": handles_live,
            "pages_claimed": claimed,
            "bytes_total": self.num_pages * self.layout.page_bytes, "bytes_used": used * self.layout.page_bytes,
            "allocations": hdr[_W_ALLOCS], "allocation_failures": hdr[_W_ALLOC_FULL],
            "pages_released": hdr[_W_PAGES_RELEASED], "pages_reclaimed": hdr[_W_PAGES_RECLAIMED],
            "bytes_exported_total": hdr[_W_BYTES_EXPORTED], "bytes_imported_total": hdr[_W_BYTES_IMPORTED],
            "pinned": self.pinned, "pages_on": self.pages_device or "shm", "process": self.metrics.snapshot(),
        }


TABLE_BYTES_PER_PAGE = 32


def page_table(raw: np.ndarray, num_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, deadline, claim nonce) columns of a copy of a pool's page table (32 bytes per page)."""
    owner = raw[:8 * num_pages].view(np.int64)
    deadline = raw[8 * num_pages:16 * num_pages].view(np.float64)
    nonce = raw[24 * num_pages:32 * num_pages].view(np.int64)
    return owner, deadline, nonce


def check_pages(handle: KVHandle, owner: np.ndarray, deadline: np.ndarray, nonce: np.ndarray,
                expired: np.ndarray, now: float) -> None:
    """HandleError unless every page (columns selected by the handle's page ids) is still the handle's
    and not reclaimable (`expired`)."""
    if not np.all(owner == handle.handle_id):
        raise HandleError(f"KV handle {handle.handle_id} ({handle.branch}): its pages were released or "
                          "reclaimed after its lease expired", "pages_freed")
    if np.any(expired):
        why = ("the process that claimed it died" if np.any(nonce[expired] != 0) else
               f"lease expired {now - float(deadline.min()):.3f} s ago")
        raise HandleError(f"KV handle {handle.handle_id} ({handle.branch}): {why}", "lease_expired")


def _nonce() -> int:
    return secrets.randbits(62) + 1


def _resolve_device(device: str | torch.device | None) -> torch.device | None:
    """A device pool's device with its index ("cuda" -> the current CUDA device), so the name says which."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _device_pages(layout: KVLayout, num_pages: int, device: torch.device) -> torch.Tensor:
    try:
        return torch.empty((num_pages, *layout.page_shape), dtype=layout.torch_dtype, device=device)
    except (RuntimeError, MemoryError) as e:    # torch.OutOfMemoryError is a RuntimeError
        raise PoolError(f"KV pool needs {num_pages * layout.page_bytes / 2**30:.2f} GiB of {device} memory for its "
                        f"pages and could not get it ({type(e).__name__}: {str(e)[:200]}): lower --kv-pool-gb") from None


def _finalize(seg: Segment, pin_box: list, unlink_in: int | None, registered: tuple[str, str] | None) -> None:
    """Runs once: at close(), garbage collection or interpreter exit. Only the creator unlinks (and forgets its
    device pages)."""
    if registered is not None:
        device_pages.unregister(*registered)
    mapping, pin_box[0] = pin_box[0], None  # drop the reference before unmapping
    if mapping is not None:
        with contextlib.suppress(Exception):
            pinning.unregister(mapping)
        del mapping
    if unlink_in == os.getpid():
        seg.unlink()
    seg.close()
