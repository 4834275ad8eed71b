#!/usr/bin/env python3
"""End-to-end benchmark through the public API (what a client sees).

    python deploy/bench_e2e.py --base http://127.0.0.1:8000 --requests 16 --concurrency 4 \
        --size 1024x1024 --steps 50 [--think] [--api-key KEY] [--json out.json]

Streams each image request to measure time to first progress event and to the image; prints
p50/p90 latency and images per minute. Needs only httpx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


async def one(client: httpx.AsyncClient, args, i: int) -> dict:
    body = {"prompt": f"a photo of a lighthouse at dusk, variant {i}", "size": args.size,
            "num_inference_steps": args.steps, "n": args.n, "seed": i, "stream": True,
            "think": args.think}
    t0 = time.perf_counter()
    first_progress = None
    images = 0
    async with client.stream("POST", "/v1/images/generations", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": (await r.aread())[:200].decode()}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("type", "").endswith(".progress") and first_progress is None:
                first_progress = time.perf_counter() - t0
            elif ev.get("type", "").endswith(".completed"):
                images += 1
            elif ev.get("type") == "error":
                return {"ok": False, "status": ev.get("status"), "error": ev["error"]["message"]}
    return {"ok": images == args.n, "latency": time.perf_counter() - t0,
            "first_progress": first_progress, "images": images}


async def main_async(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.base, headers=headers, timeout=None) as client:
        await one(client, argparse.Namespace(**{**vars(args), "n": 1, "steps": 2}), -1)  # warm-up

        async def guarded(i):
            async with sem:
                return await one(client, args, i)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency"] for r in ok)
    fp = sorted(r["first_progress"] for r in ok if r["first_progress"] is not None)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    return {"size": args.size, "steps": args.steps, "n": args.n, "think": args.think,
            "requests": args.requests, "concurrency": args.concurrency, "ok": len(ok),
            "failed": [r for r in results if not r["ok"]][:5], "wall_s": wall,
            "latency_p50_s": pct(lat, 0.5), "latency_p90_s": pct(lat, 0.9),
            "latency_mean_s": statistics.mean(lat) if lat else None,
            "first_progress_p50_s": pct(fp, 0.5),
            "images_per_min": 60 * sum(r["images"] for r in ok) / wall if wall else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--think", action="store_true")
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args()
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
