"""Whole-stack benchmark through the public HTTP API, one deployment profile after another.

Each profile is a `u1serve up` command line; the stack serves a full-size geometry with random weights
(config-only checkpoint + U1SERVE_RANDOM_WEIGHTS=1). Per profile, as a client sees it:
  - image: N sequential T2I requests (size, steps, CFG 4): end-to-end seconds and seconds per step
    (median gap between consecutive progress events);
  - chat: K concurrent streaming chats, inter-token latency (median / p90 gap between content chunks),
    alone and while M image requests run (the case for `separate`: image jobs must not slow text).

GPU (2 H200): python bench/bench_deployment.py --profiles colocate-tp2-cfg2,separate-1+1
GPU (2 H200), colocate QoS: --profiles colocate-tp2-cfg2-yield (image s/step is also measured
  while the chats run: the progress gaps of the loading image requests inside the chat window)
GPU (2 H200), colocate under MPS (`u1serve up` runs the MPS daemon; generation capped at 85 % of the SMs, more
  or less with --up-args "--gen-sm-percent P"): --profiles colocate-tp2-cfg2,colocate-tp2-cfg2-mps (1 GPU:
  colocate-1,colocate-1-mps); generation's MPS priority low (the default) beside normal:
  --profiles colocate-tp2-cfg2-mps,colocate-tp2-cfg2-mps-normal
GPU (4 H200): python bench/bench_deployment.py --profiles separate-tp2-cfg2,colocate-tp2-cfg2
CPU smoke run: python bench/bench_deployment.py --tiny --profiles cpu-colocate,cpu-separate \\
                 --size 64x64 --steps 2 --chat-tokens 8   (cpu-colocate-yield: the QoS wiring)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROFILES = {  # name -> u1serve up flags
    "colocate-tp2-cfg2": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2",
    "colocate-tp2-cfg2-yield": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 --qos-yield-share 0.5",
    "separate-tp2-cfg2": "--mode separate --und-gpus 0,1 --gen-gpus 2,3 --und-tp 2 --gen-cfg-parallel 2",
    "separate-1+1": "--mode separate --und-gpus 0 --gen-gpus 1",
    "colocate-1": "--mode colocate --und-gpus 0",
    "colocate-1-mps": "--mode colocate --und-gpus 0 --gpu-sharing mps",
    "colocate-tp2-cfg2-mps": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 --gpu-sharing mps",
    "colocate-tp2-cfg2-mps-normal": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 --gpu-sharing "
                                    "mps --gen-priority normal",
    "cpu-colocate": "--mode colocate --device cpu",
    "cpu-colocate-yield": "--mode colocate --device cpu --qos-yield-share 0.5",
    "cpu-separate": "--mode separate --device cpu",
}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def image_request(client, size: str, steps: int, seed: int) -> dict:
    body = {"prompt": f"a lighthouse at dusk, {seed}", "size": size, "num_inference_steps": steps,
            "guidance_scale": 4.0, "seed": seed, "stream": True}
    t0 = time.perf_counter()
    progress = []
    async with client.stream("POST", "/v1/images/generations", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"image request failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            kind = ev.get("type", "")
            if kind.endswith("progress"):
                progress.append(time.perf_counter())
            elif kind == "error" or "error" in ev and kind == "":
                raise RuntimeError(f"image stream error: {ev}")
    total = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(progress, progress[1:])]
    return {"e2e_s": total, "step_s": statistics.median(gaps) if gaps else None, "steps_seen": len(progress),
            "progress": progress}


def gaps_within(results: list[dict], t0: float, t1: float) -> list[float]:
    """Step gaps of image requests that lie inside [t0, t1] (while the chats ran)."""
    return [b - a for r in results for a, b in zip(r["progress"], r["progress"][1:]) if t0 <= a and b <= t1]


async def chat_stream(client, tokens: int, i: int) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": f"Tell a long story, number {i}."}],
            "max_tokens": tokens, "temperature": 0, "stream": True,
            # random weights over a byte-level tokenizer decode to little text: count tokens, not text
            "return_token_ids": True, "ignore_eos": True}
    stamps = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                ch = ev.get("choices") or [{}]
                if ch[0].get("token_ids") or ch[0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def chats(client, n: int, tokens: int) -> dict:
    gaps = sum(await asyncio.gather(*(chat_stream(client, tokens, i) for i in range(n))), [])
    if not gaps:
        raise RuntimeError("the chat streams returned no tokens")
    return {"itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p90_ms": 1e3 * pct(gaps, 0.9), "chunks": len(gaps)}


async def measure(base: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800.0)) as client:
        await image_request(client, "256x256", 2, 0)  # warm-up (kernels, graphs, allocator)
        await chats(client, 2, 8)
        singles = [await image_request(client, args.size, args.steps, 100 + i) for i in range(args.requests)]
        alone = await chats(client, args.chat_streams, args.chat_tokens)
        load = [asyncio.create_task(image_request(client, args.size, args.steps, 200 + i))
                for i in range(args.image_load)]
        await asyncio.sleep(args.load_delay)
        t0 = time.perf_counter()
        loaded = await chats(client, args.chat_streams, args.chat_tokens)
        t1 = time.perf_counter()
        during = gaps_within(await asyncio.gather(*load), t0, t1)
    return {"image": {"e2e_s": statistics.median(s["e2e_s"] for s in singles),
                      "step_s": statistics.median(s["step_s"] for s in singles if s["step_s"]),
                      "step_s_with_chat": statistics.median(during) if during else None},
            "chat_alone": alone, "chat_with_images": loaded}


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"u1serve up exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError("stack did not become healthy in time")


def run_profile(name: str, model_dir: str, args, port: int, measure=measure) -> dict:
    """Start the profile's stack, run `measure(base, args)` against it (async), stop it."""
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", model_dir, "--port", str(port),
           "--und-port", str(port + 1), "--gen-port", str(port + 2), "--host", "127.0.0.1",
           "--no-restart", "--run-dir", os.path.join(args.log_dir, name)] + PROFILES[name].split() + shlex.split(args.up_args)
    from services import knobs
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{knobs.RANDOM_WEIGHTS.name: "0" if args.tiny else "1"})
    log = open(os.path.join(args.log_dir, f"{name}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, args.startup_timeout)
        startup_s = time.time() - t0
        res = asyncio.run(measure(base, args))
        res["startup_s"] = startup_s
        res["command"] = "u1serve up " + PROFILES[name]
        return res
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def table(results: dict, args) -> str:
    rows = [f"Image: {args.size}, {args.steps} steps, CFG 4, one request at a time ({args.requests} requests, "
            f"median). Chat: {args.chat_streams} concurrent streams of {args.chat_tokens} tokens, alone and with "
            f"{args.image_load} concurrent image requests.", "",
            "| profile | s/step | s/step (load, while chats run) | image e2e s | chat ITL p50 / p90 ms (alone) | "
            "chat ITL p50 / p90 ms (with images) |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'][:80]} | | | | |")
            continue
        a, w = r["chat_alone"], r["chat_with_images"]
        during = r["image"].get("step_s_with_chat")
        during = f"{during:.3f}" if during else "n/a"
        rows.append(f"| {name} | {r['image']['step_s']:.3f} | {during} | {r['image']['e2e_s']:.2f} | "
                    f"{a['itl_p50_ms']:.1f} / {a['itl_p90_ms']:.1f} | {w['itl_p50_ms']:.1f} / {w['itl_p90_ms']:.1f} |")
    return "\n".join(rows)


def stack_args(p: argparse.ArgumentParser, profiles: str, port: int) -> None:
    """The flags of every whole-stack benchmark (this one, bench_interleave.py)."""
    p.add_argument("--profiles", default=profiles)
    p.add_argument("--variant", default="u1-8b", help="full-size config (random weights)")
    p.add_argument("--tiny", action="store_true", help="tiny checkpoint instead (CPU smoke run)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--up-args", default="", help="extra `u1serve up` flags for every profile (shell quoting), e.g. "
                        "--quantization fp8 --gen-args '--cache-mode first_block --cache-threshold 0.1'")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)


def prepare_model(args) -> str:
    """The checkpoint directory (tiny, or a full-size config with random weights) and the log directory."""
    sys.path.insert(0, ROOT)
    from services.model.tiny import write_full_config, write_tiny_checkpoint
    work = tempfile.mkdtemp(prefix="u1bench-")
    args.log_dir = args.log_dir or os.path.join(work, "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    model_dir = os.path.join(work, "model")
    (write_tiny_checkpoint(model_dir, "u1") if args.tiny else write_full_config(model_dir, args.variant))
    return model_dir


def run_all(args, model_dir: str, measure, table) -> dict:
    """Every profile in turn (a failed one is reported, the others still run); prints the table, writes --json."""
    results = {}
    for i, name in enumerate(args.profiles.split(",")):
        try:
            results[name] = run_profile(name, model_dir, args, args.port + 10 * i, measure)
        except Exception as e:
            results[name] = {"error": repr(e)}
        print(name, json.dumps(results[name]), flush=True)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-tp2-cfg2,separate-1+1", 18000)
    p.add_argument("--size", default="2048x2048")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--chat-streams", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--image-load", type=int, default=2)
    p.add_argument("--load-delay", type=float, default=3.0, help="seconds between image load and chats")
    args = p.parse_args()
    run_all(args, prepare_model(args), measure, table)


if __name__ == "__main__":
    main()
