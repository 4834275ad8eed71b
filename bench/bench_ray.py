"""What Ray costs: the same application under `u1serve up` and on a one-node Ray cluster (Ray Serve, `u1serve ray
up --kv-transport shm`), measured in the same run as a client sees it:
  - image: N sequential text-to-image requests (size, steps, CFG 4), median end-to-end seconds;
  - chat: M sequential streamed chats, median time to the first token (TTFT).

GPU (one H200; the 8B geometry with random weights, as bench_deployment.py; ray carried in .whl/, see
docs/deployment.md "Many machines"):
    python -m bench.bench_ray --profile colocate-1 --size 1024x1024 --steps 50 --requests 5 --chats 20
CPU smoke run (tiny checkpoint):
    python -m bench.bench_ray --smoke
Against deployments that already run (CI measures the test cluster's application and its `u1serve up` this way):
    python -m bench.bench_ray --smoke --up-url http://127.0.0.1:8000 --ray-url http://127.0.0.1:9000

Prints a markdown table and, with --json PATH, writes the raw numbers. Exits non-zero when a side failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from bench.bench_deployment import has_token, image_request
from bench.stack import PROFILES, ROOT, exit_status, prepare_model, profile_table, run_profile, write_json
from services.kit import sse
from services.base.netutil import free_port


async def first_token_s(client: httpx.AsyncClient, i: int, tokens: int) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": f"Say something, {i}."}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for ev in sse.aevents(r.aiter_lines()):
            if has_token(ev):
                return time.perf_counter() - t0
    raise RuntimeError("the chat stream returned no token")


async def measure(base: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800.0)) as client:
        await image_request(client, "256x256", 2, 0)             # warm-up
        await first_token_s(client, 0, 4)
        images = [(await image_request(client, args.size, args.steps, 100 + i))["e2e_s"] for i in range(args.requests)]
        ttft = [await first_token_s(client, i, args.chat_tokens) for i in range(args.chats)]
    return {"image_e2e_s": statistics.median(images), "image_all_s": images,
            "ttft_ms": 1e3 * statistics.median(ttft), "ttft_all_ms": [1e3 * t for t in ttft]}


def run_ray(model_dir: str, args) -> dict:
    """A one-node Ray cluster (the head; its GPUs found by Ray), the application deployed on it, measured."""
    from services.base import knobs
    from services.ray_serve.local_cluster import LocalCluster
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **{knobs.RANDOM_WEIGHTS.name: "0" if args.tiny else "1", knobs.INTERNAL_TOKEN.name: "bench-ray-token"})
    cluster = LocalCluster(os.path.join(args.log_dir, "ray"), env=env, head_cpus=args.ray_cpus)
    port = free_port()
    t0 = time.time()
    try:
        cluster.start([])
        cmd = [sys.executable, "-m", "services.launch.cli", "ray", "up", "--address", cluster.address, "--http-port",
               str(port), "--kv-transport", "shm", "--engine-cpus", "0", "--engine-host", "127.0.0.1", "--",
               "--model", model_dir, "--host", "127.0.0.1", *PROFILES[args.profile].split()]
        r = subprocess.run(cmd, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=args.startup_timeout)
        if r.returncode != 0:
            raise RuntimeError(f"u1serve ray up failed: {r.stdout[-2000:]} {r.stderr[-4000:]}")
        base = f"http://127.0.0.1:{port}"       # ready: `u1serve ray up` returns once every replica runs
        startup_s = time.time() - t0
        res = asyncio.run(measure(base, args))
        res["startup_s"] = startup_s
        res["command"] = "u1serve ray up --kv-transport shm -- " + PROFILES[args.profile]
        return res
    finally:
        cluster.stop()


def table(results: dict, args) -> str:
    up, ray = results.get("u1serve up", {}), results.get("ray serve", {})
    text = profile_table(
        f"Image: {args.size}, {args.steps} steps, CFG 4, {args.requests} sequential requests (median). Chat: "
        f"{args.chats} sequential streams, time to the first token (median).",
        ["", "image e2e s", "chat TTFT ms"], results, lambda r: [f"{r['image_e2e_s']:.3f}", f"{r['ttft_ms']:.1f}"])
    if "image_e2e_s" in up and "image_e2e_s" in ray:
        text += (f"\n| Ray's cost | {100 * (ray['image_e2e_s'] / up['image_e2e_s'] - 1):+.1f} % | "
                 f"{100 * (ray['ttft_ms'] / up['ttft_ms'] - 1):+.1f} % |")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="colocate-1", choices=sorted(PROFILES))
    p.add_argument("--variant", default="u1-8b", help="full-size config (random weights)")
    p.add_argument("--tiny", action="store_true", help="tiny checkpoint instead")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--chats", type=int, default=20)
    p.add_argument("--chat-tokens", type=int, default=16)
    p.add_argument("--ray-cpus", type=float, default=4, help="CPUs the Ray head offers")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--port", type=int, default=0, help="`u1serve up`'s gateway port (default: a free one)")
    p.add_argument("--up-args", default="")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU, 64x64, a few requests")
    p.add_argument("--up-url", default=None, help="measure this running `u1serve up` instead of starting one")
    p.add_argument("--ray-url", default=None, help="measure this running Ray application instead of starting one")
    args = p.parse_args()
    if args.smoke:
        args.tiny, args.profile, args.size, args.steps = True, "cpu-colocate", "64x64", 2
        args.requests, args.chats, args.chat_tokens, args.ray_cpus = 2, 3, 4, 1
    model_dir = None if args.up_url and args.ray_url else prepare_model(args)
    results = {}
    for name, run in (("u1serve up", lambda: asyncio.run(measure(args.up_url, args)) if args.up_url else
                       run_profile(args.profile, model_dir, args, measure)),
                      ("ray serve", lambda: asyncio.run(measure(args.ray_url, args)) if args.ray_url else
                       run_ray(model_dir, args))):
        try:
            results[name] = run()
        except Exception as e:          # the other side still runs; the exit status says it failed
            results[name] = {"error": repr(e)}
        print(name, json.dumps(results[name]), flush=True)
    print(table(results, args))
    write_json(args, results)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
