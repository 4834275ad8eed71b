"""`u1serve up` of one deployment profile as a real process tree on a free loopback port (the tiny checkpoint on
a CPU, random 8B weights on GPUs): deploy/gpu_smoke.py runs its checks against it, bench/bench_load.py its smoke
and tenant runs."""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

from services.base.netutil import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROFILES = {   # name: (GPUs needed, `u1serve up` placement flags)
    "cpu": (0, ["--device", "cpu"]),
    "cpu-fused": (0, ["--device", "cpu", "--colocate-engines", "fused"]),    # the fused mode's checks on a CPU
    "colocate-1": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0"]),
    "colocate-tp2-cfg2": (2, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                              "--gen-cfg-parallel", "2"]),
    "separate-1-1": (2, ["--device", "cuda", "--mode", "separate", "--und-gpus", "0", "--gen-gpus", "1"]),
    "colocate-tp2-sp2": (2, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                             "--gen-sp", "2"]),
    "colocate-tp2-sp2-kv": (2, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                                "--gen-sp", "2", "--gen-sp-mode", "kv-gather"]),
    "colocate-tp2-sp2-kv-graphs": (2, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                                       "--gen-sp", "2", "--gen-sp-mode", "kv-gather", "--cuda-graphs", "on"]),
    "colocate-tp2-cfg2-qos": (2, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                                  "--gen-cfg-parallel", "2", "--qos-yield-share", "0.5"]),
    # generation's decoder layers streamed from pinned host memory through 2 device slots (the 24 GB plan's choice
    # at 2048²; docs/deployment.md "Weight streaming"): CUDA graphs off with it
    "colocate-1-streaming": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0", "--gen-args",
                                 "--weight-streaming-layers 2"]),
    "colocate-1-fused": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0", "--colocate-engines",
                             "fused"]),
    "colocate-1-fused-green75": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0",
                                     "--colocate-engines", "fused", "--gen-sm-percent", "75"]),
    # the denoise step's CUDA graphs keyed by job, as before the shape keys were the default
    "colocate-1-graph-job": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0", "--gen-args",
                                 "--graph-keys job"]),
    "colocate-1-mps": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0", "--gpu-sharing", "mps"]),
    "colocate-1-mps-normal": (1, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0", "--gpu-sharing",
                                  "mps", "--gen-priority", "normal"]),
    "colocate-tp2-cfg2-mps": (2, ["--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                                  "--gen-cfg-parallel", "2", "--gpu-sharing", "mps"]),
}
# Run only when named (--profiles): the mps ones need nvidia-cuda-mps-control, colocate-tp2-sp2-kv is
# colocate-tp2-sp2 in the other SP mode (sequence parallelism by K/V all-gather), -graphs adds
# --cuda-graphs on (the step's collectives captured in the graph), colocate-1-fused is colocate-1 with both engines
# in one process without a green context (the documented fused profile, colocate-1-fused-green75, is a default: it
# starts in ~16 s on an H100), colocate-1-graph-job is colocate-1 with --graph-keys job (the keys before shape), and
# the default 2-GPU profiles already take about 7.5 of the 10 minutes one call may run.
ON_REQUEST = ("colocate-1-fused", "colocate-1-graph-job", "colocate-1-mps", "colocate-1-mps-normal",
              "colocate-tp2-cfg2-mps", "colocate-tp2-sp2-kv", "colocate-tp2-sp2-kv-graphs")
_BAD_LOG = re.compile(r"Traceback|-> 500 |\" 500 |HTTP/1\.1\" 500")


def profiles_for(gpus: int) -> list[str]:
    return [name for name, (need, _) in PROFILES.items() if 1 <= need <= gpus and name not in ON_REQUEST]



class Stack:
    """`u1serve up` of one profile as a real process tree; a context manager that stops it cleanly."""

    def __init__(self, profile: str, out_dir: Optional[str] = None, startup_timeout_s: float = 600.0,
                 extra_flags: tuple[str, ...] = (), tenants: bool = False):
        """tenants: two tenant keys (api_key, tenant_b) and an operator key (operator_key), the RL routes and
        runtime adapter loading on (issue 37's roles: bench_load's tenant-on-tenant attempts)."""
        self.profile = profile
        self.tenants = tenants
        self.tenant_b = "sk-smoke-b-" + os.urandom(6).hex()
        self.operator_key = "sk-smoke-operator-" + os.urandom(6).hex()
        self.gpus, flags = PROFILES[profile]
        self.flags = [*flags, *extra_flags]
        self.dir = out_dir or tempfile.mkdtemp(prefix=f"u1smoke-{profile}-")
        os.makedirs(self.dir, exist_ok=True)
        self.run_dir = os.path.join(self.dir, f"run-{profile}")
        self.api_key = "sk-smoke-" + os.urandom(6).hex()
        self.internal_token = os.urandom(16).hex()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None
        self.exit_code: Optional[int] = None
        self.urls: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Stack":
        model = os.path.join(self.dir, "model")
        variant = ["u1"] if self.gpus == 0 else ["u1-8b"]
        if not os.path.exists(os.path.join(model, "config.json")):
            subprocess.run([sys.executable, "-m", "services.launch.cli", "tiny-checkpoint", model, "--variant", *variant],
                           cwd=ROOT, check=True, capture_output=True, env=self._env())
        key_file = self._secret_file("api-key", [self.api_key] + ([self.tenant_b] if self.tenants else []))
        roles = ["--admin-api-key-file", self._secret_file("admin-api-key", [self.operator_key]), "--enable-rl",
                 "--enable-runtime-lora"] if self.tenants else []
        argv = [sys.executable, "-m", "services.launch.cli", "up", "--model", model, *self.flags, *roles, "--host",
                "127.0.0.1", "--port", str(self.port), "--api-key-file", key_file, "--run-dir", self.run_dir,
                *self._pool_flags(), "--grace", "10",
                "--default-size", "64x64" if self.gpus == 0 else "1024x1024"]
        from services.kit.proc import preexec_die_with_parent
        self.log = open(os.path.join(self.dir, f"launcher-{self.profile}.out"), "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=self._env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec_die_with_parent)
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"u1serve up exited with {self.proc.returncode}:\n{self.launcher_output()}")
            if _status(self.base + "/health") == 200:
                self.startup_s = time.monotonic() - t0
                with open(os.path.join(self.run_dir, "stack.json")) as f:
                    services = json.load(f)["services"]
                self.urls = {k: v["health_url"].rsplit("/health", 1)[0] for k, v in services.items()}
                if "fused" in self.urls:      # one process serves both; its health URL is generation's
                    self.urls.setdefault("gen", self.urls["fused"])
                return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the stack was not healthy after {self.startup_timeout_s:.0f} s:\n{self.launcher_output()}")

    def _secret_file(self, name: str, keys: list[str]) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write("".join(k + "\n" for k in keys))
        os.chmod(path, 0o600)
        return path

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.exit_code = self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.exit_code = self.proc.wait()
        elif self.proc is not None:
            self.exit_code = self.proc.returncode
        if hasattr(self, "log"):
            self.log.close()

    def _env(self) -> dict:
        from services.base import knobs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        env.pop(knobs.API_KEY.name, None)
        env[knobs.INTERNAL_TOKEN.name] = self.internal_token     # the engines' token: to read generation's /metrics
        if self.gpus:
            env[knobs.RANDOM_WEIGHTS.name] = "1"
        return env

    def launcher_output(self) -> str:
        try:
            with open(os.path.join(self.dir, f"launcher-{self.profile}.out")) as f:
                return f.read()[-6000:]
        except OSError:
            return ""

    # -- checks ----------------------------------------------------------------------------------
    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=600, headers={"Authorization": f"Bearer {self.api_key}"},
                            **kw)

    def settle_problems(self, timeout_s: float = 60.0) -> list[str]:
        """Wait for the stack to be idle and empty; what is not."""
        deadline = time.monotonic() + timeout_s
        while True:
            problems = []
            if _status(self.base + "/health") != 200:
                problems.append("gateway /health is not 200")
            und = _json(self.urls.get("und", "") + "/health")
            if und.get("shm_pages_used", 0) != 0:
                problems.append(f"understanding holds {und.get('shm_pages_used')} KV pool pages")
            gen = _json(self.urls.get("gen", "") + "/health")
            if gen.get("queued", 0) or gen.get("running", 0):
                problems.append(f"generation not idle: queued {gen.get('queued')} running {gen.get('running')}")
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.5)

    def _pool_flags(self) -> list[str]:
        """The KV pool: small on the CPU; 8 GiB of host shared memory on a GPU, except in the fused mode, whose pool is
        device memory inside understanding's share (8 GiB there left it 1,666 KV tokens: docs/benchmarks/load.md), so
        it keeps that mode's default."""
        if self.gpus == 0:
            return ["--kv-pool-gb", "0.25"]
        return [] if "fused" in self.flags else ["--kv-pool-gb", "8"]

    def graphs_expected(self) -> bool:
        """On a GPU, unless --cuda-graphs off: generation's steps replay CUDA graphs (step_graph.py; on by default,
        SP stacks and the QoS yield gate too: it runs between graph segments)."""
        f = self.flags
        mode = f[f.index("--cuda-graphs") + 1] if "--cuda-graphs" in f else "auto"
        streamed = any("--weight-streaming-layers" in x for x in f)     # turns graphs off (auto)
        return bool(self.gpus) and mode != "off" and not streamed

    def graph_problems(self) -> list[str]:
        """Rank 0's graph counters from generation's /metrics: some step replayed a graph."""
        try:
            text = httpx.get(self.urls.get("gen", "") + "/metrics", timeout=5,
                             headers={"X-U1-Internal-Token": self.internal_token}).text
        except httpx.HTTPError as exc:
            return [f"generation /metrics: {exc}"]
        replays = re.search(r"^u1_gen_graph_replays_total (\S+)", text, re.M)
        if not replays or float(replays.group(1)) <= 0:
            return ["no generation step replayed a CUDA graph (u1_gen_graph_replays_total "
                    f"{replays.group(1) if replays else 'missing'})"]
        return []

    def log_problems(self) -> list[str]:
        bad = []
        for path in sorted(glob.glob(os.path.join(self.run_dir, "logs", "*.log"))):
            with open(path, errors="replace") as f:
                for line in f:
                    if _BAD_LOG.search(line):
                        bad.append(f"{os.path.basename(path)}: {line.strip()[:200]}")
        return bad


def _status(url: str) -> Optional[int]:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def _json(url: str) -> dict:
    try:
        body = httpx.get(url, timeout=5).json()
        return body if isinstance(body, dict) else {}
    except (httpx.HTTPError, ValueError):
        return {}
