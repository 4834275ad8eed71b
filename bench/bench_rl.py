"""RL rollout benchmark through the public HTTP API (docs/benchmarks/rl.md), on one `u1serve up` stack:

1. rollout throughput: `POST /v1/rl/rollout`, P prompts x G samples with the Flow-GRPO SDE on every step but the
   last, per-step log-probs and the stored trajectory (plus fetching that trajectory, timed apart), against plain
   image generation of the same work in the same run: the same prompts, sizes and steps through
   `/v1/images/generations`, one request per prompt with n = G, the P requests concurrent; images/min each, for
   every size x steps case; and the same rollout without a stored trajectory (log-probs only), which tells the
   trajectory's cost (its host copies, the engine -> HTTP process crossing, the store) from the denoising's;
2. the shared group prefill: the same P x G rollout with the group's prefix prefilled once (group_size G) vs once
   per sample (each prompt listed G times, group_size 1): prefix count, prefill seconds and total seconds;
3. weight-update latency: a whole generation-branch update at the checkpoint's geometry (rl-weights'
   bench/bench_weight_update.py writes it) through `POST /v1/rl/weights`.

GPU, one H200 (random 8B weights: `u1serve tiny-checkpoint DIR --variant u1-8b` + U1SERVE_RANDOM_WEIGHTS=1):
    python -m bench.bench_rl --profiles colocate-1 --out /tmp/bench-rl
CPU smoke run (tiny checkpoint, a minute):
    python -m bench.bench_rl --tiny --profiles cpu-colocate --sizes 32 --steps 2 --group-size 2 --prompts 1 \\
        --repeat 1 --out DIR
Results: a markdown table on stdout and in DIR/bench_rl.md, every number in DIR/bench_rl.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import httpx

from bench.bench_weight_update import write_gen_update
from bench.bench_trajectory_fetch import fetch_raw
from bench.stack import enable_rl, exit_status, prepare_model, run_all, stack_args
from services.contract.limits import MAX_IMAGES_PER_REQUEST as MAX_IMAGES

PROMPTS = ["a red fox in the snow, watercolor", "a lighthouse at dusk, oil painting", "a bowl of ramen, photo",
           "a robot reading a book, pixel art", "a mountain lake at sunrise", "a cat in a spacesuit",
           "a city street in the rain, neon", "a field of sunflowers, impressionist"]


def _ok(r: httpx.Response) -> dict:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.url.path}: HTTP {r.status_code} {r.text[:400]}")
    return r.json()


def rollout_body(prompts: list[str], group: int, size: int, steps: int, seed: int, args,
                 trajectory: bool = True) -> dict:
    return {"prompts": [{"prompt": p} for p in prompts], "group_size": group, "size": f"{size}x{size}",
            "num_inference_steps": steps, "guidance_scale": args.guidance, "seed": seed,
            "sde": {"kind": "flow", "noise_level": 0.7}, "return_trajectory": trajectory, "return_images": True}


async def rollout_once(c: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    resp = _ok(await c.post("/v1/rl/rollout", json=body))
    t_roll = time.perf_counter() - t0
    t1 = time.perf_counter()
    nbytes = 0
    if body["return_trajectory"]:
        nbytes = await asyncio.to_thread(fetch_raw, str(c.base_url).rstrip("/"), resp["trajectory_id"])  # streamed
        await c.delete(f"/v1/rl/trajectories/{resp['trajectory_id']}")
    t_traj = time.perf_counter() - t1
    images = len(resp["samples"])
    assert all(s["image"] for s in resp["samples"]) and all(
        any(lp is not None for lp in s["logprobs"]) for s in resp["samples"])
    return {"seconds": t_roll, "trajectory_s": t_traj, "trajectory_mb": nbytes / 2 ** 20, "images": images,
            "prefill": resp["prefill"], "prefill_max_s": resp.get("timings", {}).get("prefill_max_s")}


async def plain_once(c: httpx.AsyncClient, prompts: list[str], group: int, size: int, steps: int, seed: int,
                     args) -> dict:
    async def one(i: int, p: str, first: int, n: int):
        return _ok(await c.post("/v1/images/generations", json={
            "prompt": p, "n": n, "size": f"{size}x{size}", "num_inference_steps": steps,
            "guidance_scale": args.guidance, "seed": seed + i * group + first, "response_format": "b64_json"}))
    # the images API takes n <= MAX_IMAGES a request: a group of G is ceil(G / MAX_IMAGES) concurrent requests
    chunks = [(i, p, k, min(MAX_IMAGES, group - k)) for i, p in enumerate(prompts) for k in range(0, group, MAX_IMAGES)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(*ch) for ch in chunks))
    images = sum(len(o["data"]) for o in outs)
    return {"seconds": time.perf_counter() - t0, "images": images}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


async def measure(base: str, args) -> dict:
    prompts = PROMPTS[:args.prompts]
    G = args.group_size
    out = {"throughput": [], "prefill": [], "weights": None}
    async with httpx.AsyncClient(base_url=base, timeout=3600) as c:
        for size in args.size_list:
            for steps in args.step_list:
                await plain_once(c, prompts[:1], 1, size, steps, 0, args)          # warm this shape
                await rollout_once(c, rollout_body(prompts[:1], 1, size, steps, 0, args))
                roll = [await rollout_once(c, rollout_body(prompts, G, size, steps, 100 + k, args))
                        for k in range(args.repeat)]
                plain = [await plain_once(c, prompts, G, size, steps, 100 + k, args) for k in range(args.repeat)]
                bare = [await rollout_once(c, rollout_body(prompts, G, size, steps, 100 + k, args, trajectory=False))
                        for k in range(args.repeat)]
                n = len(prompts) * G
                row = {"size": size, "steps": steps, "images": n,
                       "rollout_s": _median(roll, "seconds"), "plain_s": _median(plain, "seconds"),
                       "rollout_no_trajectory_s": _median(bare, "seconds"),
                       "trajectory_s": _median(roll, "trajectory_s"), "trajectory_mb": roll[0]["trajectory_mb"]}
                for key in ("rollout", "plain", "rollout_no_trajectory"):
                    row[f"{key}_img_per_min"] = 60 * n / row[f"{key}_s"]
                row["rollout_vs_plain"] = row["rollout_img_per_min"] / row["plain_img_per_min"]
                row["no_trajectory_vs_plain"] = row["rollout_no_trajectory_img_per_min"] / row["plain_img_per_min"]
                out["throughput"].append(row)
                print("throughput", json.dumps(row), flush=True)
        size, steps = args.size_list[0], args.step_list[0]
        shared = [await rollout_once(c, rollout_body(prompts, G, size, steps, 200 + k, args))
                  for k in range(args.repeat)]
        separate = [await rollout_once(c, rollout_body([p for p in prompts for _ in range(G)], 1, size, steps,
                                                       200 + k, args)) for k in range(args.repeat)]
        for name, runs in (("shared (one prefix per group)", shared), ("separate (one prefix per sample)", separate)):
            row = {"case": name, "size": size, "steps": steps, "images": runs[0]["images"],
                   "prefixes": runs[0]["prefill"]["prefixes"], "prefill_s": statistics.median(
                       r["prefill"]["seconds"] for r in runs), "rollout_s": _median(runs, "seconds"),
                   "prefill_max_s": statistics.median(r["prefill_max_s"] or 0.0 for r in runs)}
            out["prefill"].append(row)
            print("prefill", json.dumps(row), flush=True)
        walls, totals = [], []
        for k in range(args.repeat):
            t0 = time.perf_counter()
            body = _ok(await c.post("/v1/rl/weights", json={"path": args.update_dir, "version": f"bench-rl-{k}"}))
            walls.append(time.perf_counter() - t0)
            totals.append(body)
        out["weights"] = {"tensors": args.update_tensors, "gib": args.update_bytes / 2 ** 30,
                          "wall_s": statistics.median(walls),
                          "stage_s": statistics.median(b["stage_seconds"] for b in totals),
                          "commit_s": statistics.median(b["commit_seconds"] for b in totals),
                          "api_s": statistics.median(b["seconds"] for b in totals)}
        print("weights", json.dumps(out["weights"]), flush=True)
    return out


def table(results: dict, args) -> str:
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append(f"{name}: failed: {r['error'][:200]}")
            continue
        rows += [f"### {name} (`{r.get('command', '')}`)", "",
                 f"Rollout throughput: {args.prompts} prompts x G = {args.group_size}, guidance {args.guidance}, "
                 f"Flow-GRPO SDE on every step but the last, log-probs + stored trajectory; plain = the same prompts "
                 f"through /v1/images/generations (n = G per prompt, the prompts concurrent); without trajectory = the "
                 f"rollout with log-probs only; median of {args.repeat}.", "",
                 "| size | steps | images | rollout s | rollout img/min | plain s | plain img/min | rollout / plain "
                 "| without trajectory s | without trajectory / plain | trajectory fetch s (MB) |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for t in r["throughput"]:
            rows.append(f"| {t['size']}² | {t['steps']} | {t['images']} | {t['rollout_s']:.2f} | "
                        f"{t['rollout_img_per_min']:.1f} | {t['plain_s']:.2f} | {t['plain_img_per_min']:.1f} | "
                        f"{t['rollout_vs_plain']:.2f} | {t['rollout_no_trajectory_s']:.2f} | "
                        f"{t['no_trajectory_vs_plain']:.2f} | {t['trajectory_s']:.2f} ({t['trajectory_mb']:.1f}) |")
        rows += ["", "Group prefix prefill (the same rollout):", "",
                 "| case | size | steps | images | prefixes | prefill s (summed over prefixes) | slowest prefix s | "
                 "rollout s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for p in r["prefill"]:
            rows.append(f"| {p['case']} | {p['size']}² | {p['steps']} | {p['images']} | {p['prefixes']} | "
                        f"{p['prefill_s']:.3f} | {p['prefill_max_s']:.3f} | {p['rollout_s']:.2f} |")
        w = r["weights"]
        rows += ["", "Weight update (whole generation branch, `POST /v1/rl/weights`):", "",
                 "| tensors | GiB on disk | stage s | commit s | API total s | wall s |", "|---:|---:|---:|---:|---:|---:|",
                 f"| {w['tensors']} | {w['gib']:.2f} | {w['stage_s']:.2f} | {w['commit_s']:.2f} | {w['api_s']:.2f} | "
                 f"{w['wall_s']:.2f} |", ""]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1")
    p.add_argument("--sizes", default="512,1024", help="image sides, comma-separated")
    p.add_argument("--steps", default="10,20", help="step counts, comma-separated")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help=f"prompts per rollout (at most {len(PROMPTS)})")
    p.add_argument("--guidance", type=float, default=4.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", required=True, help="directory for bench_rl.md and bench_rl.json")
    args = p.parse_args()
    args.size_list = [int(s) for s in args.sizes.split(",")]
    args.step_list = [int(s) for s in args.steps.split(",")]
    args.prompts = min(args.prompts, len(PROMPTS))
    os.makedirs(args.out, exist_ok=True)
    args.json = os.path.join(args.out, "bench_rl.json")
    model_dir = prepare_model(args)
    args.update_dir = tempfile.mkdtemp(prefix="u1bench-rl-update-")
    enable_rl(args, args.update_dir)
    try:
        args.update_tensors, args.update_bytes = write_gen_update(model_dir, args.update_dir)
        results = run_all(args, model_dir, measure, table)
    finally:
        shutil.rmtree(args.update_dir, ignore_errors=True)
    with open(os.path.join(args.out, "bench_rl.md"), "w") as f:
        f.write(table(results, args) + "\n")
    sys.exit(exit_status(results))


if __name__ == "__main__":
    main()
