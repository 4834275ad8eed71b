"""Helpers for the generation tests: a real server process, a test KV producer, SSE parsing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import torch
from services.contract.image import SamplerParams
from services.generation.step_graph import StepGraphs
from services.kit import sse
from services.kit.live import LIVE_PATH
from services.base.netutil import free_port
from services.kit.proc import preexec_die_with_parent  # a killed test run leaves no server behind
from tests.waiting import stop_group, wait_ok

REPO = Path(__file__).resolve().parents[2]
TOKEN = "gen-test-token"
HEADERS = {"X-U1-Internal-Token": TOKEN}


class GenServer:
    """`python -m services.generation.server` on loopback, in its own process group."""

    def __init__(self, model_dir: str, pool_name: str, *extra: str, cfg_parallel: int = 1,
                 knobs: dict | None = None):
        self.port = free_port()
        self.knobs = knobs or {}          # U1SERVE_* variables of this server only (a test's fault, say)
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "services.generation.server", "--model", model_dir,
                     "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                     "--dtype", "float32", "--cfg-parallel", str(cfg_parallel),
                     "--kv-pool-name", pool_name, "--max-batch-tokens", "4096", "--log-level", "warning",
                     *extra]
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def env() -> dict:
        """The environment the services run with (the internal token travels here, not in argv)."""
        return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    U1SERVE_INTERNAL_TOKEN=TOKEN)

    def start(self, timeout: float = 120.0) -> "GenServer":
        self.launch()
        self.wait_healthy(timeout)
        return self

    def launch(self) -> "GenServer":
        """Start the process without waiting for /health (start() waits)."""
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=dict(self.env(), **self.knobs), start_new_session=True,
                                     preexec_fn=preexec_die_with_parent)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> dict:
        """/health's answer once the server is up (its output goes to the test run's), checked to come from this
        process: a process that bound the port first would answer for a server that then fails to bind."""
        health = wait_ok(self.url + "/health", self.proc, lambda: "", timeout, self.argv[2], interval=0.1).json()
        pid = httpx.get(self.url + LIVE_PATH, timeout=5).json()["pid"]
        assert pid == self.proc.pid, f"{self.url} is served by pid {pid}, not by {self.argv[2]} (pid {self.proc.pid})"
        return health

    def health(self) -> tuple[int, dict]:
        r = httpx.get(self.url + "/health", timeout=5)
        return r.status_code, r.json()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=HEADERS, timeout=5).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc:
            stop_group(self.proc, 15)


def generate(url: str, body: dict, on_event=None, timeout: float = 120.0):
    """POST /internal/generate. Returns (status, events) where events ends with "[DONE]" for a
    stream; a non-200 answer returns (status, json body). on_event(ev) returning True disconnects."""
    events = []
    with httpx.stream("POST", url + "/internal/generate", json=body, headers=HEADERS,
                      timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        for ev in sse.events(r.iter_lines(), done=True):
            events.append(ev)
            if ev != sse.DONE and on_event is not None and on_event(ev):
                break
    return 200, events


def generate_all(url: str, bodies: dict, timeout: float = 180.0) -> dict:
    """POST every body at once (one thread each, released together) -> {request_id: generate(...)}."""
    import threading
    results, start = {}, threading.Barrier(len(bodies))

    def one(rid):
        start.wait()
        results[rid] = generate(url, bodies[rid], timeout=timeout)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


def images_of(events) -> list[np.ndarray]:
    from services.generation.encode import decode_image
    imgs = sorted((e for e in events if isinstance(e, dict) and e.get("type") == "image"),
                  key=lambda e: e["index"])
    return [decode_image(e["b64"]) for e in imgs]


def errors_of(events) -> list[dict]:
    return [e for e in events if isinstance(e, dict) and e.get("type") == "error"]


def publish(pool, prefixes: dict, lease_s: float = 60.0) -> dict:
    """Test producer: write reference prefix KVs into the pool, as the understanding service does."""
    from shm_transfer import write_kv
    handles = {}
    for branch, p in prefixes.items():
        h = pool.allocate(p.num_tokens, lease_s, branch=branch, t_offset=p.t_offset)
        write_kv(pool, h, p.kv.to(pool.layout.torch_dtype).contiguous())
        handles[branch] = h.to_dict()
    return handles


def reference_pixels(model, prefixes, body: dict) -> np.ndarray:
    """uint8 [n, H, W, 3] of the reference pipeline for a generate body."""
    from services.model import reference as R
    from services.model import sampler as S
    params = SamplerParams(num_inference_steps=body["num_inference_steps"],
                             timestep_shift=body.get("timestep_shift", 3.0),
                             t_eps=body.get("t_eps", 0.02), guidance_scale=body["guidance_scale"],
                             image_guidance_scale=body.get("image_guidance_scale", 1.0),
                             cfg_norm=body.get("cfg_norm", "none"),
                             cfg_interval=tuple(body.get("cfg_interval", (0.0, 1.0))),
                             mode=body.get("mode", "t2i"))
    x = R.denoise(model, prefixes, body["width"], body["height"], params, seed=body["seed"],
                  n=body.get("n", 1))
    return S.to_uint8(x).numpy()


def assert_same_images_as_reference(model, results: dict, cases, bodies: dict) -> None:
    """Every finished request (`results[rid] = (status, events)`) gave exactly the reference images."""
    for rid, pre, _ in cases:
        status, events = results[rid]
        assert status == 200 and not errors_of(events), events
        want = reference_pixels(model, pre, bodies[rid])
        got = images_of(events)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert np.array_equal(g, w), rid


def body(request_id: str, handles: dict, **kw) -> dict:
    b = {"request_id": request_id, "handles": handles, "mode": "t2i", "width": 128, "height": 128,
         "n": 1, "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 11,
         "output_format": "png"}
    b.update(kw)
    return b


def seeded(seed: int = 0):
    torch.manual_seed(seed)


class UndServer:
    """The real understanding service (it creates the pool), fp32 on CPU."""

    def __init__(self, model_dir: str, pool_name: str, pool_gb: float = 0.02, lease_s: float = 60):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool_name = pool_name
        self.argv = [sys.executable, "-m", "services.understanding.server", "--model", model_dir,
                     "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                     "--dtype", "float32", "--kv-pool-name", pool_name, "--kv-pool-gb",
                     str(pool_gb), "--kv-page-tokens", "16", "--kv-lease-s", str(lease_s),
                     "--kv-cache-tokens", "8192", "--max-model-len", "4096",
                     "--internal-token", TOKEN, "--log-level", "warning",
                     "--prefix-pages-wait-s", "0"]    # a full pool answers 429 at once (tests that fill it)
        self.proc = None
        self.knobs: dict[str, str] = {}           # launch()'s extra environment (GenServer's knobs=)

    env = staticmethod(GenServer.env)
    start = GenServer.start
    launch = GenServer.launch
    wait_healthy = GenServer.wait_healthy
    stop = GenServer.stop

    def image_prefix(self, **kw) -> tuple[int, dict]:
        r = httpx.post(self.url + "/internal/image_prefix", json=kw, headers=HEADERS, timeout=120)
        return r.status_code, r.json()

    def release(self, handles: list[dict]) -> dict:
        return httpx.post(self.url + "/internal/release", json={"handles": handles},
                          headers=HEADERS, timeout=30).json()


def data_url(img) -> str:
    import base64
    import io
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


_CACHE: dict = {}


def prefixes(ref_model, kind="t2i", prompt="a red cat", images=(), think=False, **params):
    """Reference prefix KVs (memoised: building them is most of a test's CPU time)."""
    key = (kind, prompt, tuple(id(i) for i in images), think, tuple(sorted(params.items())))
    if key not in _CACHE:
        model, tok = ref_model
        from services.model import reference as R
        p = SamplerParams(mode=kind, **params)
        _CACHE[key] = R.image_prefixes(model, tok, kind, prompt, list(images), p, think=think,
                                       max_think_tokens=6)
    return _CACHE[key]


def photo(seed: int, w: int = 64, h: int = 96) -> Image.Image:
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def run_jobs(engine, ref_model, specs) -> dict:
    """Run GenerateRequests together on `engine` to their end (the reference's prefix KV, no pool);
    {request_id: the finished JobState}."""
    pre = prefixes(ref_model, guidance_scale=4.0)
    jobs = []
    for sp in specs:
        job = engine.admit_local(sp, {b: pre[b].kv for b in sp.handles}, {b: pre[b].t_offset for b in sp.handles})
        engine.add(job)
        jobs.append(job)
    while engine.running:
        for job in engine.step()[0]:
            job.free()
    return {j.request_id: j for j in jobs}


class RecordedGraph:
    def __init__(self, fn, static, out):
        self.fn, self.static, self.out = fn, static, out

    def replay(self):
        self.out.copy_(self.fn(self.static))


class RecordingGraphs(StepGraphs):
    """StepGraphs whose capture records the closure instead of CUDA work: "replay" runs it again on the same
    buffers (the static input, the stand-ins' KV, the held Rope) into the recorded output. What is under test is
    everything around the capture — keys, segments, buffers, stand-ins, the cache's and the gate's place between
    them; whether CUDA's capture and replay match eager is measured on the GPU (bench/gpu_genperf.sh)."""

    def __init__(self, keys: str = "job"):
        super().__init__(torch.device("cpu"), "off", keys)
        self.enabled = True

    def _record(self, held, fn, static):
        out = fn(static).clone()          # a real capture leaves its output unset until the first replay
        out.zero_()
        return RecordedGraph(fn, static, out), out
