"""Does Ray Serve run from what was carried? A one-node cluster (`ray start --head`, as LocalCluster starts it),
`ray.init`, a trivial Serve deployment that imports u1serve's Ray application modules in its replica, one HTTP
request through Serve's proxy, then the cluster stopped. Run after `use_carried_wheels` (deploy/carried_wheels.sh),
before a long GPU run: a module the carry misses shows up here in seconds, not after `u1serve up`'s half of a bench.

    python -m deploy.ray.check_carry [--log-dir DIR]

Prints the versions that matter (Ray's and the image's grpcio / protobuf / aiohttp) and `carry ok`; exits 1
with the failing step otherwise. Loopback only, free ports.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import traceback

import httpx

from services.base.netutil import free_port
from services.ray_serve.local_cluster import LocalCluster

# u1serve's Ray application and what its replicas import (the gateway, the stack launcher): no engine code
APP_MODULES = ("services.ray_serve.app", "services.ray_serve.ingress", "services.ray_serve.engine",
               "services.ray_serve.command", "services.gateway.server", "services.launch.stack")


def versions() -> str:
    out = []
    for name in ("ray", "grpc", "google.protobuf", "aiohttp", "fastapi", "pydantic", "uvicorn", "starlette"):
        try:
            mod = importlib.import_module(name)
            out.append(f"{name} {getattr(mod, '__version__', '?')} ({os.path.dirname(mod.__file__)})")
        except Exception as e:       # a missing one is what this check is for: say so, go on
            out.append(f"{name}: {e!r}")
    return "\n".join(out)


def check(cluster: LocalCluster) -> None:
    import ray
    from ray import serve

    # a runtime_env as u1serve's replicas have (their env vars): Ray's runtime-env agent sets it up
    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0,
                                                         "runtime_env": {"env_vars": {"U1_CHECK": "carried"}}})
    class Probe:
        def __init__(self):
            for name in APP_MODULES:
                importlib.import_module(name)

        async def __call__(self, request) -> dict:
            return {"python": sys.version.split()[0], "ray": ray.__version__, "env": os.environ.get("U1_CHECK")}

    t0 = time.monotonic()
    try:
        cluster.start([])
        print(f"ray start --head: up in {time.monotonic() - t0:.1f} s ({cluster.address})", flush=True)
        ray.init(address=cluster.address, log_to_driver=False)
        print(f"ray.init: {ray.cluster_resources()}", flush=True)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Probe.bind(), name="probe", route_prefix="/probe")
        print("serve.run: the probe deployment runs (its replica imported " + ", ".join(APP_MODULES) + ")",
              flush=True)
        r = httpx.get(f"http://127.0.0.1:{port}/probe", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"the Serve proxy answered {r.status_code}: {r.text[:500]}")
        if r.json().get("env") != "carried":
            raise RuntimeError(f"the replica's runtime_env was not applied: {r.json()}")
        print(f"HTTP through the Serve proxy: {r.json()}", flush=True)
        serve.shutdown()
        ray.shutdown()
    finally:
        cluster.stop()
    print(f"ray stop: done ({time.monotonic() - t0:.1f} s in all; Ray's logs: {cluster.temp_dir})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-dir", default=None, help="where the node's log goes (default: a temporary folder)")
    p.add_argument("--keep-logs", action="store_true", help="leave Ray's session logs (its temp dir) behind")
    args = p.parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="u1ray-check-")
    cluster = LocalCluster(log_dir, head_cpus=2, keep_logs=args.keep_logs)
    # the cluster's auth token, in this (driver) process before Ray is first imported: Ray reads it then
    os.environ.update({k: cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})
    print(versions(), flush=True)
    try:
        for name in APP_MODULES:
            importlib.import_module(name)
        check(cluster)
    except Exception:
        traceback.print_exc()
        for f in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, f), errors="replace") as log:
                print(f"--- {f} (last lines)\n" + "".join(log.readlines()[-30:]), file=sys.stderr)
        print("carry FAILED", flush=True)
        return 1
    print("carry ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
