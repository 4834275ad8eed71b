"""Decode-shaped kernels on the GPU: where a decode step's time goes and which tile configs the skinny GEMM and the
fused MoE should use.

Parts (`--parts`, comma-separated):
- skinny: x [M, K] @ W^T for M in --rows at the 8B / A3B decode weight shapes, cuBLAS vs every config of the two
  kernels of kernels/skinny_gemm.py (the tensor-core one and the one-row CUDA-core one); the weights are rotated
  (enough copies to exceed L2) inside one CUDA graph, as in a decode step; TB/s of weight read. The configs in
  `skinny_config` come from this part's H200 run (docs/benchmarks/kernels.md).
- moe: kernels.fused_moe at the A3B shapes (decode batch 1 / 64 on the understanding experts, a 1024² CFG denoise
  step on the generation experts), the current `moe_config` vs a sweep of tiles.
- profile: the understanding engine (bench_understanding's) on the full 8B geometry, random weights: decode graph
  replay alone vs the engine step at batch 1 / 8 / 64, their ratio to the HBM bound, and the kernel table of a
  batch-1 replay (torch profiler), per layout side by side (`--legs`): q|k|v and gate|up fused (model/fused_rows.py),
  that plus silu*mul inside the down GEMM (U1SERVE_GATED_DOWN), separate; one engine, the graphs re-captured in
  between. U1SERVE_SKINNY_GEMM=0 runs it on cuBLAS, to compare.

GPU:  python -m bench.bench_decode_kernels --json /tmp/decode_kernels.json
      python -m bench.bench_decode_kernels --parts profile --json /tmp/decode_profile.json
CPU smoke (Triton interpreter, tiny shapes; the profile part on the tiny checkpoint, eager steps for the graphs):
      python -m bench.bench_decode_kernels --smoke --json /tmp/dk.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SKINNY_SHAPES = {"8b_q_o": (4096, 4096), "8b_kv": (1024, 4096), "8b_gate_up": (12288, 4096),
                 "8b_down": (4096, 12288), "8b_lm_head": (151936, 4096), "a3b_q": (4096, 2048),
                 "a3b_kv": (512, 2048), "a3b_o": (2048, 4096), "a3b_router": (128, 2048),
                 "8b_qkv_fused": (6144, 4096), "8b_gate_up_fused": (24576, 4096), "a3b_qkv_fused": (5120, 2048)}
MOE_CASES = {"und_b1": (1, 128), "und_b64": (64, 128), "gen_1024cfg": (2048, 32)}


def per_call_s(fn, calls, dev) -> float:
    """Seconds per call of `calls` (closures): one CUDA graph of them replayed, or a plain loop on the CPU."""
    if dev == "cpu":
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1000 / 5 / len(calls)


def part_skinny(args, dev, dtype) -> list[dict]:
    from kernels.skinny_gemm import gemv_launch, skinny_config, skinny_linear_launch
    shapes = {"tiny": (40, 256)} if args.smoke else SKINNY_SHAPES
    if args.smoke:
        dot_cfgs, gemv_cfgs = [(16, 128, 4, 3)], [(4, 128, 4, 2)]
    else:
        dot_cfgs = list(itertools.product([16, 32, 64], [128, 256, 512], [4, 8], [3, 4, 5]))
        gemv_cfgs = list(itertools.product([4, 8, 16], [256, 512, 1024], [4, 8], [2, 3, 4]))
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = n * k * torch.tensor([], dtype=dtype).element_size()
        copies = 2 if args.smoke else max(2, min(48, (320 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in ws]
            ref = F.linear(x.float(), ws[0].float())
            t_torch = per_call_s(None, [lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)], dev)
            best, failures = None, 0
            for kind, cfgs, launch in (("dot", dot_cfgs, skinny_linear_launch), ("gemv", gemv_cfgs, gemv_launch)):
                if kind == "gemv" and m != 1:
                    continue
                for cfg in cfgs:
                    if k % cfg[1]:
                        continue
                    try:
                        y = launch(x, ws[0], cfg, outs[0])
                        err = (y.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                        if err > 2e-2:
                            raise AssertionError(f"relative error {err:.3g}")
                        t = per_call_s(None, [lambda w=w, o=o, c=cfg, L=launch: L(x, w, c, o)
                                              for w, o in zip(ws, outs)], dev)
                    except Exception as e:   # noqa: BLE001 - out of shared memory for some tiles: not a result
                        failures += 1
                        if args.smoke:
                            raise
                        print(f"  {name} m{m} {kind}{cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if best is None or t < best[0]:
                        best = (t, kind, cfg)
            chosen = skinny_config(m, n, k)
            row = {"shape": name, "n": n, "k": k, "m": m, "torch_us": t_torch * 1e6,
                   "torch_tbs": nbytes / t_torch / 1e12, "best_us": best[0] * 1e6, "best_tbs": nbytes / best[0] / 1e12,
                   "best_kernel": best[1], "best_cfg": list(best[2]), "speedup": t_torch / best[0],
                   "serving_choice": "cublas" if chosen is None else f"{chosen[0]}{list(chosen[1])}",
                   "configs_failed": failures}
            rows.append(row)
            print(f"{name:12s} m{m:2d}: torch {row['torch_us']:8.1f} us {row['torch_tbs']:.2f} TB/s | best "
                  f"{best[1]} {best[2]} {row['best_us']:8.1f} us {row['best_tbs']:.2f} TB/s ({row['speedup']:.2f}x)"
                  f" | serving: {row['serving_choice']}", flush=True)
        del ws
    return rows


def part_moe(args, dev, dtype) -> list[dict]:
    import kernels.moe as km
    h, inter, top_k = (64, 32, 2) if args.smoke else (2048, 768, 8)
    cases = {"tiny": (4, 4)} if args.smoke else MOE_CASES
    current = km.moe_config
    rows = []
    try:
        for name, (t, e) in cases.items():
            x = torch.randn(t, h, device=dev, dtype=dtype)
            logits = torch.randn(t, e, device=dev, dtype=torch.float32)
            w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype) * 0.02
            w2 = torch.randn(e, h, inter, device=dev, dtype=dtype) * 0.02
            few = t * top_k / min(e, t * top_k) <= 16
            grid = (itertools.product([16], [32, 64, 128], [64, 128], [4, 8], [2, 3, 4]) if few else
                    itertools.product([32, 64, 128], [64, 128], [64], [4, 8], [3, 4]))
            cfgs = [current(t * top_k, e)] + ([] if args.smoke else [
                dict(BLOCK_M=a, BLOCK_N=b, BLOCK_K=c, num_warps=w, num_stages=s) for a, b, c, w, s in grid])
            want = km.fused_moe_ref(x, logits, w13, w2, top_k, True).float()
            timed = []
            for cfg in cfgs:
                km.moe_config = lambda pairs, experts, c=cfg: c
                try:
                    y = km.fused_moe(x, logits, w13, w2, top_k, True)
                    if (y.float() - want).abs().max().item() > 0.05 * want.abs().max().item() + 1e-3:
                        raise AssertionError("differs from fused_moe_ref")
                    timed.append((per_call_s(None, [lambda: km.fused_moe(x, logits, w13, w2, top_k, True)] * 10,
                                             dev), cfg))
                except Exception as e:   # noqa: BLE001 - out of shared memory for some tiles
                    if args.smoke:
                        raise
                    print(f"  {name} {cfg}: {type(e).__name__}", file=sys.stderr)
            now = timed[0][0]
            best = min(timed, key=lambda r: r[0])
            rows.append({"case": name, "tokens": t, "experts": e, "current_ms": now * 1e3, "best_ms": best[0] * 1e3,
                         "best_cfg": best[1], "configs": len(timed)})
            print(f"moe {name}: current {now * 1e3:.3f} ms, best {best[0] * 1e3:.3f} ms {best[1]}", flush=True)
    finally:
        km.moe_config = current
    return rows


LEGS = ("fused", "separate", "fused_gated")


def part_profile(args) -> dict:
    """The 8B understanding engine's decode steps (bench_understanding's engine), replay vs step, kernel table, per
    layout (`--legs`: q|k|v and gate|up fused (model/fused_rows.py), that plus silu*mul inside the down GEMM, or
    separate), one engine, the graphs re-captured between layouts."""
    import random
    import tempfile

    from bench import bench_understanding as bu
    from services.base import knobs
    from services.model import tiny
    from services.model.tokenizer import NeoTokenizer
    saved = sys.argv
    # --smoke: the tiny checkpoint in fp32 on the CPU, eager steps in place of the graphs (step_calls)
    sys.argv = [saved[0], "--variant", "u1-8b", "--decode-tokens", "64"] + (
        ["--tiny", "--device", "cpu", "--dtype", "float32", "--decode-tokens", "8", "--prompt-len", "16",
         "--kv-cache-tokens", "4096", "--bandwidth-tbs", "0.05"] if args.smoke else [])
    try:
        uargs = bu.parse_args()
    finally:
        sys.argv = saved
    if args.smoke:
        model_dir = tiny.write_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"), "u1")
    else:
        model_dir = tiny.write_full_config(os.path.join(tempfile.mkdtemp(), "u1-8b"), "u1-8b")
        os.environ[knobs.RANDOM_WEIGHTS.name] = "1"
    pool = bu.handoff_pool(model_dir, uargs)
    engine = bu.make_engine(model_dir, uargs, pool_name=pool.pool.name, max_running=128)
    tok = NeoTokenizer.from_dir(model_dir)
    rng = random.Random(0)
    res = {"skinny_gemm": knobs.SKINNY_GEMM.get(), "loaded_as": layout_of(engine.model)}
    res["hbm_bound_ms"], res["bandwidth_tbs"] = bu.hbm_bound_ms(engine.model, uargs)
    res["weight_gb"] = bu.decode_weight_bytes(engine.model) / 1e9
    legs = []
    for leg in args.legs:
        try:
            if layout_of(engine.model) != leg or (engine.runner.graphs is None and not args.smoke):
                recapture(engine, lambda: use_layout(engine.model, leg))
            res[leg] = profile_leg(engine, tok, uargs, rng, res["hbm_bound_ms"])
            legs.append(leg)
        except Exception as e:   # noqa: BLE001 - one layout failing must not lose the others' figures
            res[f"{leg}_error"] = f"{type(e).__name__}: {e}"
            print(f"layout {leg} failed: {res[f'{leg}_error']}", file=sys.stderr, flush=True)
    pool.close()
    if not legs:
        return res
    print(json.dumps({k: v for k, v in res.items() if k not in legs}, indent=1), flush=True)
    keys = [k for k in res[legs[0]] if k != "kernels_per_step"]
    print(f"{'':26s}" + "".join(f"{leg:>13s}" for leg in legs), flush=True)
    for k in keys:
        print(f"{k:26s}" + "".join(f"{res[leg][k]:13.3f}" for leg in legs), flush=True)
    for leg in legs:
        print(f"kernels of a batch-1 replay, {leg}:")
        for r in res[leg]["kernels_per_step"]:
            print(f"  {r['us_per_step']:9.1f} us  x{r['calls']:4d}  {r['name']}")
    return res


def layout_of(model) -> str:
    from services.model.fused_rows import fused_bytes
    from services.model.modules import SwiGLU
    if not fused_bytes(model):
        return "separate"
    return "fused_gated" if any(m.gated_down for m in model.modules() if isinstance(m, SwiGLU)) else "fused"


def use_layout(model, leg: str) -> None:
    from services.model.fused_rows import fuse_projections
    from services.model.modules import SwiGLU
    if (layout_of(model) == "separate") != (leg == "separate"):
        fuse_projections(model, on=leg != "separate")
    for m in model.modules():
        if isinstance(m, SwiGLU):
            m.gated_down = leg == "fused_gated"


def recapture(engine, change) -> None:
    """Drop the engine's graphs, `change()` the model, capture the decode graphs again (up to batch 64: the
    bench's)."""
    import gc

    from services.understanding.cuda_graphs import DecodeGraphs
    runner = engine.runner
    # the prefill graphs read the old layout's weights too: dropped (this part times decode; its prompts prefill
    # eagerly), not recaptured
    runner.prefill_graphs = None
    if not str(runner.device).startswith("cuda"):     # the CPU smoke: no graphs to drop or capture
        change()
        return
    runner.graphs = None
    gc.collect()
    torch.cuda.synchronize()
    change()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner, 64)


def step_calls(engine) -> dict:
    """One batch-b decode step per batch size, as a closure: the captured graph's replay on CUDA (on the CPU smoke
    the recorded stand-in's, bench_understanding.make_engine); without graphs the same forward eagerly on the
    scratch slot, so the smoke runs every line of the part."""
    runner = engine.runner
    if runner.graphs is not None:
        return {b: replay for b, (replay, _) in runner.graphs.graphs.items()}

    def eager(b):
        dev = runner.device
        meta = dict(rows=torch.full((b,), runner.scratch_row, dtype=torch.long, device=dev),
                    b_seq_len=torch.ones(b, dtype=torch.int32, device=dev))
        args = (torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(3, b, dtype=torch.long, device=dev), [],
                torch.full((b,), runner.scratch_slot, dtype=torch.long, device=dev), 0, None, meta, None)

        def call():
            with torch.no_grad():
                runner.core(*args)
        return call
    return {b: eager(b) for b in (1, 8, 64)}


def replay_ms(call, dev, n: int = 20) -> float:
    """Milliseconds per call of one decode step, timed in a plain loop. Never inside a capture: a graph's replay
    cannot be captured into another graph (the GPU run's 'Cannot prepare for replay during capturing stage')."""
    call()
    if dev == "cpu":
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        call()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def profile_leg(engine, tok, uargs, rng, bound_ms: float, batches=(1, 8, 64)) -> dict:
    from bench import bench_understanding as bu
    dev = "cuda" if str(engine.device).startswith("cuda") else "cpu"
    bu.bench_decode(engine, tok, 1, uargs, rng)                       # warm-up
    calls = step_calls(engine)
    res = {}
    for b in batches:
        res[f"engine_ms_b{b}"] = bu.bench_decode(engine, tok, b, uargs, rng)["ms_per_step"]
        res[f"replay_ms_b{b}"] = replay_ms(calls[b], dev)
    res["replay_b1_over_hbm_bound"] = res["replay_ms_b1"] / bound_ms
    res["engine_b1_over_hbm_bound"] = res["engine_ms_b1"] / bound_ms
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(5):
            calls[1]()
        if dev == "cuda":
            torch.cuda.synchronize()
    timed = (lambda e: e.device_time_total) if dev == "cuda" else (lambda e: e.self_cpu_time_total)
    events = [e for e in prof.key_averages() if timed(e) > 0]
    res["kernel_us_b1"] = sum(timed(e) for e in events) / 5
    res["launches_b1"] = sum(e.count for e in events) / 5
    res["kernels_per_step"] = [{"name": e.key[:90], "calls": e.count // 5, "us_per_step": timed(e) / 5}
                               for e in sorted(events, key=lambda e: -timed(e))[:20]]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="skinny,moe,profile")
    ap.add_argument("--rows", default="1,8,16", help="skinny part: rows of x")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (skinny, moe)")
    ap.add_argument("--legs", default=",".join(LEGS), help=f"profile part: the layouts to run, of {LEGS}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.legs = [x for x in args.legs.split(",") if x]
    if any(x not in LEGS for x in args.legs):
        ap.error(f"--legs: each of {LEGS}")
    args.rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    if args.smoke:
        dev, dtype = "cpu", torch.float16        # the interpreter's bf16 dot is broken; fp16 is exact there
        args.rows = [1, 5]
    elif not torch.cuda.is_available():
        print("no CUDA device: use --smoke for the CPU (interpreter) run")
        return 2
    else:
        dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if "skinny" in parts:
        out["skinny"] = part_skinny(args, dev, dtype)
    if "moe" in parts:
        out["moe"] = part_moe(args, dev, torch.float32 if args.smoke else dtype)
    if "profile" in parts:
        out["profile"] = part_profile(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = [k for k in out.get("profile", {}) if k.endswith("_error")]
    for k in failed:             # the other layouts' figures were kept; the run still says it is incomplete
        print(f"FAIL profile layout {k.removesuffix('_error')}: {out['profile'][k]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
