"""What bench_generation's step measurement and its speed-option parts (genperf_parts, genperf_formats) share:
the random model, a job spec, admitting a job with random prefix KV, and timing single engine steps."""
from __future__ import annotations

import time

import torch

from services.contract.image import GenerateRequest, SamplerParams
from services.generation.engine import Engine
from services.model.tiny import build_random_model, full_config, tiny_config


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, device, dtype):
    config = tiny_config("u1") if args.tiny else full_config(args.variant)
    model = build_random_model(config, "gen", dtype, device)
    if getattr(args, "quantization", "none") == "fp8":
        from services.model.quant import check_fp8_device, quantize_model
        check_fp8_device(device, dtype)
        quantize_model(model, ("gen",))
    return model


PREFIX = {"cond": 365, "uncond": 9}
OTHER_PREFIX = {"cond": 517, "uncond": 23}   # a prompt length no warm-up used


def spec(rid: str, size: int, steps: int, guidance: float, cache: dict | None = None) -> GenerateRequest:
    branches = SamplerParams(guidance_scale=guidance).branches()
    return GenerateRequest(request_id=rid, handles={b: {} for b in branches}, mode="t2i", width=size,
                           height=size, n=1, num_inference_steps=steps, guidance_scale=guidance, seed=0,
                           cache=cache)


def prefix_kv(model, lengths: dict[str, int], device, dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {b: torch.randn((model.num_layers, 2, n, model.num_kv_heads, model.head_dim),
                           generator=g, device=device).to(dtype) for b, n in lengths.items()}


def admit(engine: Engine, sp: GenerateRequest, prefix: dict[str, int] = PREFIX):
    lengths = {b: prefix[b] for b in sp.handles}
    job = engine.admit_local(sp, prefix_kv(engine.model, lengths, engine.device, engine.dtype), lengths)
    engine.add(job)
    return job


def step_times(engine: Engine, sp: GenerateRequest, warmup: int, steps: int,
               prefix: dict[str, int] = PREFIX) -> list[float]:
    """Seconds of `steps` single steps after `warmup` (sp must have more steps than both)."""
    job = admit(engine, sp, prefix)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        sync(engine.device)
        t0 = time.perf_counter()
        engine.step()
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    engine.abort(job.request_id)
    return times


def bench_sizes(args) -> list[int]:
    return [args.size] if args.tiny else [int(x) for x in args.sizes.split(",")]


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
