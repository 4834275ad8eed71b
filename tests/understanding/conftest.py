"""Understanding-service fixtures: real server processes on loopback over a tiny fp32 checkpoint.

Servers are module/package scoped and shared, so the whole directory runs in a few minutes on 2 cores; they stop
with the package (an idle server left up for the rest of the session only takes memory and CPU from later tests).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch
from services.base.netutil import free_port
from services.kit.proc import preexec_die_with_parent  # a killed test run leaves no server behind
from tests.waiting import stop_group, wait_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "und-test-token"
HEADERS = {"X-U1-Internal-Token": TOKEN}
IMG_MIN, IMG_MAX = 1024, 16384      # small input images -> few image tokens
MAX_LEN = 4096


PAGE_TOKENS = 16


def whole_pages(tokens: int) -> int:
    """`cached_tokens` as the server reports it: whole KV pages only."""
    return tokens - tokens % PAGE_TOKENS


class UndServer:
    def __init__(self, model_dir: str, *extra: str, pool_gb: float = 0.05, tp: int = 1, log_dir: str = "/tmp",
                 token_args: tuple[str, ...] = ("--internal-token", TOKEN), log_level: str = "warning"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool_name = f"u1und-test-{uuid.uuid4().hex[:10]}"
        argv = [sys.executable, "-m", "services.understanding.server", "--model", model_dir,
                "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
                "--tp", str(tp), "--kv-pool-name", self.pool_name, "--kv-pool-gb", str(pool_gb),
                "--kv-page-tokens", str(PAGE_TOKENS), "--kv-cache-tokens", "16384", "--max-model-len", str(MAX_LEN),
                *token_args, "--image-min-pixels", str(IMG_MIN),
                "--image-max-pixels", str(IMG_MAX), "--log-level", log_level, *extra]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log_path = os.path.join(log_dir, f"und-server-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=preexec_die_with_parent)

    def wait_ready(self, timeout: float = 180.0) -> "UndServer":
        wait_ok(self.url + "/health", self.proc, lambda: open(self.log_path).read()[-3000:], timeout,
                "understanding server", interval=0.5)
        return self

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Wait until no request holds KV (cache-only slots are fine) and the shm pool is empty."""
        deadline = time.monotonic() + timeout
        h = {}
        while time.monotonic() < deadline:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0 and h["kv_in_use"] == 0 and h["inflight"] == 0
                    and h.get("shm_pages_used", 0) == 0):
                return h
            time.sleep(0.2)
        raise AssertionError(f"server did not drain: {h}")

    def stop(self) -> None:
        stop_group(self.proc, 30)
        self.log.close()


@pytest.fixture(scope="session")
def ref(tiny_dir):
    """(model, tokenizer) of the fp32 reference pipeline."""
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    torch.manual_seed(0)
    return load_model(tiny_dir, "und", dtype=torch.float32), NeoTokenizer.from_dir(tiny_dir)


PAGES_WAIT_S = 4.0     # the pool-full test releases the pages at 0.6 s: a margin for a loaded host


def _start(tiny_dir, tmp_path_factory, *extra, **kw):
    return UndServer(tiny_dir, *extra, log_dir=str(tmp_path_factory.mktemp("und-logs")), **kw)


@pytest.fixture(scope="package")
def server(tiny_dir, tmp_path_factory):
    """Main server: chunked prefill (64 tokens), prefix cache on."""
    s = _start(tiny_dir, tmp_path_factory, "--chunked-prefill-size", "64").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="package")
def server_plain(tiny_dir, tmp_path_factory):
    """No chunking, no prefix cache, and a small shm pool (for the pool-full case: a request waits up to
    PAGES_WAIT_S for pages)."""
    s = _start(tiny_dir, tmp_path_factory, "--chunked-prefill-size", "0", "--no-prefix-cache",
               "--max-prefix-pool-share", "1", "--prefix-pages-wait-s", str(PAGES_WAIT_S), pool_gb=0.0008).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="package")
def server_tp2(tiny_dir, tmp_path_factory):
    s = _start(tiny_dir, tmp_path_factory, "--chunked-prefill-size", "48", tp=2).wait_ready(240)
    yield s
    s.stop()
