"""The Ray application on a real multi-node Ray cluster on this machine (services/ray_serve/local_cluster.py),
and `u1serve up` beside it, for tests/ray, deploy/ray/smoke.sh and bench/bench_ray.py's CPU mode.

Nodes: the head (the gateway, the registry, Serve's controller and HTTP proxy), node `a` (understanding and room
for generation) and node `b` (generation), each worker node its own shared-memory domain: a prefix made on `a` and
denoised on `b` crosses by NIXL (TCP), one denoised on `a` moves through `a`'s shared memory."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys

import httpx

from services.base.netutil import free_port
from services.ray_serve.local_cluster import LocalCluster, NodeSpec
from tests.waiting import wait_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "ray-test-internal-token"
HEADERS = {"X-U1-Internal-Token": TOKEN}
STACK = ["--model", "tiny", "--device", "cpu", "--host", "127.0.0.1"]
NODES = [NodeSpec("a", 1, {"u1_und": 1, "u1_gen": 3}), NodeSpec("b", 1, {"u1_gen": 2})]
RAY_FLAGS = ["--und-resources", '{"u1_und": 1}', "--gen-resources", '{"u1_gen": 1}',
             "--control-resources", '{"u1_control": 0.01}', "--engine-cpus", "0", "--und-replicas", "1",
             "--gen-replicas", "2:3", "--gen-target-load", "1", "--upscale-delay-s", "1",
             "--downscale-delay-s", "600", "--env", "UCX_TLS=tcp", "--engine-host", "127.0.0.1"]
IMAGE = {"size": "64x64", "extra_body": {"num_inference_steps": 4}}
SEEDS = (11, 12, 13, 14)                 # the reference images


def env(cache: str) -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "U1SERVE_CACHE": cache, "U1SERVE_INTERNAL_TOKEN": TOKEN,
            "UCX_TLS": "tcp"}


class RayApp:
    """A LocalCluster with the application deployed by `u1serve ray up`; `base` is the Serve ingress."""

    def __init__(self, workdir: str, cache: str):
        self.cluster = LocalCluster(workdir, env=env(cache), head_resources={"u1_control": 1})
        self.env = self.cluster.env          # drivers need the cluster's auth token
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> "RayApp":
        self.cluster.start(NODES)
        argv = [sys.executable, "-m", "services.launch.cli", "ray", "up", "--address", self.cluster.address,
                "--http-port", str(self.port), *RAY_FLAGS, "--", *STACK]
        r = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0 or "ready:" not in r.stdout:
            raise RuntimeError(f"u1serve ray up failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
        return self

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def replicas(self, kind: str) -> list[str]:
        """Engine replicas the gateway routes to and finds healthy (kind: understanding | generation)."""
        try:
            return [p["url"] for p in self.health()[kind] if p["status"] == "ok"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def where(self) -> dict[str, str]:
        """engine URL -> the node it runs on (a, b, ...): the registry read through Serve, node names from the
        nodes' resources."""
        code = ("import json, sys, ray; from ray import serve; ray.init(address=sys.argv[1], logging_level='ERROR',"
                " log_to_driver=False); names = {n['NodeID']: [k[5:] for k in n['Resources'] if "
                "k.startswith('node_')] for n in ray.nodes() if n['Alive']}; "
                "reg = serve.get_deployment_handle('registry', app_name='u1serve').replicas.remote().result(); "
                "print(json.dumps({r['url']: (names.get(r['node_id']) or ['?'])[0] for k in reg for r in reg[k]}))")
        r = subprocess.run([sys.executable, "-c", code, self.cluster.address], env=self.env, capture_output=True,
                           text=True, timeout=120)
        return json.loads(r.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        self.cluster.stop()


def with_node_labels(nodes: list[NodeSpec]) -> list[NodeSpec]:
    """Each node also carries `node_<name>: 1` (where() names nodes by it)."""
    return [NodeSpec(n.name, n.num_cpus, {**n.resources, f"node_{n.name}": 1}, n.private_shm) for n in nodes]


NODES = with_node_labels(NODES)


class UpStack:
    """`u1serve up` with the same stack flags, for the reference outputs."""

    def __init__(self, cache: str, log_path: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.launch.cli", "up", *STACK, "--port", str(self.port),
                                      "--grace", "5"], cwd=ROOT, env=env(cache), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> "UpStack":
        wait_ok(self.base + "/health", self.proc, lambda: f"see {self.log.name}", timeout_s, "u1serve up",
                interval=0.5)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)      # the launcher stops its services and unlinks its pool
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def image_digest(client, seed: int, prompt: str = "a red fox in the snow") -> str:
    """sha256 of the decoded PNG of one 64x64 4-step image."""
    img = client.images.generate(model="sensenova-u1", prompt=prompt, response_format="b64_json",
                                 size=IMAGE["size"], extra_body={**IMAGE["extra_body"], "seed": seed})
    return hashlib.sha256(base64.b64decode(img.data[0].b64_json)).hexdigest()


def chat_text(client, text: str = "Describe a fox.") -> str:
    r = client.chat.completions.create(model="sensenova-u1", messages=[{"role": "user", "content": text}],
                                       max_tokens=8, temperature=0)
    return r.choices[0].message.content
