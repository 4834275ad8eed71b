"""No secret in what Ray shows: `u1serve ray up` on a real two-node Ray cluster (local_cluster.py) whose nodes
have NO internal token in their environment, with the API keys as a file (--api-key-file after --). The
replicas read the token from the file `ray up` wrote and the keys from theirs; the gateway takes every key of
the file and no other; neither the token nor a key is anywhere in Ray's session directory (its logs, the
runtime_env records) or on a process's command line."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the Ray tests need the [ray] extra (in [test])")

from openai import OpenAI  # noqa: E402

from services.base.netutil import free_port  # noqa: E402
from services.ray_serve.engine import POOL_PREFIX  # noqa: E402
from services.ray_serve.local_cluster import LocalCluster, NodeSpec  # noqa: E402
from shm_transfer.segment import probe  # noqa: E402
from tests.ray.harness import ROOT, STACK  # noqa: E402

pytestmark = pytest.mark.timeout(900)
TOKEN = "ray-secrets-test-internal-token-7f3a"
KEYS = ("sk-ray-tenant-a-5d1c9e0b7a", "sk-ray-tenant-b-0e9f8c7d6b")
FLAGS = ["--und-resources", '{"u1_und": 1}', "--gen-resources", '{"u1_gen": 1}', "--engine-cpus", "0",
         "--env", "UCX_TLS=tcp", "--engine-host", "127.0.0.1", "--kv-transport", "shm"]


@pytest.fixture(scope="module")
def deployed(cache, tmp_path_factory):
    work = tmp_path_factory.mktemp("raysecrets")
    keys = work / "api-keys"
    keys.write_text(f"# tenants\n{KEYS[0]}\n\n{KEYS[1]}\n")
    node_env = {k: v for k, v in os.environ.items() if not k.startswith("U1SERVE_")}
    node_env.update({"PYTHONPATH": ROOT, "U1SERVE_CACHE": cache, "UCX_TLS": "tcp"})
    cluster = LocalCluster(str(work / "cluster"), env=node_env)
    port = free_port()
    pools_before = set(ray_pools())
    try:
        cluster.start([NodeSpec("a", 2, {"u1_und": 1, "u1_gen": 1}, private_shm=False)])
        argv = [sys.executable, "-m", "services.launch.cli", "ray", "up", "--address", cluster.address, "--http-port",
                str(port), *FLAGS, "--", *STACK, "--api-key-file", str(keys)]
        # `ray up`'s own environment has the token (as an operator's shell would); the nodes' have none
        r = subprocess.run(argv, cwd=ROOT, env={**cluster.env, "U1SERVE_INTERNAL_TOKEN": TOKEN},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "ready:" in r.stdout, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        yield cluster, f"http://127.0.0.1:{port}"
        # as an operator ends it: the replicas stop their engines and remove understanding's KV pool (this node
        # shares the host's /dev/shm, so a pool left behind is visible here)
        down = subprocess.run([sys.executable, "-m", "services.launch.cli", "ray", "down", "--address",
                               cluster.address], cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=180)
        assert down.returncode == 0, down.stderr[-3000:]
    finally:
        cluster.stop()
    left = [n for n in set(ray_pools()) - pools_before if not (probe(n) or (0, False))[1]]
    assert not left, f"understanding KV pools left in /dev/shm after `u1serve ray down`: {left}"


def ray_pools() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(POOL_PREFIX)]


def test_every_key_of_the_file_and_no_other(deployed):
    _, base = deployed
    for key in KEYS:
        client = OpenAI(base_url=base + "/v1", api_key=key, timeout=120, max_retries=2)
        r = client.chat.completions.create(model="sensenova-u1", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, temperature=0)
        assert r.choices[0].message.content is not None
    for wrong in ("sk-wrong", "# tenants"):
        assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401


def test_the_engines_take_the_token_of_the_file(deployed, cache):
    _, base = deployed
    health = httpx.get(base + "/health", timeout=30).json()
    urls = [p["url"] for kind in ("understanding", "generation") for p in health[kind]]
    assert urls
    with open(os.path.join(cache, "ray", "u1serve", "internal_token")) as f:
        assert f.read().strip() == TOKEN
    assert os.stat(os.path.join(cache, "ray", "u1serve", "internal_token")).st_mode & 0o077 == 0
    for url in urls:
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        assert httpx.get(url + "/metrics", headers={"X-U1-Internal-Token": TOKEN}, timeout=10).status_code == 200


def test_no_secret_in_rays_records_or_a_command_line(deployed):
    cluster, _ = deployed
    secrets_ = [TOKEN.encode(), *(k.encode() for k in KEYS)]
    found = []
    for folder, _, names in os.walk(cluster.temp_dir):
        for name in names:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            found += [(path, s) for s in secrets_ if s in data]
    assert not found, found
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        assert not any(s in cmd for s in secrets_), cmd
