"""Warm start: before the service reports ready, run a few denoising steps at the configured sizes.

The first step of a process pays for what later steps reuse: Triton JIT (norm, RoPE, SwiGLU, fp8
quantisation), cuBLAS / `_scaled_mm` kernel selection and lazy module loads per GEMM shape, cuDNN
attention execution plans, the caching allocator growing to the step's working set, the pinned host
buffer of the output copy. Per size the warm-up runs (local prefix KV of zeros, no pool) a CFG job
(2 branches: the GEMMs see 2N rows) and a guidance-1 job (N rows: the 8-step preset's shapes; with fp8
below `GemmPolicy.min_tokens` rows that is the model-dtype path), so the first request of either kind
runs at steady-state speed while /health is still 503. Every CFG rank runs the same jobs (their steps
are collective).

Attention plans: cuDNN builds one per (query length, key length) and keeps it in a thread-local cache,
so (1) this must run on the thread that later runs the steps, (2) a prompt length the warm-up did not
see builds a plan on its first step (~40 ms each at 2048², GPU run 1: first step 1.32x steady after a
warm-up whose prefix length differed from the request's). services/generation/attention.py turns on
torch's length-bucketed cuDNN plans (lengths rounded up to a power of two), so the one prefix length
here covers every prompt up to the image's own token count.

Every size of the size table (services/contract/limits.py SIZE_TABLE; on cuda by default) is warmed too,
with ONE step per branch count: what a first request of a size pays is per shape (Triton JIT / autotune,
cuBLAS and `_scaled_mm` selection, cuDNN plans, allocator growth), all of it paid by one eager step; a
second step would only capture CUDA graphs, which belong to a job and are captured again by every
request (H200 2026-12-01: the first 1024² 50-step request after a 2048²-only warm-up took 6.87 s vs 3.66 s
steady). The time each size took is reported (/health "warmup", metric u1_gen_warmup_size_seconds).

The jobs of 2+ steps ask for one preview (its downscale and pinned host copy are a request's too). What a first
request pays outside the steps is warmed elsewhere, once per process: the shm KV pool's attach (on CUDA the
whole 16 GiB segment is pinned) and the import kernel's JIT by kv_source.PrefixSource.open_before_ready
right after this warm-up (worker.py; H200 2026-12-02: 4.75 s first vs 3.39 s steady at 2048² without it), the
image encoders by encode.warm in the HTTP process.
"""
from __future__ import annotations

import time

import torch

from services.contract.image import BRANCH_ORDER, GenerateRequest

WARMUP_PREFIX_TOKENS = 64


def parse_sizes(*texts: str | None) -> list[tuple[int, int]]:
    """'2048x2048,1024x1024' (several strings allowed) -> [(w, h), ...] without repeats, in order."""
    out: list[tuple[int, int]] = []
    for text in texts:
        for item in (text or "").split(","):
            item = item.strip().lower()
            if not item:
                continue
            try:
                w, h = (int(v) for v in item.split("x"))
            except ValueError:
                raise ValueError(f"warm-up size must look like WIDTHxHEIGHT, got {item!r}") from None
            if w <= 0 or h <= 0 or w % 32 or h % 32:
                raise ValueError(f"warm-up size {item!r}: sides must be positive multiples of 32")
            if (w, h) not in out:
                out.append((w, h))
    return out


def warmup_job(width: int, height: int, steps: int, branches=BRANCH_ORDER[:2]) -> GenerateRequest:
    """One preview too (jobs of 2+ steps): its downscale and host copy are a first request's too."""
    return GenerateRequest(request_id=f"warmup-{width}x{height}-{len(branches)}",
                           handles={b: {} for b in branches}, mode="t2i", width=width, height=height, n=1,
                           num_inference_steps=steps, guidance_scale=4.0 if len(branches) > 1 else 1.0, seed=0,
                           partial_images=1)


def warmup_jobs(sizes: list[tuple[int, int]], steps: int) -> list[GenerateRequest]:
    """Per size: a CFG job, then a guidance-1 job (module doc)."""
    return [warmup_job(w, h, steps, branches) for w, h in sizes if steps > 0
            for branches in (BRANCH_ORDER[:2], BRANCH_ORDER[:1])]


def warmup_plan(sizes: list[tuple[int, int]], steps: int,
                table: list[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """[((w, h), steps)]: the configured sizes with `steps`, then the table's other sizes with one step
    (none at all with steps 0: --warmup-steps 0 turns the warm-up off)."""
    if steps <= 0:
        return []
    return [(s, steps) for s in sizes] + [(s, 1) for s in table if s not in sizes]


@torch.inference_mode()
def run_warmup(engine, sizes: list[tuple[int, int]], steps: int = 2, table=()) -> dict:
    """Run the warm-up jobs of `warmup_plan(sizes, steps, table)` through `engine`, one after the other
    (nothing else may be running). Returns {"sizes", "steps", "seconds", "per_size": {size: seconds}}."""
    t0 = time.perf_counter()
    per_size = {}
    plan = warmup_plan(sizes, steps, list(table))
    for (w, h), n in plan:
        t = time.perf_counter()
        _run_jobs(engine, warmup_jobs([(w, h)], n))
        per_size[f"{w}x{h}"] = round(time.perf_counter() - t, 3)
    return {"sizes": list(per_size), "steps": steps, "seconds": round(time.perf_counter() - t0, 3),
            "per_size": per_size}


def _run_jobs(engine, specs: list[GenerateRequest]) -> None:
    m = engine.model
    for spec in specs:
        kv = torch.zeros((m.num_layers, 2, WARMUP_PREFIX_TOKENS, m.num_kv_heads, m.head_dim),
                         device=engine.device, dtype=engine.dtype)
        job = engine.admit_local(spec, {b: kv for b in spec.handles},
                                 {b: WARMUP_PREFIX_TOKENS for b in spec.handles})
        engine.add(job)
        while not job.flow.done:
            engine.step()
        engine.pixels(job)
        job.free()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
