"""Interleaved answers (chat `modalities: ["text", "image"]`) through the whole stack: time per image of a
3-image answer against a plain text-to-image request of the same size and steps, on the same stack.

The answer is forced to draw at once (logit_bias +100 on `<img>`, `max_images` 3), so it is three images back to
back: per image, one text segment (the prefix cache holds the conversation; the previous image is re-encoded into
cond and tu) + the prefix export of its CFG branches + the denoise + the float image back into the KV pool. The
overhead per image against T2I is what interleaving costs. Random weights (config-only checkpoint), as
bench_deployment.py.

GPU (1 H200, 8B geometry): python -m bench.bench_interleave --profiles colocate-1 --size 1024x1024
CPU smoke run:            python -m bench.bench_interleave --tiny --profiles cpu-colocate --size 64x64 --steps 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from bench.stack import exit_status, prepare_model, profile_table, run_all, stack_args
from services.kit import sse


async def t2i(client, args, seed: int) -> float:
    body = {"prompt": f"a lighthouse at dusk, {seed}", "size": args.size, "num_inference_steps": args.steps,
            "guidance_scale": 4.0, "seed": seed}
    t0 = time.perf_counter()
    r = await client.post("/v1/images/generations", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"T2I failed: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t0


async def answer(client, args, seed: int) -> dict:
    """One forced 3-image answer: when each image arrived, when its denoising started (first progress)."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"Show me three lighthouses, {seed}"}],
            "modalities": ["text", "image"], "stream": True, "max_tokens": 16,
            "logit_bias": {str(args.img_token): 100},
            "image_config": {"size": args.size, "num_inference_steps": args.steps, "guidance_scale": 4.0,
                             "image_guidance_scale": 1.0, "max_images": args.images, "seed": seed}}
    t0 = time.perf_counter()
    images, first_step = [], []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"interleaved answer failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for ev in sse.aevents(r.aiter_lines()):
            if "error" in ev:
                raise RuntimeError(f"interleaved answer error: {ev}")
            delta = (ev.get("choices") or [{}])[0].get("delta", {})
            now = time.perf_counter() - t0
            if "image_progress" in delta and len(first_step) == len(images):
                first_step.append(now)
            if delta.get("images"):
                images.append(now)
    if len(images) != args.images:
        raise RuntimeError(f"the answer had {len(images)} images, expected {args.images}")
    per_image = [b - a for a, b in zip([0.0] + images, images)]
    # text segment + prefix export (+ re-encode) before each image's denoising
    lead = [s - a for a, s in zip([0.0] + images, first_step)]
    return {"total_s": images[-1], "per_image_s": per_image, "before_denoise_s": lead}


def make_measure(args):
    async def measure(base: str, _args) -> dict:
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800.0)) as client:
            await t2i(client, argparse.Namespace(size="256x256", steps=2), 0)      # warm-up
            plain = [await t2i(client, args, 10 + i) for i in range(args.requests)]
            answers = [await answer(client, args, 20 + i) for i in range(args.requests)]
        per_image = [s for a in answers for s in a["per_image_s"]]
        lead = [s for a in answers for s in a["before_denoise_s"]]
        t2i_s = statistics.median(plain)
        return {"t2i_s": t2i_s, "interleave_per_image_s": statistics.median(per_image),
                "interleave_answer_s": statistics.median(a["total_s"] for a in answers),
                "before_denoise_s": statistics.median(lead),
                "overhead_per_image_s": statistics.median(per_image) - t2i_s, "answers": answers, "t2i": plain}
    return measure


def table(results: dict, args) -> str:
    return profile_table(
        f"{args.images}-image interleaved answer vs text-to-image, {args.size}, {args.steps} steps, CFG 4 "
        f"(2 branches), median of {args.requests}.",
        ["profile", "T2I s", "interleave s / image", "overhead s / image", "segment + prefix before denoise s",
         "answer s"], results,
        lambda r: [f"{r['t2i_s']:.2f}", f"{r['interleave_per_image_s']:.2f}", f"{r['overhead_per_image_s']:+.2f}",
                   f"{r['before_denoise_s']:.2f}", f"{r['interleave_answer_s']:.2f}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--images", type=int, default=3)
    p.add_argument("--requests", type=int, default=2, help="T2I requests and answers (medians)")
    args = p.parse_args()
    model_dir = prepare_model(args)
    from services.model.tokenizer import NeoTokenizer
    args.img_token = NeoTokenizer.from_dir(model_dir).img_start_id
    sys.exit(exit_status(run_all(args, model_dir, make_measure(args), table)))


if __name__ == "__main__":
    main()
