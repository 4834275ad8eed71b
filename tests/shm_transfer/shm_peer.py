"""A second real process for the shm_transfer tests: a small command server over a multiprocessing Pipe.

The parent sends (function name, args); the peer runs that function of this module with its own state
(attached pools by name) and sends back ("ok", result) or ("err", class name, message, code).

ThreadPeer is the same commands on a thread of the test process, with state of its own: the other engine of a
fused process, for pools whose pages are on the device (only their creator's process can address them). Its kill()
is that engine's death as the pool sees it: its pools are dropped unreleased, their locks (liveness) with them.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback

import torch

from shm_transfer import (HandleError, KVHandle, KVLayout, PoolFull, ShmKVPool, import_kv, read_kv,
                          write_kv)
from shm_transfer import device_pages
from shm_transfer.transport import DeviceTransport, LocalShmTransport

_CTX = mp.get_context("spawn")


def wire(handle: KVHandle) -> dict:
    """A handle as it crosses HTTP between the engines (through JSON)."""
    return json.loads(json.dumps(handle.to_dict()))
_state = threading.local()     # per serving thread: a process peer's main thread, or one ThreadPeer's thread


def _pools() -> dict:
    """This peer's pools (and transports) by name."""
    if not hasattr(_state, "pools"):
        _state.pools = {}
    return _state.pools


def make_pool(pages: str, name: str, layout: KVLayout, size_bytes: int, fingerprint: str) -> ShmKVPool:
    """A producer's pool with its pages in shared memory (pages="shm") or in a CPU tensor of this process standing
    for the device (pages="device": the device transport's code path, device = cpu)."""
    return ShmKVPool.create(name, layout, size_bytes, fingerprint,
                            pages_device="cpu" if pages == "device" else None)


# ---------------------------------------------------------------- commands (run inside the peer)
def attach(name, expected_fingerprint=None, transport=False, timeout_s=5.0):
    """transport: False (the pool), True (a LocalShmTransport) or "device" (a DeviceTransport)."""
    cls = DeviceTransport if transport == "device" else LocalShmTransport if transport else ShmKVPool
    _pools()[name] = cls.attach(name, expected_fingerprint=expected_fingerprint, timeout_s=timeout_s)
    return os.getpid()


def create(name, layout, size_bytes, fingerprint, pages="shm"):
    _pools()[name] = make_pool(pages, name, KVLayout.from_dict(layout), size_bytes, fingerprint)
    return _pools()[name].generation


def close(name):
    _pools().pop(name).close()


def import_and_release(name, handle_dicts, cap_extra=3, expected_fingerprint=None):
    """The generation side's job: import each handle into a buffer with room for image tokens, release."""
    pool = _pools()[name]
    out = []
    for d in handle_dicts:
        h = KVHandle.from_dict(d)
        lay = pool.layout
        dst = torch.full(lay.kv_shape(h.num_tokens + cap_extra), float("nan"), dtype=lay.torch_dtype)
        import_kv(pool, h, dst, expected_fingerprint=expected_fingerprint)
        out.append(dst)
        assert pool.release(h) == len(h.page_ids)
    return out


def import_via_transport(name, handle_dict):
    t = _pools()[name]
    h = KVHandle.from_dict(handle_dict)
    kv = t.read_kv(h)
    t.release(h)
    return kv, t.pool.generation


def read(name, handle_dict, expected_fingerprint=None):
    return read_kv(_pools()[name], KVHandle.from_dict(handle_dict), expected_fingerprint=expected_fingerprint)


def allocate(name, num_tokens, lease_s):
    return _pools()[name].allocate(num_tokens, lease_s).to_dict()


def allocate_until_full(name, num_tokens, lease_s):
    got = []
    try:
        while True:
            got.append(_pools()[name].allocate(num_tokens, lease_s).to_dict())
    except PoolFull:
        return got


def write(name, handle_dict, kv, heads=None):
    write_kv(_pools()[name], KVHandle.from_dict(handle_dict), kv, heads=heads)


def release(name, handle_dict):
    return _pools()[name].release(KVHandle.from_dict(handle_dict))


def extend_lease(name, handle_dict, seconds):
    return _pools()[name].extend_lease(KVHandle.from_dict(handle_dict), seconds).to_dict()


def claim(name, handle_dict):
    return _pools()[name].claim(KVHandle.from_dict(handle_dict)).to_dict()


def stats(name):
    return _pools()[name].stats()


def validate(name, handle_dict, expected_fingerprint=None):
    _pools()[name].validate(KVHandle.from_dict(handle_dict), expected_fingerprint)


def exporter(name, expected_fingerprint=None):
    """An understanding engine rank attaching its service's pool (shm_transfer.producer.attach_exporter)."""
    from shm_transfer.producer import attach_exporter
    _pools()[name] = attach_exporter(name, expected_fingerprint)
    return os.getpid()


def source_import(pool_name, handle_dict, fingerprint=None):
    """generation's PrefixSource importing a handle: (bytes, None) or (None, (status, code)) of its APIError."""
    from services.generation.kv_source import PrefixSource
    from services.kit.errors import APIError
    src = PrefixSource(pool_name, fingerprint or "", torch.device("cpu"), attach_timeout_s=0.5)
    try:
        h = src.parse(handle_dict)
        lay = h.kv_layout
        return src.import_into(h, torch.empty(lay.kv_shape(h.num_tokens), dtype=lay.torch_dtype))[0], None
    except APIError as e:
        return None, (e.status, e.code, e.message)
    finally:
        src.close()


def abandon_all():
    """Drop every pool of this peer as a killed process would: no release, no unlink; the segment's fds (and with
    them the liveness locks) close; a creator's device pages go."""
    for t in _pools().values():
        pools = [t] if isinstance(t, ShmKVPool) else [t.pool, *getattr(t, "_others", {}).values()]
        for pool in pools:
            pool._finalizer.detach()
            if pool.is_creator and pool.pages_device is not None:
                device_pages.unregister(pool.name, pool.generation)
            pool._seg.close()
    _pools().clear()


def net_connect(expected_fingerprint=None, **kw):
    from shm_transfer.nixl_transport import NixlTransport
    _pools()["net"] = NixlTransport.connect(expected_fingerprint=expected_fingerprint, **kw)
    return os.getpid()


def net_import(handle_dict, release=True, cap_extra=2, heads=None):
    """The generation side over the network: import into a buffer with room for image tokens, release."""
    t, h = _pools()["net"], KVHandle.from_dict(handle_dict)
    lay = h.kv_layout
    nh = lay.num_kv_heads if heads is None else heads[1] - heads[0]
    dst = torch.full((lay.num_layers, 2, h.num_tokens + cap_extra, nh, lay.head_dim), float("nan"),
                     dtype=lay.torch_dtype)
    t.import_kv(h, dst, heads=heads)
    if release:
        t.release(h)
    return dst


def net(method, handle_dict, *args):
    """claim / release / extend_lease / validate through the consumer's network transport."""
    out = getattr(_pools()["net"], method)(KVHandle.from_dict(handle_dict), *args)
    return out.to_dict() if isinstance(out, KVHandle) else out


# ---------------------------------------------------------------- plumbing
def _serve(conn):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        conn.send(_run(msg))


def _run(msg) -> tuple:
    """("ok", result) of one (function name, args, kwargs) command, or ("err", class, message, code, traceback)."""
    fn, args, kwargs = msg
    try:
        return "ok", globals()[fn](*args, **kwargs)
    except BaseException as e:  # report everything to the test
        return "err", type(e).__name__, str(e), getattr(e, "code", None), traceback.format_exc()


class PeerError(Exception):
    def __init__(self, cls_name, message, code, tb):
        super().__init__(f"{cls_name}: {message}\n{tb}")
        self.cls_name, self.message, self.code = cls_name, message, code


class Peer:
    """A spawned process running _serve; call(fn, ...) runs fn there."""

    def __init__(self):
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self):
        return self.proc.pid

    def call(self, fn, *args, timeout=30, **kwargs):
        self._conn.send((fn, args, kwargs))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {fn} within {timeout}s")
        reply = self._conn.recv()
        if reply[0] == "err":
            raise PeerError(*reply[1:])
        return reply[1]

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self):
        if self.proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
        self._conn.close()




class ThreadPeer:
    """The commands on a thread of this process (Peer's interface): the other engine of a fused process."""

    def __init__(self):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="shm-thread-peer", daemon=True)
        self._thread.start()

    pid = property(lambda self: os.getpid())

    def _serve(self):
        while True:
            msg, reply = self._inbox.get()
            if msg is None:
                reply.put(("ok", None))
                return
            reply.put(_run(msg))

    def call(self, fn, *args, timeout=30, **kwargs):
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(((fn, args, kwargs), reply))
        try:
            out = reply.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"thread peer did not answer {fn} within {timeout}s") from None
        if out[0] == "err":
            raise PeerError(*out[1:])
        return out[1]

    def kill(self):
        """As SIGKILL does to a process peer: its pools dropped unreleased (abandon_all), its thread ended."""
        if self._thread.is_alive():
            self.call("abandon_all")
            self.stop()

    def stop(self):
        if self._thread.is_alive():
            self.call("close_all")
            self._inbox.put((None, queue.SimpleQueue()))
            self._thread.join(10)


def close_all():
    """A clean exit: every pool closed (a creator's close unlinks, as at a process peer's interpreter exit)."""
    for t in _pools().values():
        t.close()
    _pools().clear()


def new_peer(pages: str):
    """The consumer (or other producer) for pages of that kind: a process, or a thread of this one (device)."""
    return ThreadPeer() if pages == "device" else Peer()


__all__ = ["Peer", "ThreadPeer", "PeerError", "HandleError", "make_pool", "new_peer"]
