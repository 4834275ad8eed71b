"""Generation engine benchmark: denoising step time at full 8B geometry (random weights), prefix KV
import through the engine's admission path, and step-level batching.

GPU, one H200 (the real measurement):
    python -m bench.bench_generation
GPU, CFG-parallel over 2 H200 (one branch per GPU, velocities all-gathered):
    python -m bench.bench_generation --cfg-parallel 2
CPU smoke run (tiny geometry, seconds):
    python -m bench.bench_generation --device cpu --tiny --size 128 --steps 2

Speed options, each a part that runs alone (`--part`, torch only; see gpu_genperf.sh):
    --part fp8        single-branch step at --sizes: bf16 vs fp8 (serving GemmPolicy, every GEMM fp8,
                      fast accumulation), fp8-vs-bf16 velocity error, each layer GEMM by row count
                      (bf16 / fp8 / fast / quantiser), kernels vs torch bit for bit, GEMM vs emulation
    --part fp8-profile  torch.profiler of one single-branch step (--size), bf16 vs fp8: time by kernel
                      category and the top kernels (where a step's time goes)
    --part cache      whole-job time and computed steps vs first-block and TeaCache threshold (--thresholds)
    --part preset     the 8-step preset (guidance 1, 8 steps, shift 3): whole job, bf16 and fp8
    --part warmstart  first vs steady step of a fresh process, with (default) or without (--no-warmup)
                      the service's warm-up
    --part graphs     the denoise layer stack replayed from a CUDA graph vs eager (--sizes; guidance 1
                      and 4; bf16, fp8 at the largest size): s/step, speedup, final x bit-equal; two
                      jobs together; a cancel then a new job
    --part addnorm    the residual add fused into the next RMSNorm vs apart (U1SERVE_FUSED_ADD_NORM flipped;
                      --sizes; bf16 and fp8 as served; eager and CUDA graphs): s/step, speedup, final x
                      bit-equal; the fused kernels vs add + norm kernel at [4096, hidden]: bits and us
    --part fp8-fused  single-branch step at --sizes: bf16, fp8 as served today, fp8 on every GEMM quantised in
                      the GEMM layers (unfused) and by the producers (fused); eager and CUDA graphs
    --part formats    bf16 / fp8 / int8 / gguf: CFG step time at --sizes and gen-branch weight memory
                      (bench/genperf_formats.py)
--quantization fp8 applies to the default part (and --cfg-parallel).

Prints markdown tables; --json PATH writes the raw numbers. Reference points
(measured on an H200): single-branch 42-layer forward floor 0.124 s at 2048²
(plain PyTorch layer loop); published H200 TP2+CFG2 step 0.152 s. Targets: single-branch step <= 0.135 s,
CFG-parallel step <= 0.14 s.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import uuid

import torch

from services.generation.engine import Engine
from services.generation.kv_source import PrefixSource
from services.contract.image import GenerateRequest
from services.model.tiny import full_config, tiny_config
from shm_transfer import KVLayout, ShmKVPool, write_kv

from bench.genperf_common import build, sync

FLOOR_SINGLE = 0.124      # s, one gen-branch forward at 2048², P=365, measured floor
PUBLISHED_CFGP = 0.152    # s/step, SenseNova docs, H200 TP2+CFG2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tiny", action="store_true", help="tiny geometry (smoke test)")
    p.add_argument("--variant", default="u1-8b", help="full config variant (u1-8b, u1.5-8b, a3b-full)")
    p.add_argument("--size", type=int, default=2048, help="image side in pixels")
    p.add_argument("--prefix", default="365,9", help="cond,uncond prefix tokens")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--import-tokens", default="365,4096", help="prefix lengths for the import timing")
    p.add_argument("--cfg-parallel", type=int, default=1)
    p.add_argument("--skip-batching", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--part", default="step", type=_parts,
                   help="step, or one or more speed-option parts, comma-separated (bench/genperf_parts.py PARTS: "
                        "fp8, fp8-profile, cache, preset, warmstart, graphs, addnorm, fp8-fused, formats); several "
                        "run in one process (the CPU smoke), the GPU runs each alone (gpu_genperf.sh)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--sizes", default="2048,1024", help="image sides for --part fp8 / preset / cache")
    p.add_argument("--thresholds", default="0,0.05,0.1,0.2", help="--part cache")
    p.add_argument("--job-steps", default="1024:20,2048:10", help="--part cache: steps per job by size")
    p.add_argument("--no-warmup", action="store_true", help="--part warmstart: cold process")
    return p.parse_args()


def make_pool(model, tokens_needed: int, dtype: torch.dtype) -> ShmKVPool:
    layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim,
                      str(dtype).replace("torch.", ""), 64)
    size = (tokens_needed + 64 * 8) * layout.bytes_per_token
    return ShmKVPool.create(f"u1gen-bench-{uuid.uuid4().hex[:8]}", layout, size, model.fingerprint)


def publish(pool: ShmKVPool, lengths: dict[str, int], t_offsets: dict[str, int]) -> dict:
    handles = {}
    for b, n in lengths.items():
        h = pool.allocate(n, 600, branch=b, t_offset=t_offsets[b])
        kv = torch.randn(pool.layout.kv_shape(n), dtype=torch.float32).to(pool.layout.torch_dtype)
        write_kv(pool, h, kv)
        handles[b] = h.to_dict()
    return handles


def job_spec(rid, handles, size, steps, cfg=4.0, n=1) -> GenerateRequest:
    return GenerateRequest(request_id=rid, handles=handles, mode="t2i", width=size, height=size, n=n,
                           num_inference_steps=steps, guidance_scale=cfg, image_guidance_scale=1.0, cfg_norm="none",
                           timestep_shift=3.0, t_eps=0.02, cfg_interval=(0.0, 1.0), seed=0,
                           output_format="png")


def time_steps(engine: Engine, specs, warmup: int, steps: int) -> tuple[list[float], list[dict]]:
    stats = []
    for spec in specs:
        job, st = engine.admit(spec)
        engine.add(job)
        stats += st
    for _ in range(warmup):
        engine.step()
    sync(engine.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        sync(engine.device)
        times.append(time.perf_counter() - t0)
    for job in list(engine.running):
        engine.abort(job.request_id)
    return times, stats


def pinned_memcpy_seconds(nbytes: int, device, iters: int = 10) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    sync(device)
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def single_device(args, device, dtype) -> dict:
    model = build(args, device, dtype)
    p_cond, p_uncond = (int(x) for x in args.prefix.split(","))
    imp = [int(x) for x in args.import_tokens.split(",")]
    pool = make_pool(model, 4 * (p_cond + p_uncond) + 2 * sum(imp), dtype)
    source = PrefixSource(pool.name, model.fingerprint, device)
    engine = Engine(model, source)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "size": args.size, "dtype": str(dtype), "prefix": [p_cond, p_uncond]}
    total = args.warmup + args.steps + 1
    try:
        # 1) CFG step, both branches on one device (one packed forward)
        h = publish(pool, {"cond": p_cond, "uncond": p_uncond}, {"cond": p_cond, "uncond": p_uncond})
        t, _ = time_steps(engine, [job_spec("cfg", h, args.size, total)], args.warmup, args.steps)
        out["cfg_step_s"] = statistics.median(t)
        # 2) single-branch step (cond only): the per-forward number
        h = publish(pool, {"cond": p_cond}, {"cond": p_cond})
        t, _ = time_steps(engine, [job_spec("single", h, args.size, total, cfg=1.0)], args.warmup,
                          args.steps)
        out["single_step_s"] = statistics.median(t)
        # 3) prefix import via admission (pool pages -> staging -> per-request buffer)
        out["import"] = []
        for n in imp:
            hs = publish(pool, {"cond": n}, {"cond": n})
            rows = []
            for _ in range(5):
                job, st = engine.admit(job_spec(f"imp{n}", hs, 64, 1, cfg=1.0))
                job.free()
                rows.append(st[0])
                hs = publish(pool, {"cond": n}, {"cond": n})
            pool.release(__import__("shm_transfer").KVHandle.from_dict(hs["cond"]))
            sec = statistics.median(r.seconds for r in rows)
            nbytes = rows[0].bytes
            out["import"].append({"tokens": n, "bytes": nbytes, "seconds": sec,
                                  "memcpy_s": pinned_memcpy_seconds(nbytes, device)})
        # 4) step-level batching: two half-size jobs in one forward vs one after the other
        if not args.skip_batching:
            half = max(64, args.size // 2 // 32 * 32)
            h1 = publish(pool, {"cond": p_cond, "uncond": p_uncond}, {"cond": p_cond, "uncond": p_uncond})
            h2 = publish(pool, {"cond": p_cond, "uncond": p_uncond}, {"cond": p_cond, "uncond": p_uncond})
            alone, _ = time_steps(engine, [job_spec("b1", h1, half, total)], args.warmup, args.steps)
            h1 = publish(pool, {"cond": p_cond, "uncond": p_uncond}, {"cond": p_cond, "uncond": p_uncond})
            both, _ = time_steps(engine, [job_spec("b1", h1, half, total), job_spec("b2", h2, half, total)],
                                 args.warmup, args.steps)
            out["batching"] = {"size": half, "alone_step_s": statistics.median(alone),
                               "two_jobs_step_s": statistics.median(both)}
        if device.type == "cuda":
            out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    finally:
        source.close()
        pool.close()
    return out


def _cfgp_rank(rank, world, port, args, pool_name, handles, fingerprint, q):
    from services.generation.cfg_parallel import CfgComm
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = _dtype(args)
    comm = CfgComm.init(rank, world, port, device)
    model = build(args, device, dtype)
    model.fingerprint = fingerprint
    engine = Engine(model, PrefixSource(pool_name, fingerprint, device), comm)
    t, _ = time_steps(engine, [job_spec("cfgp", handles, args.size, args.warmup + args.steps + 1)],
                      args.warmup, args.steps)
    if rank == 0:
        q.put({"cfgp_step_s": statistics.median(t), "world": world})
    comm.close()


def cfg_parallel(args, dtype) -> dict:
    import multiprocessing as mp
    from services.base.netutil import free_port
    config = tiny_config("u1") if args.tiny else full_config(args.variant)
    from services.model.config import parse_config
    cfg = parse_config(config)
    L, Hkv, D = cfg.llm.num_hidden_layers, cfg.llm.num_key_value_heads, cfg.llm.head_dim
    p_cond, p_uncond = (int(x) for x in args.prefix.split(","))

    class _Geom:  # what make_pool needs
        num_layers, num_kv_heads, head_dim, fingerprint = L, Hkv, D, cfg.fingerprint
    pool = make_pool(_Geom, 2 * (p_cond + p_uncond), dtype)
    try:
        handles = publish(pool, {"cond": p_cond, "uncond": p_uncond}, {"cond": p_cond, "uncond": p_uncond})
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_cfgp_rank, args=(r, args.cfg_parallel, port, args, pool.name, handles,
                                                      cfg.fingerprint, q))
                 for r in range(args.cfg_parallel)]
        for p in procs:
            p.start()
        res = q.get(timeout=1800)
        for p in procs:
            p.join(60)
        return {"size": args.size, "dtype": str(dtype), **res}
    finally:
        pool.close()


def _parts(text: str) -> str:
    from bench.genperf_parts import PARTS
    bad = [p for p in text.split(",") if p not in PARTS] if text != "step" else []
    if bad:
        raise argparse.ArgumentTypeError(f"unknown part {', '.join(bad)}; step or {', '.join(PARTS)}")
    return text


def _dtype(args) -> torch.dtype:
    from services.model.constants import torch_dtype
    return torch_dtype(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))


def main():
    args = parse_args()
    device = torch.device(args.device)
    dtype = _dtype(args)
    if args.part != "step":
        from bench.genperf_parts import PARTS   # the speed-option parts (bench/genperf_parts.py)
        names = args.part.split(",")
        res = {name: PARTS[name](args, device, dtype) for name in names}
        res = res[names[0]] if len(names) == 1 else res
    elif args.cfg_parallel > 1:
        res = cfg_parallel(args, dtype)
        target = "0.095" if args.quantization == "fp8" else "0.14"
        print(f"| CFG-parallel x{res['world']} step at {args.size}², {args.quantization} | "
              f"{res['cfgp_step_s']:.4f} s | published H200 TP2+CFG2 {PUBLISHED_CFGP} s | target <= {target} s |")
    else:
        res = single_device(args, device, dtype)
        print(f"device: {res['device']}, torch {res['torch']}, {dtype}, {args.size}², prefix {res['prefix']}")
        print("| measurement | s/step | reference |")
        print("|---|---:|---|")
        print(f"| CFG step, 2 branches packed, one device | {res['cfg_step_s']:.4f} | 2 x floor "
              f"{2 * FLOOR_SINGLE:.3f} s |")
        print(f"| single-branch step | {res['single_step_s']:.4f} | floor {FLOOR_SINGLE} s, target <= 0.135 s |")
        if "batching" in res:
            b = res["batching"]
            print(f"| {b['size']}² one job (CFG) | {b['alone_step_s']:.4f} | |")
            print(f"| {b['size']}² two jobs in one forward | {b['two_jobs_step_s']:.4f} | "
                  f"{2 * b['alone_step_s']:.4f} s run one after the other |")
        print()
        print("| prefix tokens | bytes | engine import s | GB/s | plain pinned memcpy s |")
        print("|---:|---:|---:|---:|---:|")
        for r in res["import"]:
            mc = f"{r['memcpy_s']:.5f}" if r["memcpy_s"] is not None else "n/a"
            print(f"| {r['tokens']} | {r['bytes']} | {r['seconds']:.5f} | "
                  f"{r['bytes'] / r['seconds'] / 1e9:.2f} | {mc} |")
        if "peak_memory_gb" in res:
            print(f"\npeak GPU memory {res['peak_memory_gb']:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
