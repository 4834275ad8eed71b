#!/usr/bin/env python3
"""Colocate QoS, side by side (issue 25): the same mixed load (bench/bench_load.py) against a stack with the QoS
defaults off (`--gpu-sharing time-slice --qos-yield-share 0`: the behaviour before them) and one with the defaults
(`u1serve up --mode colocate` and nothing else: services/launch/colocate_qos.py), then one markdown table.

    python -m bench.bench_qos                      # one H200: colocate-1-timeslice vs colocate-1, 64 clients x 120 s
    python -m bench.bench_qos --tiny --profiles cpu-colocate-timeslice,cpu-colocate --clients 6 --duration 4  # CPU
    python -m bench.bench_qos --tiny --profiles cpu-colocate,cpu-colocate-fused --clients 6 --duration 4   # fused

Per profile: the load (default mix, chats of exactly --max-tokens tokens: ignore_eos), then one image with the step
cache (`"cache": {"mode": "first_block", "threshold": 0.1}`) and the same image exact, with the steps each CFG branch
reused as the response reports them (under MPS it reused nothing: the images were NaN; docs/benchmarks/generation.md). Reported: chat p50 / p99 (every
answered chat, streamed or not), images/min and its share of the first profile's, 5xx, the GPU sharing and gate in
force (stack.json `qos`), and the targets: chat p50 <= 0.6 s, p99 <= 1.5 s, images/min >= 95 % of the first
profile's. For a fused stack (--colocate-engines fused, issue 38) also the GIL measured under the load: each engine
loop's steps, mean step time, its thread's CPU time and share (services/kit/loop_clock.py), and the GIL probe's
waits, read from the fused process's /internal/fused. bench/gpu_qos.sh is the GPU command.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

import httpx

from bench.bench_load import LoadConfig, _pct, run_load_async, summarize
from bench.stack import prepare_model, run_profile, stack_args, write_json
from services.base import knobs

TARGETS = {"chat_p50_s": 0.6, "chat_p99_s": 1.5, "images_share": 0.95}


async def _image(http: httpx.AsyncClient, args, cache: dict | None) -> dict:
    body = {"prompt": "a lighthouse at dusk", "size": args.cache_size, "num_inference_steps": args.cache_steps,
            "seed": 7, **({"cache": cache} if cache else {})}
    return await _timed_image(http, body)


async def _timed_image(http: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.monotonic()
    r = await http.post("/v1/images/generations", json=body)
    r.raise_for_status()
    steps = r.json()["data"][0].get("branch_steps") or {}
    return {"seconds": time.monotonic() - t0, "reused": sum(b.get("reused", 0) for b in steps.values()),
            "branch_steps": steps}


def measure_for(name: str, args):
    async def measure(base: str, _args) -> dict:
        cfg = LoadConfig(size=args.size, steps=args.steps, max_tokens=args.max_tokens, ignore_eos=True,
                         seed=args.seed, rate=args.rate)
        with open(os.path.join(args.log_dir, name, "stack.json")) as f:
            state = json.load(f)
        qos = state.get("qos") or {}
        fused_before = fused_stats(state)
        outcomes = await run_load_async(base, args.clients, args.duration, cfg)
        summary = summarize(outcomes, args.duration)
        steady = steady_chats(outcomes, args.settle_s)
        gil = gil_under_load(fused_before, fused_stats(state))
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            cached = await _image(http, args, {"mode": "first_block", "threshold": args.cache_threshold})
            exact = await _image(http, args, None)
            alone = await _alone(http, args)
        return {"chat_p50_s": summary["chat_p50_s"], "chat_p99_s": summary["chat_p99_s"],
                "chat_steady_p50_s": steady[0], "chat_steady_p99_s": steady[1],
                "chat_tokens_mean": summary["chat_tokens_mean"], "images_per_min": summary["images_per_min"],
                "requests": summary["requests"], "count_5xx": summary["count_5xx"], "codes_5xx": summary["codes_5xx"],
                "by_kind": summary["by_kind"], "qos": qos, "gil": gil, "alone": alone,
                "engines": (state.get("colocate_engines") or {}).get("engines", "processes"),
                "cache": {"cached_s": cached["seconds"], "exact_s": exact["seconds"], "reused_steps": cached["reused"],
                          "branch_steps": cached["branch_steps"]}}
    return measure


async def _alone(http: httpx.AsyncClient, args, runs: int = 3) -> dict:
    """The load's image (its size and steps) and one chat of --max-tokens tokens, each alone on the idle stack,
    median of `runs`: the floors the loaded figures are read against (issue 38: the image alone <= 0.30 s)."""
    images, chats = [], []
    for i in range(runs):
        body = {"prompt": "a red kite over hills", "size": args.size, "num_inference_steps": args.steps, "seed": i}
        images.append((await _timed_image(http, body))["seconds"])
        t0 = time.monotonic()
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"count to ten, {i}"}],
            "max_tokens": args.max_tokens, "ignore_eos": True})
        r.raise_for_status()
        chats.append(time.monotonic() - t0)
    return {"image_s": sorted(images)[runs // 2], "chat_s": sorted(chats)[runs // 2]}


def fused_stats(state: dict) -> dict | None:
    """The fused process's /internal/fused (services/fused/stats.py) of a stack.json, None for other stacks."""
    svc = state.get("services", {}).get("fused")
    if svc is None:
        return None
    base = svc["health_url"].rsplit("/health", 1)[0]
    r = httpx.get(base + "/internal/fused", timeout=10,
                  headers={"Authorization": f"Bearer {knobs.INTERNAL_TOKEN.get()}"})
    r.raise_for_status()
    return r.json()


def gil_under_load(before: dict | None, after: dict | None) -> dict | None:
    """Each engine loop's steps, mean step and CPU time and CPU share during the load (the difference of two
    /internal/fused reads), and the GIL probe's mean and largest wait (over the whole run)."""
    if before is None or after is None:
        return None
    loops = {}
    for name, a in after["loops"].items():
        b = before["loops"].get(name, {"steps": 0, "wall_s": 0.0, "cpu_s": 0.0})
        steps, wall, cpu = a["steps"] - b["steps"], a["wall_s"] - b["wall_s"], a["cpu_s"] - b["cpu_s"]
        loops[name] = {"steps": steps, "mean_step_ms": round(1e3 * wall / steps, 3) if steps else None,
                       "mean_cpu_ms": round(1e3 * cpu / steps, 3) if steps else None,
                       "cpu_share": round(cpu / wall, 4) if wall else None, "max_step_ms": a["max_step_ms"]}
    return {"loops": loops, "gil_probe": after["gil_probe"]}


def gil_cell(gil: dict | None) -> str:
    if not gil:
        return "-"
    loops = "; ".join(f"{n[:3]} {v['mean_step_ms']} ms/step, cpu {v['cpu_share']}" for n, v in gil["loops"].items())
    probe = gil.get("gil_probe") or {}
    return f"{loops}; probe wait mean {probe.get('mean_wait_ms')} ms, max {probe.get('max_wait_ms')} ms"


def steady_chats(outcomes, settle_s: float) -> tuple:
    """p50 / p99 of the answered chats that started after the first settle_s seconds: the run opens with every
    client sending at once (a burst the targets' whole-run figures include), these show the steady state."""
    lat = [o.latency_s for o in outcomes if o.status == 200 and o.kind.startswith("chat") and o.started_s >= settle_s]
    return _pct(lat, 0.5), _pct(lat, 0.99)       # the whole run's columns use the same percentile


def verdicts(results: dict, first: str) -> dict:
    """Each profile against the targets (images against the first profile's, the one without the defaults)."""
    base = (results.get(first) or {}).get("images_per_min")
    out = {}
    for name, r in results.items():
        if "error" in r:
            continue
        share = r["images_per_min"] / base if base else None
        r["images_share"] = share
        out[name] = {"chat_p50": r["chat_p50_s"] is not None and r["chat_p50_s"] <= TARGETS["chat_p50_s"],
                     "chat_p99": r["chat_p99_s"] is not None and r["chat_p99_s"] <= TARGETS["chat_p99_s"],
                     "images": share is not None and share >= TARGETS["images_share"]}
    return out


def table(results: dict, args) -> str:
    fmt = (lambda v, spec=".2f": format(v, spec) if v is not None else "-")
    first = args.profiles.split(",")[0]
    checks = verdicts(results, first)
    load = (f"open loop {args.rate:g} requests/s (at most {args.clients} in flight)" if args.rate
            else f"{args.clients} clients")
    lines = [f"colocate QoS, {load} x {args.duration:g} s, {args.size} {args.steps} steps, chats of "
             f"{args.max_tokens} tokens; step cache: {args.cache_size} {args.cache_steps} steps",
             "", "| profile | GPU sharing | yield gate | chat p50 / p99 s | after the first "
             f"{args.settle_s:g} s | images/min (vs first) | 5xx | "
             "step cache: reused steps, s cached / exact | targets (p50 <= 0.6, p99 <= 1.5, images >= 95 %) | "
             "alone: image / chat s | engines | fused: engine loops under load, GIL probe |",
             "|---|---|---|---|---|---|---:|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | |")
            continue
        q, c, v = r["qos"], r["cache"], checks[name]
        met = ", ".join(f"{k} {'met' if ok else 'missed'}" for k, ok in v.items())
        lines.append(f"| {name} | {q.get('gpu_sharing', '?')} | {q.get('yield_share') or 'off'} | "
                     f"{fmt(r['chat_p50_s'])} / {fmt(r['chat_p99_s'])} | "
                     f"{fmt(r.get('chat_steady_p50_s'))} / {fmt(r.get('chat_steady_p99_s'))} | {fmt(r['images_per_min'], '.1f')} "
                     f"({fmt(100 * r['images_share'] if r['images_share'] is not None else None, '.0f')} %) | "
                     f"{r['count_5xx']} | {c['reused_steps']}, {fmt(c['cached_s'])} / {fmt(c['exact_s'])} | {met} | "
                     f"{fmt((r.get('alone') or {}).get('image_s'))} / {fmt((r.get('alone') or {}).get('chat_s'))} | "
                     f"{r.get('engines', 'processes')} | {gil_cell(r.get('gil'))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1-timeslice,colocate-1")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load per profile")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: requests arrive at this many a second on every profile (the same offered work; "
                        "--clients caps those in flight); default: --clients closed loops")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-size", default="1024x1024", help="the step-cache check's image")
    p.add_argument("--cache-steps", type=int, default=50)
    p.add_argument("--cache-threshold", type=float, default=0.1,
                   help="first_block threshold of the step-cache check (the tiny CPU run takes 10: it reuses surely)")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="the steady-state chat columns count chats started after this many seconds of load")
    p.add_argument("--markdown", default=None, help="append the table here")
    args = p.parse_args(argv)
    if args.tiny and args.size == "1024x1024":
        args.size = args.cache_size = "64x64"
        args.steps, args.cache_steps, args.cache_threshold = 2, 6, 10.0
        args.settle_s = 0.0       # a 4 s run has no steady state: the column is the whole run here
    model_dir = prepare_model(args)
    if not knobs.INTERNAL_TOKEN.get():    # one token for every profile's stack: the fused stats route needs it
        os.environ[knobs.INTERNAL_TOKEN.name] = secrets.token_hex(16)
    results = {}
    for name in args.profiles.split(","):
        try:
            results[name] = run_profile(name, model_dir, args, measure_for(name, args))
        except Exception as e:
            results[name] = {"error": repr(e)}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "by_kind"}), flush=True)
    text = table(results, args)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    write_json(args, results)
    failed = [n for n, r in results.items() if "error" in r or r["count_5xx"] or not r["cache"]["reused_steps"]]
    for name in failed:
        print(f"FAIL {name}: " + (results[name].get("error") or "5xx or the step cache reused nothing"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
