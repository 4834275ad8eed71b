"""NixlTransport: prefix KV across hosts with NIXL (UCX underneath: RDMA where the hosts have it, TCP
otherwise, CUDA-aware), one-sided reads from the producer's own pool.

Producer (understanding): the same shm pool as LocalShmTransport (its TP ranks export into it as before);
the whole segment is registered with a NIXL agent whose metadata listener answers consumers. Handles carry
`transport: "nixl"` and `producer` = {agent, host, port, table_addr, pages_addr, num_pages, page_bytes}. A thread
applies the consumers' release / lease messages, which arrive as NIXL notifications.

Consumer (generation): a NIXL agent of its own; import = fetch the producer's metadata once (NIXL's
listener), READ the handle's page-table rows (ownership + lease), READ the pages into a registered staging
buffer on the destination's device (pinned host or GPU), READ the rows again (a release during the copy
means torn data: HandleError pages_freed, as with shm), then the usual import kernel from staging into
dst. Handle ids are never reused, so "still owned after the read" proves the bytes were not reclaimed.
release / extend_lease are notifications; claim() renews a short lease from a heartbeat thread for as
long as this process lives, so a killed consumer's claims stop being renewed within `claim_lease_s` (a remote
claimer's liveness cannot be tested through a lock as on one host); a lease is never shortened, so its pages then
wait for the gateway's release or the handle's own lease.

Same host: when the consumer shares the producer's /dev/shm (same host, or the same pod) it maps the
handle's pool and moves the bytes through shared memory like LocalShmTransport (full speed, lock-based
claims) instead of the network: the transport is chosen per pair by whether the pool can be seen here. The
environment variable U1SERVE_KV_SAME_HOST_SHM=0 (or same_host_shm=False) always uses the network.

The agent's name carries the pool generation, so a restarted producer never answers an old handle
(HandleError producer_unreachable). Notes: NIXL's metadata listener binds every interface of the
producer; set `advertise_host` to the address consumers reach it by.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

import numpy as np
import torch

from . import copy as kvcopy
from services.base.knobs import KV_SAME_HOST_SHM

from .errors import HandleError, PoolError
from .handle import KVHandle, check_static
from .layout import KVLayout
from .metrics import CopyMetrics
from .pool import TABLE_BYTES_PER_PAGE, check_pages, page_table
from .transport import LocalShmTransport, Transport

log = logging.getLogger(__name__)

# UCX's TCP transport moves 8 KiB segments by default (~0.35 GB/s on loopback here); 512 KiB gives ~1.8.
_UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
_PRODUCER_FIELDS = ("agent", "host", "port", "table_addr", "pages_addr", "num_pages", "page_bytes")


def nixl_available() -> bool:
    try:
        _nixl()
        return True
    except PoolError:
        return False


def _nixl():
    for k, v in _UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise PoolError(f"the network KV transport needs NIXL (pip install 'u1serve[network]'): {e}") from e
    return nixl_agent, nixl_agent_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _agent(name: str, port: int, progress_thread: bool = True):
    nixl_agent, nixl_agent_config = _nixl()
    conf = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=True,
                             listen_port=port or _free_port(), backends=["UCX"])
    return nixl_agent(name, conf)


class _Done:
    """A finished (synchronous) network import, shaped like copy.CopyDone."""

    def __init__(self, kind: str, nbytes: int, seconds: float):
        self.kind, self.nbytes, self.seconds = kind, nbytes, seconds

    def wait(self) -> "_Done":
        return self

    def query(self) -> bool:
        return True

    def wait_stream(self, stream=None) -> None:
        pass


class NixlTransport(Transport):
    kind = "nixl"

    def __init__(self, agent, *, local: LocalShmTransport | None = None, producer: dict | None = None,
                 expected_fingerprint: str | None = None, claim_lease_s: float = 5.0, heartbeat_s: float = 1.0,
                 connect_timeout_s: float = 5.0, poll_s: float = 0.01, same_host_shm: bool | None = None):
        self._agent = agent
        self._local = local
        self._producer = producer or {}
        self._expected = expected_fingerprint
        self.claim_lease_s, self.heartbeat_s = claim_lease_s, heartbeat_s
        self.connect_timeout_s, self._poll_s = connect_timeout_s, poll_s
        self._lock = threading.RLock()      # the agent's transfers and our buffers
        self._peers: set[str] = set()       # producers whose metadata is loaded
        self._tables: dict[str, tuple] = {}  # producer agent -> (cpu buffer, registration) for table reads
        self._staging: dict[str, tuple] = {}  # device -> (uint8 buffer, registration) for page reads
        self._claims: dict[tuple[str, int], KVHandle] = {}
        self._pool_reg = None                # the producer's registered segment
        self.same_host_shm = KV_SAME_HOST_SHM.get() if same_host_shm is None else same_host_shm
        self._near: dict[tuple[str, str], LocalShmTransport | None] = {}  # (pool, generation) -> shm, if here
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.metrics = CopyMetrics()
        if local is not None:
            self._start(self._serve_notifications, "u1kv-nixl-notifs")

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
               pin: bool | None = None, listen_port: int = 0, advertise_host: str = "127.0.0.1",
               owner: str = "", **kw) -> "NixlTransport":
        """Producer: create the shm pool `name`, register it with a NIXL agent listening on listen_port
        (0: any free port) and hand out handles that consumers reach at advertise_host."""
        local = LocalShmTransport.create(name, layout, size_bytes, model_fingerprint, pin=pin, owner=owner)
        try:
            port = listen_port or _free_port()
            agent_name = f"u1kv-{name}-{local.pool.generation}"
            agent = _agent(agent_name, port)
            mm = local.pool.memory_map()
            reg = agent.register_memory([(mm["base_addr"], mm["size"], 0, "")], "DRAM")
        except BaseException:
            local.close()
            raise
        producer = {"agent": agent_name, "host": advertise_host, "port": port, "table_addr": mm["table_addr"],
                    "pages_addr": mm["pages_addr"], "num_pages": mm["num_pages"], "page_bytes": layout.page_bytes}
        t = cls(agent, local=local, producer=producer, expected_fingerprint=model_fingerprint, **kw)
        t._pool_reg = reg
        return t

    @classmethod
    def connect(cls, *, expected_fingerprint: str | None = None, listen_port: int = 0, **kw) -> "NixlTransport":
        """Consumer: an agent of our own (NIXL answers metadata requests through its listener)."""
        # No UCX progress thread here: it spins (a fifth of a core per idle agent, measured), and a consumer
        # needs progress only while it reads (its reads poll to completion) and to flush the messages it sends
        # (the flush thread below).
        agent = _agent(f"u1kv-consumer-{os.getpid()}-{uuid.uuid4().hex[:8]}", listen_port, progress_thread=False)
        t = cls(agent, expected_fingerprint=expected_fingerprint, **kw)
        t._start(t._flush_messages, "u1kv-nixl-flush")
        return t

    @property
    def pool(self):
        """The producer's shm pool (None on a consumer)."""
        return self._local.pool if self._local is not None else None

    @property
    def layout(self) -> KVLayout:
        return self._local.layout

    @property
    def num_pages(self) -> int:
        return self._local.num_pages

    def _mine(self, handle: KVHandle) -> bool:
        return self._local is not None and handle.producer.get("agent") == self._producer.get("agent")

    def _shm_for(self, handle: KVHandle) -> LocalShmTransport | None:
        """The shm transport that moves this handle when its pool is mapped here: the producer's own pool, or
        (consumer) the pool of a producer that shares our /dev/shm. None: over the network."""
        if self._mine(handle):
            return self._local
        if not self.same_host_shm or self._local is not None or not isinstance(handle, KVHandle):
            return None
        key = (handle.pool_name, handle.pool_generation)
        with self._lock:
            self._drop_replaced()
            if key not in self._near:
                # absent now means absent for good: a handle's pool exists before its handle is issued
                self._near[key] = self._attach_near(handle)
            return self._near[key]

    def _attach_near(self, handle: KVHandle) -> LocalShmTransport | None:
        try:
            t = LocalShmTransport.attach(handle.pool_name, expected_fingerprint=self._expected, timeout_s=0)
        except (PoolError, ValueError, OSError):
            return None
        if t.pool.generation != handle.pool_generation:   # a namesake on this host, or a restarted producer
            t.close()
            return None
        log.info("KV pool %s is on this host: its handles move through shared memory", handle.pool_name)
        return t

    def _drop_replaced(self) -> None:
        """Unmap near pools whose producer restarted or went away (one stat each; caller holds the lock)."""
        for key, t in list(self._near.items()):
            if t is not None and (t.pool.closed or t.pool.is_stale()):
                t.close()
                self._near[key] = None

    # ------------------------------------------------------------------ producer
    def allocate(self, num_tokens, lease_s, *, branch="cond", t_offset=0, near=None):
        if self._local is None or near is not None:
            raise PoolError("a NIXL transport allocates only in its own producer pool")
        h = self._local.allocate(num_tokens, lease_s, branch=branch, t_offset=t_offset)
        return h.replace(transport=self.kind, producer=dict(self._producer))

    def export_kv(self, handle, kv_pool, slots, stream=None, *, heads=None):
        return self._local.export_kv(handle, kv_pool, slots, stream, heads=heads)

    def write_kv(self, handle, kv, stream=None, *, heads=None):
        return self._local.write_kv(handle, kv, stream, heads=heads)

    def _serve_notifications(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:  # pragma: no cover - agent going away
                log.exception("reading NIXL notifications failed")
                continue
            for messages in notifs.values():
                for raw in messages:
                    self._apply(raw)

    def _apply(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            handle = KVHandle.from_dict(msg["handle"])
            if msg["op"] == "release":
                self._local.release(handle)
            elif msg["op"] == "lease":
                self._local.extend_lease(handle, float(msg["seconds"]))
        except HandleError:
            pass  # its pages are gone already
        except Exception:
            log.warning("ignoring a malformed KV notification %r", raw[:200])

    # ------------------------------------------------------------------ consumer
    def _check(self, handle: KVHandle) -> dict:
        if not isinstance(handle, KVHandle):
            raise HandleError(f"expected a KVHandle, got {type(handle).__name__}", "malformed_handle")
        prod = handle.producer
        if handle.transport != self.kind or any(k not in prod for k in _PRODUCER_FIELDS):
            raise HandleError(f"KV handle of transport {handle.transport!r} lacks the network producer fields "
                              f"{list(_PRODUCER_FIELDS)}", "malformed_handle")
        try:
            layout = handle.kv_layout
        except (ValueError, TypeError) as e:
            raise HandleError(f"KV handle layout is invalid: {e}", "malformed_handle") from None
        if layout.page_bytes != prod["page_bytes"]:
            raise HandleError(f"KV handle layout {handle.layout} does not match its producer's pages "
                              f"({prod['page_bytes']} B each)", "layout_mismatch")
        check_static(handle, pool_name=handle.pool_name, generation=handle.pool_generation,
                     fingerprint=handle.model_fingerprint, layout=layout, num_pages=int(prod["num_pages"]),
                     expected_fingerprint=self._expected)
        return prod

    def _peer(self, prod: dict) -> str:
        name = prod["agent"]
        if name in self._peers:
            return name
        self._agent.fetch_remote_metadata(name, prod["host"], int(prod["port"]))
        deadline = time.monotonic() + self.connect_timeout_s
        while not self._agent.check_remote_metadata(name):
            if time.monotonic() > deadline:
                raise HandleError(f"KV producer {name} at {prod['host']}:{prod['port']} does not answer "
                                  "(restarted, stopped or unreachable): its KV is not available",
                                  "producer_unreachable")
            time.sleep(0.005)
        self._peers.add(name)
        return name

    def _register(self, cache: dict, key, nbytes: int, device: torch.device) -> torch.Tensor:
        """A registered uint8 buffer of at least nbytes on device (grown by doubling, re-registered)."""
        have = cache.get(key)
        if have is not None and have[0].numel() >= nbytes:
            return have[0]
        if have is not None:
            self._agent.deregister_memory(have[1])
        size = max(nbytes, 2 * have[0].numel() if have is not None else nbytes)
        pin = device.type == "cpu" and torch.cuda.is_available()
        buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
        cache[key] = (buf, self._agent.register_memory(buf))
        return buf

    def _read(self, peer: str, remote: list[tuple[int, int]], local: torch.Tensor) -> None:
        """One-sided READ of the remote (address, length) runs, back to back, into `local`."""
        mem = "VRAM" if local.is_cuda else "DRAM"
        dev = (local.device.index or 0) if local.is_cuda else 0
        runs, off, base = [], 0, local.data_ptr()
        for _, n in remote:
            runs.append((base + off, n, dev))
            off += n
        xfer = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(runs, mem),
                                           self._agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM"),
                                           peer)
        try:
            state = self._agent.transfer(xfer)
            while state == "PROC":
                state = self._agent.check_xfer_state(xfer)
        finally:
            self._agent.release_xfer_handle(xfer)
        if state != "DONE":
            self._peers.discard(peer)
            raise HandleError(f"network read from KV producer {peer} failed ({state})", "producer_unreachable")

    def _rows(self, handle: KVHandle, prod: dict, peer: str):
        """The handle's page-table rows as the producer has them now: (owner, deadline, claim nonce)."""
        n = int(prod["num_pages"])
        buf = self._register(self._tables, peer, TABLE_BYTES_PER_PAGE * n, torch.device("cpu"))
        self._read(peer, [(int(prod["table_addr"]), TABLE_BYTES_PER_PAGE * n)], buf)
        owner, deadline, nonce = page_table(buf[:TABLE_BYTES_PER_PAGE * n].numpy(), n)
        pids = np.asarray(handle.page_ids, dtype=np.int64)
        return owner[pids].copy(), deadline[pids].copy(), nonce[pids].copy()

    def _check_rows(self, handle: KVHandle, rows, now: float) -> None:
        owner, deadline, nonce = rows
        # a remote claimer's liveness is its heartbeat: claimed pages count as live here
        check_pages(handle, owner, deadline, nonce, (nonce == 0) & (deadline < now), now)

    def import_kv(self, handle, dst, stream=None, *, heads=None):
        """Synchronous (a `stream` is ignored); returns a finished CopyDone-like object."""
        shm = self._shm_for(handle)
        if shm is not None:
            return shm.import_kv(handle, dst, stream, heads=heads)
        prod = self._check(handle)
        lay = handle.kv_layout
        h0, h1 = kvcopy.check_import_dst(lay, handle, dst, heads)
        n, pb = len(handle.page_ids), lay.page_bytes
        with self._lock:
            peer = self._peer(prod)
            t0 = time.perf_counter()
            self._check_rows(handle, self._rows(handle, prod, peer), time.time())
            staging = self._register(self._staging, str(dst.device), n * pb, dst.device)
            base = int(prod["pages_addr"])
            self._read(peer, [(base + p * pb, pb) for p in handle.page_ids], staging)
            owner = self._rows(handle, prod, peer)[0]
            if not np.all(owner == handle.handle_id):
                raise HandleError(f"KV handle {handle.handle_id} ({handle.branch}) was released during the "
                                  "copy", "pages_freed")
            pages = staging[:n * pb].view(lay.torch_dtype).view(n, *lay.page_shape)
            page_ids = torch.arange(n, dtype=torch.int32, device=dst.device)
            kvcopy.pages_into(kvcopy.heads_view(pages, lay, h0, h1), page_ids, handle.num_tokens, dst)
            if dst.is_cuda:
                torch.cuda.current_stream(dst.device).synchronize()
            seconds = time.perf_counter() - t0
        nbytes = kvcopy.import_bytes(lay, handle, h0, h1)
        self.metrics.observe("import", nbytes, seconds)
        return _Done("import", nbytes, seconds)

    def _notify(self, handle: KVHandle, op: str, **fields) -> bool:
        prod = self._check(handle)
        with self._lock:
            try:
                peer = self._peer(prod)
                self._agent.send_notif(peer, json.dumps({"op": op, "handle": handle.to_dict(), **fields}).encode())
                return True
            except HandleError:
                return False

    def release(self, handle):
        shm = self._shm_for(handle)
        if shm is not None:
            return shm.release(handle)
        self._claims.pop((handle.producer.get("agent"), handle.handle_id), None)
        return len(handle.page_ids) if self._notify(handle, "release") else 0

    def extend_lease(self, handle, seconds):
        shm = self._shm_for(handle)
        if shm is not None:
            return shm.extend_lease(handle, seconds)
        if not self._notify(handle, "lease", seconds=float(seconds)):
            raise HandleError(f"KV producer {handle.producer.get('agent')} does not answer", "producer_unreachable")
        return handle.replace(lease_deadline=max(handle.lease_deadline, time.time() + float(seconds)))

    def claim(self, handle):
        shm = self._shm_for(handle)
        if shm is not None:
            return shm.claim(handle)
        self.validate(handle)
        with self._lock:
            self._claims[(handle.producer["agent"], handle.handle_id)] = handle
            if not any(t.name == "u1kv-nixl-claims" for t in self._threads):
                self._start(self._renew_claims, "u1kv-nixl-claims")
        return self.extend_lease(handle, self.claim_lease_s)

    def _flush_messages(self) -> None:
        """Drive UCX's progress now and then, so release / lease messages leave although nothing else runs."""
        while not self._stop.wait(self._poll_s):
            with self._lock:
                if self._agent is None:
                    return
                try:
                    self._agent.get_new_notifs()
                except Exception:  # pragma: no cover - agent going away
                    pass

    def _renew_claims(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            for handle in list(self._claims.values()):
                self._notify(handle, "lease", seconds=self.claim_lease_s)

    def validate(self, handle):
        shm = self._shm_for(handle)
        if shm is not None:
            return shm.validate(handle)
        prod = self._check(handle)
        with self._lock:
            self._check_rows(handle, self._rows(handle, prod, self._peer(prod)), time.time())

    # ------------------------------------------------------------------ common
    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def is_stale(self) -> bool:
        """Never: the agent does not go stale, and near pools of a restarted producer are dropped here."""
        with self._lock:
            self._drop_replaced()
        return False

    def stats(self):
        out = self._local.stats() if self._local is not None else {}
        out.update(transport=self.kind, agent=self._producer.get("agent"),
                   listen=(f"{self._producer['host']}:{self._producer['port']}" if self._producer else None),
                   producers_known=len(self._peers),
                   claims=len(self._claims), near_pools=sum(t is not None for t in self._near.values()))
        if self._local is None:
            out["process"] = self.metrics.snapshot()
        return out

    def close(self):
        self._stop.set()
        for t in self._threads:
            t.join(5)
        with self._lock:
            if self._agent is None:
                return
            regs = [reg for _, reg in list(self._tables.values()) + list(self._staging.values())]
            for reg in regs + ([self._pool_reg] if self._pool_reg is not None else []):
                try:
                    self._agent.deregister_memory(reg)
                except Exception:
                    pass
            self._tables.clear()
            self._staging.clear()
            for t in self._near.values():
                if t is not None:
                    t.close()
            self._near.clear()
            self._agent = None  # the agent (its listener too) goes away before the pool is unmapped
        if self._local is not None:
            self._local.close()
