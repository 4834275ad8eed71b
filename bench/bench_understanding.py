"""Understanding-engine benchmark: decode throughput at several batch sizes, TTFT of a long prompt and the
cost of one T2I prefix export, ours (scheduler + paged KV + Triton kernels + CUDA graphs) vs the eager
reference pipeline (services.model.reference) in the same run. Full 8B geometry with random weights.

GPU (the real measurement):
    python -m bench.bench_understanding --json docs/benchmarks/understanding.json
GPU, A3B (random weights; its fused MoE, decode CUDA graphs on; the batch-1 bound counts the top-k experts only):
    python -m bench.bench_understanding --variant a3b-full --batches 1,64 --iters 3 --json /tmp/und_a3b.json
GPU, where a T2I prefix export's time goes beyond its prefill (torch.profiler of one export and one first-token
request of the same length; ~1 minute more):
    python -m bench.bench_understanding --batches 1 --profile-prefix --json /tmp/und_prefix.json
Prefill graphs (services/understanding/prefill_graphs.py): the prefix export again with prefill eager, a prefill
table (graphs vs eager: time, logit and KV differences) and a mixed step (decoding requests with prompts arriving),
graphed and eager; a graphed figure counts only steps that replayed graphs.
CPU smoke run (tiny checkpoint, small sizes; --variant a3b for the tiny MoE; the graphs' recorded stand-ins, rows
computed whole as on a GPU):
    python -m bench.bench_understanding --tiny --device cpu --dtype float32 --batches 1,4 \\
        --decode-tokens 8 --ttft-len 64 --prefix-len 40 --ref-tokens 4

Targets: batch-64 decode >= 20x the reference's tokens/s (the reference serves one request at a
time, so its tokens/s does not grow with the batch); batch-1 decode within 1.3x of the HBM bound (all
weights read once per token, at the device-to-device copy bandwidth measured in this run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import tempfile
import time
import uuid

import torch

from services.model import prompts as PR
from services.model.constants import DTYPES
from services.model import reference as R
from services.understanding.config import EngineConfig
from services.understanding.engine import Engine
from services.understanding.protocol import SubmitRequest
from services.understanding.sampling import SamplingParams


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--variant", default="u1-8b", help="full config of services.model.tiny.write_full_config "
                   "(u1-8b, u1.5-8b, a3b-full); with --tiny a tiny variant (u1, u1.5, a3b)")
    p.add_argument("--tiny", action="store_true", help="use the tiny checkpoint instead (CPU smoke run)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode runs")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--ref-tokens", type=int, default=32, help="tokens the reference decodes")
    p.add_argument("--ttft-len", type=int, default=1024)
    p.add_argument("--prefix-len", type=int, default=365)
    p.add_argument("--iters", type=int, default=5, help="repeats of the TTFT and prefix measurements")
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--cuda-graph-max-bs", type=int, default=128, help="0 = eager decode")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=1024,
                   help="largest graphed prefill (the engine's flag; 0 = eager). The prefix rows and the "
                        "prefill-graph table run with graphs and eagerly side by side (a CPU runs the recorded "
                        "stand-in: the padded forward, no CUDA graphs)")
    p.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="HBM bandwidth for the bound (default: measured D2D copy in this run)")
    p.add_argument("--profile-prefix", action="store_true",
                   help="also run one T2I prefix export and one first-token request of --prefix-len tokens under "
                        "torch.profiler: wall ms, device kernel ms, top kernels and host ops of each")
    p.add_argument("--json", default=None)
    return p.parse_args()


class _NullSock:
    def send_pyobj(self, _obj):
        pass


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(model_dir, args, pool_name=None, max_running=128, prefix_cache=False) -> Engine:
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, tp=1,
                       kv_cache_tokens=args.kv_cache_tokens, max_running_requests=max_running,
                       max_model_len=min(args.kv_cache_tokens, 8192), chunked_prefill_size=8192,
                       prefix_cache=prefix_cache, kv_pool_name=pool_name,
                       in_addr=f"inproc://bench-und-{uuid.uuid4().hex}",
                       cuda_graph_max_bs=args.cuda_graph_max_bs if args.device.startswith("cuda") else 0,
                       prefill_graph_max_tokens=args.prefill_graph_max_tokens)
    if args.prefill_graph_max_tokens and not args.device.startswith("cuda"):
        # the CPU smoke runs the graphs' recorded stand-ins where a GPU runs graphs: rows computed whole, as there
        # (the CPU's exact-row mode prefills eagerly, so no step would take them)
        from services.base import knobs
        os.environ[knobs.EXACT_ROWS.name] = "0"
    engine = Engine(0, cfg, None, _NullSock())
    runner = engine.runner
    if runner.prefill_graphs is None and args.prefill_graph_max_tokens and not args.device.startswith("cuda"):
        from services.understanding.cuda_graphs import RecordedDecodeGraphs
        from services.understanding.prefill_graphs import RecordedPrefillGraphs
        runner.prefill_graphs = RecordedPrefillGraphs(runner, args.prefill_graph_max_tokens)
        if args.cuda_graph_max_bs:
            runner.graphs = RecordedDecodeGraphs(runner, min(args.cuda_graph_max_bs, max_running))
    return engine


def drive(engine: Engine):
    """Run until idle. Returns per-step records and per-request first-token / finish times."""
    steps, first, done = [], {}, {}
    while engine.sched.has_work:
        scheduled = engine.sched.schedule()
        if scheduled is None:
            break
        plan = scheduled[0]
        t0 = time.perf_counter()
        engine.execute(scheduled)
        sync(engine.device)
        t1 = time.perf_counter()
        steps.append({"prefill_rows": plan.num_prefill_rows, "decode_rows": int(plan.d_rows.numel()),
                      "seconds": t1 - t0})
        for o in engine.sched.take_outputs():
            if o.new_ids and o.rid not in first:
                first[o.rid] = t1
            if o.finish_reason:
                done[o.rid] = (t1, o)
    return steps, first, done


def rand_ids(rng, n, tok):
    return [rng.randrange(0, 256) for _ in range(n - 1)] + [tok.img_start_id]


def bench_decode(engine, tok, batch, args, rng):
    for i in range(batch):
        engine.sched.add(SubmitRequest(f"d{batch}-{i}-{uuid.uuid4().hex[:6]}", rand_ids(rng, args.prompt_len, tok),
                                       [], SamplingParams(max_tokens=args.decode_tokens, temperature=0.0)))
    steps, _, _ = drive(engine)
    dec = [s for s in steps if s["prefill_rows"] == 0 and s["decode_rows"] == batch][3:]
    secs = sum(s["seconds"] for s in dec)
    toks = sum(s["decode_rows"] for s in dec)
    return {"batch": batch, "ms_per_step": 1000 * statistics.median(s["seconds"] for s in dec),
            "tokens_per_s": toks / secs, "steps": len(dec)}


def bench_ttft(engine, tok, args, rng):
    out = []
    for _ in range(args.iters):
        rid = f"ttft-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        engine.sched.add(SubmitRequest(rid, rand_ids(rng, args.ttft_len, tok), [],
                                       SamplingParams(max_tokens=1, temperature=0.0)))
        _, first, _ = drive(engine)
        out.append(first[rid] - t0)
    return 1000 * statistics.median(out)


def bench_prefix(engine, tok, pool, args, rng):
    """A T2I prefix exported into the handoff pool the way the service does it (the engine attached the pool
    by name, as under `u1serve up`): the whole request, and the copy alone through the engine's transport."""
    from shm_transfer import KVHandle
    total, copy = [], []
    for _ in range(args.iters):
        rid = f"pre-{uuid.uuid4().hex[:8]}"
        h = pool.allocate(args.prefix_len, 60.0)
        t0 = time.perf_counter()
        engine.sched.add(SubmitRequest(rid, rand_ids(rng, args.prefix_len, tok), [], SamplingParams(max_tokens=1),
                                       "prefix", handle=h.to_dict()))
        _, _, done = drive(engine)
        t1, o = done[rid]
        assert o.finish_reason == "exported", o
        total.append(t1 - t0)
        # the copy alone: re-export the same token count from the engine's pool
        slots = torch.arange(args.prefix_len, device=engine.runner.device)
        hh = KVHandle.from_dict(o.handle)
        sync(engine.device)
        c0 = time.perf_counter()
        engine.pool.export_kv(hh, engine.runner.kv_pool, slots)
        sync(engine.device)
        copy.append(time.perf_counter() - c0)
        pool.release(hh)
    return 1000 * statistics.median(total), 1000 * statistics.median(copy)


@contextlib.contextmanager
def eager_prefill(engine):
    """The engine's prefill without its graphs, for the side-by-side rows."""
    held, engine.runner.prefill_graphs = engine.runner.prefill_graphs, None
    try:
        yield
    finally:
        engine.runner.prefill_graphs = held


def bench_prefill_graphs(engine, args, rng) -> list[dict]:
    """One prefill-only step of a few lengths, run by the runner on free slots (the engine is idle: no request
    holds one) from its graphs and eagerly in turn: the step's time each way, and what padding the rows to a
    bucket changes (logits of the last row, the KV written: the prefix an image request exports)."""
    from services.understanding.step_plan import one_sequence_plan
    runner, graphs = engine.runner, engine.runner.prefill_graphs
    rows = []
    for n in sorted({64, args.prefix_len, args.ttft_len}):
        if n > graphs.max_tokens:
            continue
        ids = torch.tensor([rng.randrange(0, 256) for _ in range(n)])
        slots = torch.arange(n)
        runner.req_to_token[0, :n] = slots.to(runner.req_to_token.device, torch.int32)
        plan = one_sequence_plan(ids, slots, row=0)
        kv = runner.kv_pool[:, :, :n]
        res = {}
        for side, fn in (("graph", graphs.run), ("eager", runner.eager_forward)):
            times = []
            for _ in range(args.iters + 1):
                sync(engine.device)
                t0 = time.perf_counter()
                logits = fn(plan)
                sync(engine.device)
                times.append(time.perf_counter() - t0)
            res[side] = (1000 * statistics.median(times[1:]), logits.clone(), kv.float().clone())
        (g_ms, g_lg, g_kv), (e_ms, e_lg, e_kv) = res["graph"], res["eager"]
        rows.append({"tokens": n, "bucket": next(b for b in graphs.buckets if b >= n), "graph_ms": g_ms,
                     "eager_ms": e_ms, "eager_over_graph": e_ms / g_ms,
                     "logits_max_abs_diff": float((g_lg - e_lg).abs().max()),
                     "logits_rel_diff": float((g_lg - e_lg).abs().max() / e_lg.abs().max()),
                     "kv_max_abs_diff": float((g_kv - e_kv).abs().max()),
                     "kv_rel_diff": float((g_kv - e_kv).abs().max() / e_kv.abs().max()),
                     "argmax_equal": bool(g_lg.argmax(-1).eq(e_lg.argmax(-1)).all())})
    runner.req_to_token[0].zero_()
    return rows


def bench_mixed(engine, tok, args, rng, batch: int = 16, new_len: int = 128, arrivals: int = 8) -> dict:
    """Chat under load: `batch` requests decoding while prompts of `new_len` tokens arrive every third step. The
    median step with both kinds of rows (a mixed step: prefill graph + decode graph, or eager), and a decode-only
    one."""
    for i in range(batch):
        engine.sched.add(SubmitRequest(f"mx-{i}-{uuid.uuid4().hex[:6]}", rand_ids(rng, args.prompt_len, tok), [],
                                       SamplingParams(max_tokens=3 * arrivals + 8, temperature=0.0, ignore_eos=True)))
    graphs = engine.runner.prefill_graphs
    mixed, decode, step = [], [], 0
    while engine.sched.has_work:
        if step >= 3 and step % 3 == 0 and step <= 3 * arrivals:
            engine.sched.add(SubmitRequest(f"mx-new-{step}-{uuid.uuid4().hex[:6]}", rand_ids(rng, new_len, tok), [],
                                           SamplingParams(max_tokens=2, temperature=0.0)))
        scheduled = engine.sched.schedule()
        if scheduled is None:
            break
        plan = scheduled[0]
        replays = graphs.replays if graphs is not None else 0
        sync(engine.device)
        t0 = time.perf_counter()
        engine.execute(scheduled)
        sync(engine.device)
        dt = time.perf_counter() - t0
        d = int(plan.d_rows.numel())
        # with graphs, a mixed step counts only when it ran from them (prefill graph then decode graph)
        graphed = graphs is None or graphs.replays > replays
        (mixed if plan.num_prefill_rows and d and graphed else decode if d == plan.num_tokens else []).append(dt)
        engine.sched.take_outputs()
        step += 1
    return {"batch": batch, "new_prompt_tokens": new_len, "mixed_steps": len(mixed),
            "mixed_ms": 1000 * statistics.median(mixed) if mixed else None,
            "decode_ms": 1000 * statistics.median(decode) if decode else None}


def profile_prefix(engine, tok, pool, args, rng, top: int = 8) -> dict:
    """One first-token request and one T2I prefix export of the same length (--prefix-len), each under
    torch.profiler: wall ms, the device's kernel ms and launches (CUDA; the CPU's own op time elsewhere), the top
    kernels and the host ops by their own CPU time, so the export's time beyond its prefill has a name."""
    from torch.profiler import ProfilerActivity, profile

    from bench.genperf_parts import kernel_rows
    dev = torch.device(engine.runner.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = {}
    for kind in ("first_token", "prefix_export"):
        rid = f"prof-{kind}-{uuid.uuid4().hex[:6]}"
        handle = pool.allocate(args.prefix_len, 60.0) if kind == "prefix_export" else None
        msg = (SubmitRequest(rid, rand_ids(rng, args.prefix_len, tok), [], SamplingParams(max_tokens=1), "prefix",
                             handle=handle.to_dict()) if handle is not None else
               SubmitRequest(rid, rand_ids(rng, args.prefix_len, tok), [], SamplingParams(max_tokens=1,
                                                                                           temperature=0.0)))
        sync(engine.device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            engine.sched.add(msg)
            _, _, done = drive(engine)
            wall = time.perf_counter() - t0
        if handle is not None:
            from shm_transfer import KVHandle
            pool.release(KVHandle.from_dict(done[rid][1].handle))
        kernels = kernel_rows(prof, dev)
        host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
                       if e.self_cpu_time_total > 0), key=lambda r: -r[1])
        out[kind] = {"wall_ms": 1000 * wall, "kernel_ms": sum(ms for _, ms, _ in kernels),
                     "launches": sum(n for _, _, n in kernels),
                     "top_kernels": [{"name": k[:90], "ms": ms, "calls": n} for k, ms, n in kernels[:top]],
                     "top_host_ops": [{"name": k[:90], "ms": ms, "calls": n} for k, ms, n in host[:top]]}
    return out


def reference_numbers(model, tok, args, rng):
    def timed(fn):
        sync(args.device)
        t0 = time.perf_counter()
        fn()
        sync(args.device)
        return time.perf_counter() - t0

    inp = PR.PromptInput(rand_ids(rng, args.prompt_len, tok))
    gen = lambda n: R.generate_text(model, tok, inp, max_new_tokens=n, stop_ids=())  # noqa: E731
    gen(2)   # warm-up
    t1 = min(timed(lambda: gen(1)) for _ in range(2))
    tn = timed(lambda: gen(args.ref_tokens + 1))
    per_tok = (tn - t1) / args.ref_tokens
    long_inp = PR.PromptInput(rand_ids(rng, args.ttft_len, tok))
    ttft = statistics.median(timed(lambda: model.lm_logits(R.prefill(model, long_inp)[2][-1:]))
                             for _ in range(args.iters))
    pre_inp = PR.PromptInput(rand_ids(rng, args.prefix_len, tok))
    prefix = statistics.median(timed(lambda: R.build_prefix(model, tok, pre_inp).kv.cpu())
                               for _ in range(args.iters))
    return {"ms_per_token": 1000 * per_tok, "tokens_per_s": 1 / per_tok, "ttft_ms": 1000 * ttft,
            "prefix_ms": 1000 * prefix}


def decode_weight_bytes(model) -> int:
    """Bytes of weights one batch-1 decode step reads: all but the embeddings and the vision encoder; of a MoE
    block (A3B) only its top-k experts."""
    from services.model.moe import SparseMoE
    skip = ("embed_tokens", "vision_model")
    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not any(s in n for s in skip))
    for m in model.modules():
        if isinstance(m, SparseMoE):
            experts = sum(p.numel() * p.element_size() for p in m.experts.parameters())
            nbytes -= experts * (1 - m.top_k / m.experts.gate_up_proj.shape[0])
    return int(nbytes)


def hbm_bound_ms(model, args) -> tuple[float, float]:
    nbytes = decode_weight_bytes(model)
    bw = args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else None
    if bw is None and args.device.startswith("cuda"):
        src = torch.empty(1 << 30, dtype=torch.uint8, device=args.device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        sync(args.device)
        bw = 2 * 10 * src.numel() / (time.perf_counter() - t0)
        del src, dst
    if bw is None:
        return float("nan"), float("nan")
    return 1000 * nbytes / bw, bw / 1e12


def main():
    args = parse_args()
    from services.base import knobs
    from services.model import tiny
    tmp = tempfile.mkdtemp(prefix="bench-und-")
    if args.tiny:
        variant = args.variant if args.variant in tiny.VARIANTS else "u1"     # --tiny --variant a3b: the MoE
        model_dir = tiny.write_tiny_checkpoint(os.path.join(tmp, "tiny"), variant)
    else:
        model_dir = tiny.write_full_config(os.path.join(tmp, args.variant), args.variant)
        os.environ[knobs.RANDOM_WEIGHTS.name] = "1"
    rng = random.Random(0)
    batches = [int(b) for b in args.batches.split(",")]
    pool = handoff_pool(model_dir, args)
    try:
        run(model_dir, args, rng, batches, pool)
    finally:
        pool.close()


def handoff_pool(model_dir, args):
    """The producer side of the KV handoff as the understanding service makes it (services/understanding/
    state.py): created before the engine, which attaches it by name."""
    from services.model.config import load_config
    from services.model.loader import model_fingerprint
    from shm_transfer import KVLayout
    from shm_transfer.producer import create_producer
    cfg = load_config(model_dir)
    llm = cfg.llm
    layout = KVLayout(llm.num_hidden_layers, llm.num_key_value_heads, llm.head_dim, args.dtype, 256)
    return create_producer("shm", f"bench-und-{uuid.uuid4().hex[:8]}", layout,
                           4 * (args.prefix_len + 256) * layout.bytes_per_token, model_fingerprint(model_dir, cfg),
                           pin=False)


def run(model_dir, args, rng, batches, pool):
    engine = make_engine(model_dir, args, pool_name=pool.pool.name, max_running=max(128, max(batches)))
    tok_ = __import__("services.model.tokenizer", fromlist=["NeoTokenizer"]).NeoTokenizer.from_dir(model_dir)
    print(f"model loaded on {args.device} ({args.dtype}); graphs: {type(engine.runner.graphs).__name__}, "
          f"{type(engine.runner.prefill_graphs).__name__}", flush=True)
    bench_decode(engine, tok_, min(batches), args, rng)           # warm-up: compile the kernels
    decode = [bench_decode(engine, tok_, b, args, rng) for b in batches]
    ttft = bench_ttft(engine, tok_, args, rng)

    for d in decode:
        print(f"ours: batch {d['batch']}: {d['ms_per_step']:.2f} ms/step, {d['tokens_per_s']:.0f} tokens/s", flush=True)
    print(f"ours: TTFT {ttft:.1f} ms", flush=True)

    bench_prefix(engine, tok_, pool, args, rng)                 # warm-up
    graphs = engine.runner.prefill_graphs
    replays = graphs.replays if graphs is not None else 0
    prefix_ms, copy_ms = bench_prefix(engine, tok_, pool, args, rng)
    if graphs is not None and graphs.replays == replays:
        raise RuntimeError("the prefix exports ran no prefill graph: the graphed figure would be the eager one")
    prefix_eager_ms = prefill_rows = mixed = None
    if graphs is not None:
        with eager_prefill(engine):
            prefix_eager_ms, _ = bench_prefix(engine, tok_, pool, args, rng)
        prefill_rows = bench_prefill_graphs(engine, args, rng)
        bench_mixed(engine, tok_, args, rng)                    # warm-up
        mixed = {"graphs": bench_mixed(engine, tok_, args, rng)}
        with eager_prefill(engine):
            mixed["eager"] = bench_mixed(engine, tok_, args, rng)
    prof = profile_prefix(engine, tok_, pool, args, rng) if args.profile_prefix else None
    engine.pool.close()
    ref = reference_numbers(engine.model, tok_, args, rng)
    bound_ms, bw_tbs = hbm_bound_ms(engine.model, args)

    res = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else (platform.processor() or platform.machine()),
           "torch": torch.__version__, "dtype": args.dtype, "variant": "tiny" if args.tiny else args.variant,
           "date": time.strftime("%Y-%m-%d"), "moe": engine.model.cfg.llm.is_moe,
           "cuda_graphs": engine.runner.graphs is not None and args.device.startswith("cuda"),
           "prompt_len": args.prompt_len, "decode": decode, "reference": ref,
           "ttft_ms": ttft, "ttft_len": args.ttft_len, "prefix_len": args.prefix_len,
           "prefix_export_ms": prefix_ms, "prefix_copy_ms": copy_ms,
           "prefill_graphs": None if graphs is None else {
               "buckets": graphs.buckets, "kind": type(graphs).__name__, "pool_mib": graphs.pool_bytes / 2**20,
               "prefix_export_eager_ms": prefix_eager_ms,
               "steps": prefill_rows, "mixed": mixed},
           "hbm_bound_ms": bound_ms, "bandwidth_tbs": bw_tbs}
    if prof is not None:
        res["prefix_profile"] = prof
    print(f"\n{res['device']}, torch {res['torch']}, {args.dtype}, {res['variant']}, graphs {res['cuda_graphs']}\n")
    print("| batch | ms/step | tokens/s | reference tokens/s | speedup |")
    print("|---:|---:|---:|---:|---:|")
    for d in decode:
        print(f"| {d['batch']} | {d['ms_per_step']:.2f} | {d['tokens_per_s']:.0f} | {ref['tokens_per_s']:.1f} | "
              f"{d['tokens_per_s'] / ref['tokens_per_s']:.1f}x |")
    b1 = next((d for d in decode if d["batch"] == 1), None)
    if b1 and bound_ms == bound_ms:
        print(f"\nbatch-1 decode {b1['ms_per_step']:.2f} ms vs HBM bound {bound_ms:.2f} ms "
              f"({bw_tbs:.2f} TB/s measured): {b1['ms_per_step'] / bound_ms:.2f}x (target <= 1.3x)")
    print(f"TTFT, {args.ttft_len}-token prompt: ours {ttft:.1f} ms, reference {ref['ttft_ms']:.1f} ms")
    print(f"T2I prefix export, {args.prefix_len} tokens: ours {prefix_ms:.1f} ms (copy {copy_ms:.2f} ms), "
          f"reference prefill {ref['prefix_ms']:.1f} ms")
    if graphs is not None:
        print(f"the same export with prefill eager: {prefix_eager_ms:.1f} ms ({type(graphs).__name__}: "
              f"{prefix_eager_ms / prefix_ms:.2f}x the graphed one); graphs for {graphs.buckets} tokens hold "
              f"{graphs.pool_bytes / 2**20:.0f} MiB")
        print("\n| prefill tokens (bucket) | graph ms | eager ms | eager / graph | logits max diff (rel) | "
              "KV max diff (rel) | argmax equal |")
        print("|---|---:|---:|---:|---|---|---|")
        for r in prefill_rows:
            print(f"| {r['tokens']} ({r['bucket']}) | {r['graph_ms']:.2f} | {r['eager_ms']:.2f} | "
                  f"{r['eager_over_graph']:.2f}x | {r['logits_max_abs_diff']:.3g} ({r['logits_rel_diff']:.2g}) | "
                  f"{r['kv_max_abs_diff']:.3g} ({r['kv_rel_diff']:.2g}) | {r['argmax_equal']} |")
        g, e = mixed["graphs"], mixed["eager"]
        print(f"\n{g['batch']} decoding, a {g['new_prompt_tokens']}-token prompt arriving: a mixed step "
              f"{g['mixed_ms']:.2f} ms from graphs vs {e['mixed_ms']:.2f} ms with prefill eager "
              f"({e['mixed_ms'] / g['mixed_ms']:.2f}x; {g['mixed_steps']} / {e['mixed_steps']} steps); "
              f"decode-only steps {g['decode_ms']:.2f} / {e['decode_ms']:.2f} ms")
    if prof is not None:
        print(f"\nunder torch.profiler, {args.prefix_len} tokens (kernels: device time on CUDA, own CPU time elsewhere)")
        print("| request | wall ms | kernels ms | launches | top kernels (ms) | top host ops, own CPU ms |")
        print("|---|---:|---:|---:|---|---|")
        for kind, r in prof.items():
            ks = "; ".join(f"{k['name'][:40]} {k['ms']:.2f}" for k in r["top_kernels"][:4])
            hs = "; ".join(f"{h['name'][:40]} {h['ms']:.2f}" for h in r["top_host_ops"][:4])
            print(f"| {kind} | {r['wall_ms']:.1f} | {r['kernel_ms']:.1f} | {r['launches']} | {ks} | {hs} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
