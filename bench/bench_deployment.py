"""Whole-stack benchmark through the public HTTP API, one deployment profile after another.

Each profile is a `u1serve up` command line; the stack serves a full-size geometry with random weights
(config-only checkpoint + U1SERVE_RANDOM_WEIGHTS=1). Per profile, as a client sees it:
  - image: N sequential T2I requests (size, steps, CFG 4): end-to-end seconds and seconds per step
    (median gap between consecutive progress events);
  - chat: K concurrent streaming chats, inter-token latency (median / p90 gap between content chunks),
    alone and while M image requests run, each client's next one as soon as the last ends, from before the chats
    start until they end (the case for `separate`: image jobs must not slow text).

GPU (2 H200): python -m bench.bench_deployment --profiles colocate-tp2-cfg2,separate-1+1
GPU (2 H200), colocate QoS: --profiles colocate-tp2-cfg2-yield (image s/step is also measured
  while the chats run: the progress gaps of the loading image requests inside the chat window)
GPU (2 H200), colocate under MPS (`u1serve up` runs the MPS daemon; generation capped at 85 % of the SMs, more
  or less with --up-args "--gen-sm-percent P"): --profiles colocate-tp2-cfg2,colocate-tp2-cfg2-mps (1 GPU:
  colocate-1,colocate-1-mps); generation's MPS priority low (the default) beside normal:
  --profiles colocate-tp2-cfg2-mps,colocate-tp2-cfg2-mps-normal
GPU (4 H200): python -m bench.bench_deployment --profiles separate-tp2-cfg2,colocate-tp2-cfg2
CPU smoke run: python -m bench.bench_deployment --tiny --profiles cpu-colocate,cpu-separate \\
                 --size 64x64 --steps 2 --chat-tokens 8   (cpu-colocate-yield: the QoS wiring)
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from bench.stack import exit_status, prepare_model, profile_table, run_all, stack_args
from services.kit import sse


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def image_request(client, size: str, steps: int, seed: int, stepping: asyncio.Event | None = None) -> dict:
    """One streamed T2I request; `stepping` is set at its first progress event (its denoise steps run)."""
    body = {"prompt": f"a lighthouse at dusk, {seed}", "size": size, "num_inference_steps": steps,
            "guidance_scale": 4.0, "seed": seed, "stream": True}
    t0 = time.perf_counter()
    progress = []
    async with client.stream("POST", "/v1/images/generations", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"image request failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for ev in sse.aevents(r.aiter_lines()):
            kind = ev.get("type", "")
            if kind.endswith("progress"):
                progress.append(time.perf_counter())
                if stepping is not None:
                    stepping.set()
            elif kind == "error" or "error" in ev and kind == "":
                raise RuntimeError(f"image stream error: {ev}")
    total = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(progress, progress[1:])]
    return {"e2e_s": total, "step_s": statistics.median(gaps) if gaps else None, "steps_seen": len(progress),
            "progress": progress}


def has_token(ev: dict) -> bool:
    """A chat chunk that carries a token (random weights over a byte-level tokenizer decode to little text:
    count tokens, not text)."""
    ch = (ev.get("choices") or [{}])[0]
    return bool(ch.get("token_ids") or ch.get("delta", {}).get("content"))


def gaps_within(results: list[dict], t0: float, t1: float) -> list[float]:
    """Step gaps of image requests that overlap [t0, t1] (steps that ran while the chats did). Overlap, not lie
    inside: chats that end within one step of a slow host would otherwise leave no gap (the CI smoke under the
    suite's load, step_s_with_chat null, 2026-12-08)."""
    return [b - a for r in results for a, b in zip(r["progress"], r["progress"][1:]) if a < t1 and b > t0]


async def chat_stream(client, tokens: int, i: int) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": f"Tell a long story, number {i}."}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": True}
    stamps = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for ev in sse.aevents(r.aiter_lines()):
            if has_token(ev):
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def chats(client, n: int, tokens: int) -> dict:
    gaps = sum(await asyncio.gather(*(chat_stream(client, tokens, i) for i in range(n))), [])
    if not gaps:
        raise RuntimeError("the chat streams returned no tokens")
    return {"itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p90_ms": 1e3 * pct(gaps, 0.9), "chunks": len(gaps)}


async def image_load(client, args, seed: int, stepping: asyncio.Event, until: asyncio.Event) -> list[dict]:
    """Image requests one after another until `until` is set: the load lasts as long as the chats it is measured
    beside, however fast the host is (a fixed set of requests once finished before the chats began)."""
    done = []
    while not until.is_set():
        done.append(await image_request(client, args.size, args.steps, seed, stepping))
        seed += 1000
    return done


async def measure(base: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800.0)) as client:
        await image_request(client, "256x256", 2, 0)  # warm-up (kernels, graphs, allocator)
        await chats(client, 2, 8)
        singles = [await image_request(client, args.size, args.steps, 100 + i) for i in range(args.requests)]
        alone = await chats(client, args.chat_streams, args.chat_tokens)
        stepping, chats_over = asyncio.Event(), asyncio.Event()
        load = [asyncio.create_task(image_load(client, args, 200 + i, stepping, chats_over))
                for i in range(args.image_load)]
        started = asyncio.create_task(stepping.wait())   # the load's steps run: the chats start beside them
        await asyncio.wait([started, *load], return_when=asyncio.FIRST_COMPLETED)
        if not stepping.is_set():                  # a load request failed before any step: its error, not a hang
            started.cancel()
            for task in load:
                if task.done():
                    task.result()
        await asyncio.sleep(args.load_delay)
        t0 = time.perf_counter()
        loaded = await chats(client, args.chat_streams, args.chat_tokens)
        t1 = time.perf_counter()
        chats_over.set()
        during = gaps_within(sum(await asyncio.gather(*load), []), t0, t1)
    return {"image": {"e2e_s": statistics.median(s["e2e_s"] for s in singles),
                      "step_s": statistics.median(s["step_s"] for s in singles if s["step_s"]),
                      "step_s_with_chat": statistics.median(during) if during else None},
            "chat_alone": alone, "chat_with_images": loaded}


def table(results: dict, args) -> str:
    def row(r: dict) -> list[str]:
        a, w, during = r["chat_alone"], r["chat_with_images"], r["image"].get("step_s_with_chat")
        return [f"{r['image']['step_s']:.3f}", f"{during:.3f}" if during else "n/a", f"{r['image']['e2e_s']:.2f}",
                f"{a['itl_p50_ms']:.1f} / {a['itl_p90_ms']:.1f}", f"{w['itl_p50_ms']:.1f} / {w['itl_p90_ms']:.1f}"]
    return profile_table(
        f"Image: {args.size}, {args.steps} steps, CFG 4, one request at a time ({args.requests} requests, median). "
        f"Chat: {args.chat_streams} concurrent streams of {args.chat_tokens} tokens, alone and with "
        f"{args.image_load} concurrent image requests.",
        ["profile", "s/step", "s/step (load, while chats run)", "image e2e s", "chat ITL p50 / p90 ms (alone)",
         "chat ITL p50 / p90 ms (with images)"], results, row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-tp2-cfg2,separate-1+1")
    p.add_argument("--size", default="2048x2048")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--chat-streams", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--image-load", type=int, default=2)
    p.add_argument("--load-delay", type=float, default=3.0,
                   help="seconds between the image load's first step and the chats (the load then runs until they end)")
    args = p.parse_args()
    sys.exit(exit_status(run_all(args, prepare_model(args), measure, table)))


if __name__ == "__main__":
    main()
