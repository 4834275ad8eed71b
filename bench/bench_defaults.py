"""The serving defaults of issue 25 through the public API, today's defaults ("before") beside the new ones
("after"), one `u1serve up` stack per side (full-size geometry, random weights; one GPU: profile colocate-1):

  - startup_s: `u1serve up` to /health 200 (the new side also warms every size of the size table);
  - per size of the size table (services/contract/limits.py SIZE_TABLE, or --sizes): the first request of the size
    after ready, then a second one (steady): end-to-end seconds, their ratio (target <= 1.2), and the median step
    time (gaps between progress events) — before runs eager, after with CUDA graphs (on by default), so the
    steady step times of 1024² and 2048² are graphs off vs on;
  - pair: two concurrent 2048² CFG requests against one alone; `pair_ratio` = together / (2 x alone): above 1,
    running them concurrently was slower than one after the other (before: the 16,384-row budget batches them;
    after: 8,192 rows, they run in turns);
  - applied / applied_cached: what a short request's `applied` says, without and with a first-block step cache
    (graphs / fp8 / the cache took effect);
  - api_targets (--api-targets): issue 25's latency targets through the API, each request twice (table);
  - warmup / kv_pool: generation's /health after ready: the warm-up per size, and whether the shm KV pool was
    attached (pinned) and its import kernel warmed before ready (else the first request pays it).

before = `--cuda-graphs off --gen-args '--warmup-table off --max-batch-tokens 16384'` (today's defaults),
after = no flags. Both sides get --up-args (default in bench/gpu_defaults.sh: --quantization fp8).

GPU (1 H200): bash bench/gpu_defaults.sh   (python -m bench.bench_defaults --profiles colocate-1 ...)
CPU smoke:    python -m bench.bench_defaults --tiny --profiles cpu-separate-cfg2-sp2 --sides after --sizes 64x64 \\
                --pair-size 64x64 --steps 2 --up-args "--default-size 64x64 --quantization fp8"
              (separate placement, CFG-parallel, SP and fp8 in one stack: tests/bench/test_bench_defaults.py also
              checks there that `applied` reports each option as it ran)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from bench.bench_deployment import image_request
from bench.stack import prepare_model, run_profile, stack_args, write_json
from services.contract.limits import SIZE_TABLE

SIDES = {"before": "--cuda-graphs off --gen-args '--warmup-table off --max-batch-tokens 16384'", "after": ""}


async def image(client: httpx.AsyncClient, size: str, steps: int, seed: int) -> dict:
    """One streamed CFG request: end-to-end seconds and the median gap between progress events."""
    r = await image_request(client, size, steps, seed)
    return {"e2e_s": round(r["e2e_s"], 4), "step_s": r["step_s"] and round(r["step_s"], 5)}


async def engine_warm_start(client: httpx.AsyncClient) -> tuple[dict, dict]:
    """The generation engine's /health "warmup" (sizes, seconds, per size) and "kv_pool" (whether the shm KV pool
    was attached before ready, and how long it took), through the URL the gateway probes."""
    gen = (await client.get("/health")).json()["generation"][0]["url"]
    r = await client.get(gen + "/health")
    if r.status_code != 200:
        return {"unavailable": r.status_code}, {"unavailable": r.status_code}
    return r.json().get("warmup"), r.json().get("kv_pool")


CACHE = {"mode": "first_block", "threshold": 10.0, "warmup_steps": 1}   # reuses on every step after the first


async def applied(client: httpx.AsyncClient, size: str, cache: dict | None = None) -> dict:
    body = {"prompt": "a fox", "size": size, "num_inference_steps": 4, "guidance_scale": 4.0, "seed": 1}
    r = await client.post("/v1/images/generations", json=body if cache is None else {**body, "cache": cache})
    if r.status_code != 200:
        raise RuntimeError(f"image request failed: {r.status_code} {r.text[:300]}")
    return r.json()["data"][0].get("applied") or {}


# issue 25's latency targets through the API (exact settings, no step cache): (size, steps, guidance, target s)
API_TARGETS = (("1024x1024", 8, 1.0, 0.30), ("2048x2048", 8, 1.0, 0.80), ("2048x2048", 50, 4.0, 7.0))


async def api_targets(client: httpx.AsyncClient) -> list[dict]:
    """Each target's request twice, not streamed (the b64 PNG in one response, as most clients ask): the second
    is the figure (the first may pay a composition's first eager step and graph capture like every request)."""
    out = []
    for size, steps, guidance, target in API_TARGETS:
        body = {"prompt": "a lighthouse at dusk", "size": size, "num_inference_steps": steps,
                "guidance_scale": guidance, "seed": 5}
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            r = await client.post("/v1/images/generations", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"image request failed: {r.status_code} {r.text[:300]}")
            times.append(round(time.perf_counter() - t0, 4))
        out.append({"size": size, "steps": steps, "guidance": guidance, "target_s": target, "first_s": times[0],
                    "e2e_s": times[1], "met": times[1] <= target,
                    "applied": r.json()["data"][0].get("applied") or {}})
    return out


async def measure(base: str, args) -> dict:
    out: dict = {"sizes": {}}
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800, connect=10)) as c:
        out["warmup"], out["kv_pool"] = await engine_warm_start(c)
        for i, size in enumerate(args.sizes.split(",")):
            first = await image(c, size, args.steps, 100 + i)
            steady = await image(c, size, args.steps, 200 + i)
            out["sizes"][size] = {"first": first, "steady": steady,
                                  "first_over_steady": round(first["e2e_s"] / steady["e2e_s"], 3)}
        alone = await image(c, args.pair_size, args.steps, 300)
        t0 = time.perf_counter()
        both = await asyncio.gather(*(image(c, args.pair_size, args.steps, seed) for seed in (301, 302)))
        together = time.perf_counter() - t0
        out["pair"] = {"size": args.pair_size, "alone_s": alone["e2e_s"], "together_s": round(together, 4),
                       "each_s": [b["e2e_s"] for b in both], "pair_ratio": round(together / (2 * alone["e2e_s"]), 3)}
        out["applied"] = await applied(c, args.pair_size)
        out["applied_cached"] = await applied(c, args.pair_size, CACHE)
        if args.api_targets:
            out["api_targets"] = await api_targets(c)
    return out


def table(results: dict, args) -> str:
    rows = [f"Serving defaults through the API ({args.steps} steps, CFG 4; up-args: {args.up_args or 'none'})", "",
            "| side | startup s | size | first s | steady s | first/steady | steady s/step |",
            "|---|---:|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'][:100]} | | | | | |")
            continue
        for size, s in r["sizes"].items():
            rows.append(f"| {name} | {r['startup_s']:.1f} | {size} | {s['first']['e2e_s']:.3f} | "
                        f"{s['steady']['e2e_s']:.3f} | {s['first_over_steady']:.2f} | {s['steady']['step_s']} |")
    rows += ["", "| side | KV pool attached before ready | attach s | import warm-up s |", "|---|---|---:|---:|"]
    for name, r in results.items():
        k = r.get("kv_pool") or {}
        if "error" not in r:
            rows.append(f"| {name} | {k.get('before_ready')} | {k.get('seconds')} | {k.get('warm_import_seconds')} |")
    rows += ["", "| side | pair size | one alone s | two together s | together / (2 x alone) | applied |",
             "|---|---|---:|---:|---:|---|"]
    for name, r in results.items():
        if "error" not in r:
            p = r["pair"]
            rows.append(f"| {name} | {p['size']} | {p['alone_s']:.3f} | {p['together_s']:.3f} | "
                        f"{p['pair_ratio']:.3f} | {json.dumps(r['applied'])} |")
    if any("api_targets" in r for r in results.values()):
        rows += ["", "| side | request (exact, no step cache) | first s | second s | target s | met | applied |",
                 "|---|---|---:|---:|---:|---|---|"]
        for name, r in results.items():
            for t in r.get("api_targets") or ():
                rows.append(f"| {name} | {t['size']}, {t['steps']} steps, guidance {t['guidance']:g} | {t['first_s']:.3f} "
                            f"| {t['e2e_s']:.3f} | {t['target_s']:.2f} | {'yes' if t['met'] else 'no'} | "
                            f"{json.dumps(t['applied'])} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1")
    p.add_argument("--sides", default="before,after", help=f"which defaults: {', '.join(SIDES)}")
    p.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZE_TABLE))
    p.add_argument("--pair-size", default="2048x2048")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per request (a fixed first-request cost "
                                                         "weighs more at fewer steps: 20 is stricter than 50)")
    p.add_argument("--api-targets", action="store_true",
                   help="also time issue 25's latency targets (1024² 8 steps, 2048² 8 steps guidance 1, 2048² 50 "
                        "steps CFG 4), each twice, not streamed")
    args = p.parse_args()
    model_dir = prepare_model(args)
    results, common = {}, args.up_args
    for side in args.sides.split(","):
        for profile in args.profiles.split(","):
            name = f"{profile}.{side}"
            args.up_args = f"{common} {SIDES[side]}".strip()
            try:
                results[name] = run_profile(profile, model_dir, args, measure, label=name)
                results[name]["up_args"] = args.up_args
            except Exception as e:
                results[name] = {"error": repr(e)}
            print(name, json.dumps(results[name]), flush=True)
    args.up_args = common
    print(table(results, args))
    write_json(args, results)
    sys.exit(1 if any("error" in r for r in results.values()) else 0)


if __name__ == "__main__":
    main()
