"""Trajectory fetch benchmark (docs/benchmarks/rl.md): one rollout with a large stored trajectory on a `u1serve up`
stack, then `GET /v1/rl/trajectories/{id}` through the gateway, timed:
- raw: the bytes streamed and dropped by the client (the wire: generation -> gateway -> client), MB/s;
- decoded: the trainer's helper, `services.rl.client.RLClient.trajectory` (bytes -> tensors), MB/s;
- the gateway process's peak RSS above its level before the fetch (sampled every few ms from /proc), i.e. what
  the relay holds in memory.

GPU (one H200, random 8B weights; 4 prompts x G = 8 x 21 states of 1024² fp32 = 8.1 GB, needs a larger store):
    python -m bench.bench_trajectory_fetch --profiles colocate-1 --size 1024 --steps 20 --prompts 4 --group-size 8 \\
        --up-args "--gen-args '--rl-trajectory-store-mb 12288'" --out /tmp/bench-fetch
CPU (tiny checkpoint; 1 prompt x G = 8 x 21 states of 512² = 528 MB):
    python -m bench.bench_trajectory_fetch --tiny --profiles cpu-colocate --size 512 --steps 20 --out DIR
Results: a markdown table on stdout and in DIR/bench_trajectory_fetch.md, every number in the .json beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
import threading
import time

import httpx

from bench.stack import enable_rl, exit_status, prepare_model, profile_table, run_all, stack_args

MB = 1 << 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def gateway_pid(log_dir: str, base: str) -> int:
    """The gateway's pid from the stack's run directory (the profile's stack.json naming this port)."""
    port = int(base.rsplit(":", 1)[1])
    for path in glob.glob(os.path.join(log_dir, "*", "stack.json")):
        with open(path) as f:
            state = json.load(f)
        gw = state["services"].get("gateway", {})
        if f":{port}/" in gw.get("health_url", "") and gw.get("pid"):
            return int(gw["pid"])
    raise RuntimeError(f"no stack.json for the gateway on port {port} under {log_dir}")


class PeakRss:
    """The largest RSS of `pid` seen while the block runs, above its level at the start."""

    def __init__(self, pid: int):
        self.pid, self.base, self.peak, self._stop = pid, _rss(pid), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.003):
            self.peak = max(self.peak, _rss(self.pid) - self.base)

    def __enter__(self) -> "PeakRss":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def fetch_raw(base: str, tid: str) -> int:
    n = 0
    with httpx.stream("GET", f"{base}/v1/rl/trajectories/{tid}", timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"trajectory fetch: HTTP {r.status_code}")
        for chunk in r.iter_raw():
            n += len(chunk)
    return n


def fetch_decoded(base: str, tid: str) -> int:
    from services.rl.client import RLClient
    with RLClient(base) as c:
        t = c.trajectory(tid)
        return t.latents.numel() * 4


async def measure(base: str, args) -> dict:
    body = {"prompts": [{"prompt": f"a red cube, view {i}"} for i in range(args.prompts)],
            "group_size": args.group_size, "size": f"{args.size}x{args.size}", "num_inference_steps": args.steps,
            "guidance_scale": 1.0, "seed": 1, "sde": {"kind": "flow", "steps": [0]}, "return_images": False}
    async with httpx.AsyncClient(base_url=base, timeout=3600) as c:
        r = await c.post("/v1/rl/rollout", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"rollout: HTTP {r.status_code} {r.text[:300]}")
    tid = r.json()["trajectory_id"]
    pid = gateway_pid(args.log_dir, base)
    rows = []
    for how, fetch in (("raw", fetch_raw), ("decoded", fetch_decoded)):
        for _ in range(args.repeat):
            with PeakRss(pid) as rss:
                t0 = time.perf_counter()
                n = await asyncio.to_thread(fetch, base, tid)
                dt = time.perf_counter() - t0
            rows.append({"how": how, "mb": n / MB, "seconds": dt, "mb_per_s": n / MB / dt,
                         "gateway_peak_rss_mb": rss.peak / MB})
    httpx.delete(f"{base}/v1/rl/trajectories/{tid}", timeout=60)
    best = {how: max((x for x in rows if x["how"] == how), key=lambda x: x["mb_per_s"]) for how in ("raw", "decoded")}
    return {"runs": rows, "raw": best["raw"], "decoded": best["decoded"]}


def table(results: dict, args) -> str:
    return profile_table(
        f"Trajectory fetch, {args.prompts} x G = {args.group_size} x {args.steps + 1} states of {args.size}² fp32, "
        f"best of {args.repeat}:",
        ["profile", "MB", "raw MB/s", "raw: gateway peak RSS +MB", "decoded MB/s", "decoded: gateway peak RSS +MB"], results,
        lambda r: [f"{r['raw']['mb']:.0f}", f"{r['raw']['mb_per_s']:.0f}", f"{r['raw']['gateway_peak_rss_mb']:.0f}",
                   f"{r['decoded']['mb_per_s']:.0f}", f"{r['decoded']['gateway_peak_rss_mb']:.0f}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", required=True, help="directory for bench_trajectory_fetch.md and .json")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.json = os.path.join(args.out, "bench_trajectory_fetch.json")
    model_dir = prepare_model(args)
    enable_rl(args)
    results = run_all(args, model_dir, measure, table)
    with open(os.path.join(args.out, "bench_trajectory_fetch.md"), "w") as f:
        f.write(table(results, args) + "\n")
    sys.exit(exit_status(results))


if __name__ == "__main__":
    main()
