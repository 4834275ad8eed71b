"""Both engines colocated on one GPU under a memory cap (`u1serve plan`'s settings), through the public API; with
`--mode separate`, each engine on a card of its own capped at the same size (two 24 GB cards, emulated on larger
ones by the allocator cap U1SERVE_GPU_MEMORY_FRACTION in both engines).

For each cap (--caps, GiB) and each format pair (understanding / generation) the plan says fits (memory_plan.py:
the largest image side, graphs on or off, the memory fractions that sum to the cap on this card): a `u1serve up
--mode colocate` stack (8B geometry, random weights), then in turn
    chat            a 32-token answer (s, tokens/s)
    image-A / -B    text to image at --sizes (e.g. 1024² and 2048²; a size over the plan's largest must be refused
                    with a 400 naming the limit: the gateway's --max-pixels)
    edit            an edit of a 512² input at the first size
    interleave      a short interleaved answer with one image at the first size
    over-budget     requests past the budget: a size over the limit, a prompt longer than understanding's KV cache,
                    four images of the largest size in one request; each must come back as a clear error or a
                    result, with every engine still up (same pids, /health 200): never an out-of-memory crash
The peak memory of each engine is sampled every 0.2 s over the run (nvidia-smi's per-process used memory, summed over
the service's process tree; on a CPU smoke run: resident memory), next to the plan's prediction.

    python -m bench.bench_memcap --caps 24,48 --json out.json                     # GPU (bench/gpu_memcap.sh)
    python -m bench.bench_memcap --mode separate --caps 24 --pairs bf16/bf16 --json out.json   # 2 GPUs
    python -m bench.bench_memcap --tiny --caps 2 --sizes 64,128 --steps 2 --json out.json   # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time

import httpx

from bench.bench_load import data_url, png
from bench.stack import exit_status, prepare_model, run_profile, stack_args, write_json
from services.kit import sse
from services.base import knobs
from services.model import memory_plan as M
from services.model.config import load_config
from services.launch.cli import plan_image_limits
from services.launch.mps import descendants

PAIRS = (("int8", "int8"), ("bf16", "int8"), ("bf16", "bf16"), ("fp8-only", "fp8-only"))


# ----------------------------------------------------------------------------------------- memory sampling
def _gpu_used() -> dict[int, int] | None:
    """pid -> bytes of GPU memory (nvidia-smi), None without a GPU."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = {}
    for line in text.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        out[int(pid)] = int(mib) * M.MiB
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler(threading.Thread):
    """Peak memory per service (its process tree) until stopped: GPU memory with a GPU, else resident memory."""

    def __init__(self, services: dict[str, int], gpu: bool):
        super().__init__(daemon=True)
        self.services, self.gpu, self.peak = services, gpu, {k: 0 for k in services}
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            used = _gpu_used() if self.gpu else None
            for name, pid in self.services.items():
                tree = [pid] + descendants(pid)
                n = sum(used.get(p, 0) for p in tree) if used is not None else sum(_rss(p) for p in tree)
                self.peak[name] = max(self.peak[name], n)
            self.stop_event.wait(0.2)

    def stop(self) -> dict[str, int]:
        self.stop_event.set()
        self.join(5)
        return dict(self.peak)


# ----------------------------------------------------------------------------------------- requests
async def _timed(coro) -> dict:
    t0 = time.perf_counter()
    try:
        out = await coro
    except Exception as e:         # a failed request is a result (the table says what came back)
        out = {"status": "error", "error": repr(e)[:300]}
    out["s"] = round(time.perf_counter() - t0, 3)
    return out


def _result(r: httpx.Response) -> dict:
    if r.status_code == 200:
        return {"status": 200}
    try:
        err = r.json().get("error", {})
    except ValueError:
        err = {"message": r.text[:300]}
    return {"status": r.status_code, "code": err.get("code"), "message": str(err.get("message"))[:300]}


async def chat(c: httpx.AsyncClient, tokens: int = 32, prompt: str = "Describe a lighthouse.") -> dict:
    r = await c.post("/v1/chat/completions", json={"model": "m", "max_tokens": tokens, "temperature": 0,
                                                   "messages": [{"role": "user", "content": prompt}]})
    out = _result(r)
    if r.status_code == 200:
        out["completion_tokens"] = r.json()["usage"]["completion_tokens"]
    return out


async def image(c, size: int, steps: int, n: int = 1) -> dict:
    return _result(await c.post("/v1/images/generations", json={
        "prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "n": n, "num_inference_steps": steps,
        "guidance_scale": 4.0, "seed": 1}))


async def edit(c, size: int, steps: int) -> dict:
    return _result(await c.post("/v1/images/edits", json={
        "prompt": "make it blue", "image": [data_url(png(512, 512))], "size": f"{size}x{size}",
        "num_inference_steps": steps, "seed": 1}))


async def interleave(c, size: int, steps: int, img_token: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "Show me a lighthouse"}],
            "modalities": ["text", "image"], "stream": True, "max_tokens": 16, "logit_bias": {str(img_token): 100},
            "image_config": {"size": f"{size}x{size}", "num_inference_steps": steps, "guidance_scale": 4.0,
                             "image_guidance_scale": 1.0, "max_images": 1, "seed": 1}}
    images, error = 0, None
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _result(r)
        async for ev in sse.aevents(r.aiter_lines()):
            if "error" in ev:
                error = ev["error"]
            delta = (ev.get("choices") or [{}])[0].get("delta", {})
            images += len(delta.get("images") or [])
    return {"status": 200 if images and not error else "error", "images": images, "error": error}


async def engines_up(c, und: str, gen: str, pids: dict) -> bool:
    for url in (und, gen):
        try:
            if (await c.get(url + "/health")).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
    return all(os.path.exists(f"/proc/{p}") for p in pids.values())


def measure_fn(args, setting: dict):
    async def measure(base: str, _args) -> dict:
        run_dir = os.path.join(args.log_dir, setting["label"])
        with open(os.path.join(run_dir, "stack.json")) as f:
            state = json.load(f)
        pids = {k: v["pid"] for k, v in state["services"].items() if k != "gateway"}
        urls = {k: v.rsplit("/health", 1)[0] for k, v in {   # fused: the engines' servers inside the one process
            **{k: v["health_url"] for k, v in state["services"].items()},
            **(state.get("colocate_engines") or {}).get("health_urls", {})}.items()}
        sampler = PeakSampler(pids, gpu=not args.tiny)
        sampler.start()
        side, steps, (a, b) = setting["side"], args.steps, args.sizes
        a = min(a, side)    # image A, the edit and the interleave at the plan's largest side when that is smaller
        res = {}
        async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout) as c:
            res["chat"] = await _timed(chat(c))
            if res["chat"].get("completion_tokens"):
                res["chat"]["tokens_per_s"] = round(res["chat"]["completion_tokens"] / res["chat"]["s"], 1)
            for size in (a, b):
                res[f"image-{size}"] = await _timed(image(c, size, steps))
                res[f"image-{size}"]["expect"] = 200 if size <= side else 400
                res[f"image-{size}"]["s_per_step"] = round(res[f"image-{size}"]["s"] / steps, 4)
            res["edit"] = await _timed(edit(c, a, steps))
            res["interleave"] = await _timed(interleave(c, a, steps, args.img_token))
            over = {}
            over["size-over-limit"] = await _timed(image(c, side + 512, steps))
            kv = (await c.get(urls.get("und", base) + "/health")).json().get("kv_total") or 0
            over["prompt-over-kv"] = await _timed(chat(c, 4, "lighthouse " * (kv // 11 + 64)))
            over["prompt-over-kv"]["kv_total"] = kv
            over["four-largest"] = await _timed(image(c, min(side, b), steps, n=4))
            res["over_budget"] = over
            res["engines_up_after"] = await engines_up(c, urls.get("und", base), urls.get("gen", base), pids)
        res["peak_bytes"] = sampler.stop()
        res["plan_bytes"] = setting["plan_bytes"]
        return res
    return measure


# ----------------------------------------------------------------------------------------- settings
def settings(args, model_dir: str, total: int) -> list[dict]:
    """Per cap, the format pairs the plan says fit (each at its largest side; graphs as the plan needs)."""
    cfg = load_config(model_dir)
    weights = {b: M.branch_weights(cfg, b) for b in ("und", "gen")}
    from services.contract.limits import IMAGE_BLOCK
    from services.generation.image_limits import max_image_tokens
    top = int(max_image_tokens(cfg) ** 0.5) * IMAGE_BLOCK
    itemsize = 4 if args.tiny else 2
    from services.fused.launch import DEVICE_POOL_GB
    out = []
    for cap in args.caps:
        budget = int(cap * M.GiB)
        for und_f, gen_f in args.pairs:
            s = M.Settings(images=plan_image_limits(), und_format=und_f, gen_format=gen_f, max_image_side=top,
                           itemsize=itemsize,
                           kv_pool_gb=(0.25 if args.tiny else DEVICE_POOL_GB if args.engines == "fused"
                                       else 16.0), engines=args.engines,
                           context_bytes=0 if args.tiny else M.CUDA_CONTEXT_BYTES,
                           streaming_fallback=0)    # resident plans here; bench_weight_streaming.py measures streaming
            found = M.plan(cfg, s, budget, args.mode, weights)
            p = found["asked"] if found["asked"].fits else found["fix"]
            label = f"cap{cap:g}-{und_f}-{gen_f}" + ("-fused" if args.engines == "fused" else "") + \
                ("-separate" if args.mode == "separate" else "")
            if p is None or (p.settings.und_format, p.settings.gen_format) != (und_f, gen_f):
                out.append({"label": label, "cap_gib": cap, "pair": [und_f, gen_f], "fits": False,
                            "why": found["asked"].why})
                continue
            env, argv = M.up_flags(p, total)
            if args.mode == "separate" and total:    # each card capped at the budget: both engines' allocator cap
                env[knobs.GPU_MEMORY_FRACTION.name] = f"{(budget - p.und.parts['cuda_context']) / total:.3f}"
            if args.tiny:    # a CPU stack: no fractions (nothing to cap), the plan's limit on images all the same
                argv = argv[:argv.index("--gen-memory-fraction")] if "--gen-memory-fraction" in argv else argv
            out.append({"label": label, "cap_gib": cap, "pair": [und_f, gen_f], "fits": True, "side": p.side,
                        "mode": args.mode,
                        "graphs": p.settings.cuda_graphs, "env": env, "argv": argv,
                        "plan_bytes": {"und": p.und.total, "gen": p.gen.total, "process": sum(p.process.values())}})
    return out


def card_total(tiny: bool) -> int | None:
    if tiny:
        return None
    text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                          capture_output=True, text=True, timeout=10).stdout
    return int(text.strip().splitlines()[0]) * M.MiB


def table(results: dict) -> str:
    lines = ["| cap | und / gen | largest | peak und GiB (plan) | peak gen GiB (plan) | chat tok/s | image A s/step "
             "| image B s/step | edit s | interleave s | over-budget (status) | engines up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        st = r["setting"]
        head = f"| {st['cap_gib']:g} GiB | {st['pair'][0]} / {st['pair'][1]} "
        if not st["fits"]:
            lines.append(head + f"| does not fit ({st.get('why', '')}) |" + " |" * 9)
            continue
        if "error" in r:
            lines.append(head + f"| {st['side']} | FAILED: {r['error'][:120]} |" + " |" * 8)
            continue
        pk, pl = r["peak_bytes"], r["plan_bytes"]
        if st.get("mode") == "separate":
            head = f"| {st['cap_gib']:g} GiB per card, separate | {st['pair'][0]} / {st['pair'][1]} "
        a, b = (k for k in r if k.startswith("image-"))
        over = ", ".join(f"{k} {v.get('status')}" for k, v in r["over_budget"].items())
        und_cell = (f"{M.gib(pk.get('und', 0))} ({M.gib(pl['und'])})" if "fused" not in pk else
                    f"fused process {M.gib(pk['fused'])} ({M.gib(pl['und'] + pl['gen'] + pl.get('process', 0))})")
        gen_cell = f"{M.gib(pk.get('gen', 0))} ({M.gib(pl['gen'])})" if "fused" not in pk else "(in the fused process)"
        lines.append(head + f"| {st['side']} | {und_cell} | {gen_cell} | {r['chat'].get('tokens_per_s', '-')} | "
                     f"{r[a]['s_per_step'] if r[a].get('status') == 200 else r[a].get('status')} | "
                     f"{r[b]['s_per_step'] if r[b].get('status') == 200 else r[b].get('status')} | "
                     f"{r['edit']['s']} ({r['edit'].get('status')}) | {r['interleave']['s']} "
                     f"({r['interleave'].get('status')}) | {over} | {r['engines_up_after']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1")
    p.add_argument("--caps", default="24,48", help="GiB, comma separated")
    p.add_argument("--pairs", default=",".join(f"{a}/{b}" for a, b in PAIRS), help="und/gen formats to try")
    p.add_argument("--sizes", default="1024,2048")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--mode", choices=["colocate", "separate"], default="colocate",
                   help="separate: each engine on a GPU of its own (2 GPUs), both capped at the cap")
    p.add_argument("--engines", choices=["processes", "fused"], default="processes",
                   help="colocate: two processes, or both engines in one (--colocate-engines fused: the KV pool in "
                        "device memory, peak memory per process: the fused column holds both engines)")
    args = p.parse_args()
    args.caps = [float(x) for x in args.caps.split(",")]
    args.pairs = [tuple(x.split("/")) for x in args.pairs.split(",")]
    args.sizes = [int(x) for x in args.sizes.split(",")]
    model_dir = prepare_model(args)
    from services.model.tokenizer import NeoTokenizer
    args.img_token = NeoTokenizer.from_dir(model_dir).img_start_id
    if args.mode == "separate" and args.engines == "fused":
        p.error("--engines fused is a colocate mode")
    profile = {("colocate", True): "cpu-colocate", ("colocate", False): "colocate-1",
               ("separate", True): "cpu-separate", ("separate", False): "separate-1+1"}[(args.mode, args.tiny)]
    base_up = args.up_args
    results = {}
    for st in settings(args, model_dir, card_total(args.tiny)):
        if not st["fits"]:
            results[st["label"]] = {"setting": st}
            continue
        args.up_args = f"{base_up} {shlex.join(st['argv'])}"
        saved = {k: os.environ.get(k) for k in st["env"]}
        os.environ.update(st["env"])
        try:
            results[st["label"]] = {"setting": st, **run_profile(profile, model_dir, args, measure_fn(args, st),
                                                                 st["label"])}
        except Exception as e:
            results[st["label"]] = {"setting": st, "error": repr(e)}
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        print(st["label"], json.dumps(results[st["label"]], default=str)[:2000], flush=True)
    print(table(results))
    write_json(args, results)
    sys.exit(exit_status(results))


if __name__ == "__main__":
    main()
