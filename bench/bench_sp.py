"""Sequence parallelism and 4K: denoising step time of one image over 1, 2 (and 4) GPUs,
engine level (torch only: the real Engine, rank processes, NCCL), full-size geometry, random weights.

    python -m bench.bench_sp --part sp        # u1-8b 2048², guidance 1: SP1 vs SP2 (target SP2 <= 0.072 s)
    python -m bench.bench_sp --part 4k        # u1.5-8b 4096²: SP1, SP2, CFG, CFG2, SP2 x CFG; peak memory
    python -m bench.bench_sp --part comm      # the collectives alone at 2048² / 4096² (per layer, per step)
    python -m bench.bench_sp --smoke          # CPU, tiny geometry, gloo (checks the script; both modes)

`--sp-mode ulysses|kv-gather|both` (default both): which SP mode(s) the SP cases run (sequence_parallel.py:
Ulysses' two all-to-alls a layer, or one all-gather of K/V); in `comm`, each mode's per-layer collective.
`--cuda-graphs off|on|both` (default off): the engine's step graphs (step_graph.py; the service's opt-in
--cuda-graphs); `both` runs every case eagerly and from graphs, side by side (names end with "graphs").
Each world size runs in one set of processes (rank r on cuda:r) that builds each model once and runs its
cases one after the other: `sp` = one CFG group sharded over all ranks, `cfg` = CFG-parallel, `cfgxsp`
= CFG 2 x SP (4+ GPUs). Prints a markdown table; --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services.generation.config import SP_MODES


PREFIX = {"cond": 365, "uncond": 9}
SP_LAYOUTS = ("sp", "cfgxsp")


def sp_modes(flag: str) -> list[str]:
    return list(SP_MODES) if flag == "both" else [flag]


def with_modes(cases: list[dict], modes: list[str]) -> list[dict]:
    """Each SP case once per mode (its name ends with the mode); the others as they are."""
    out = []
    for c in cases:
        if c["layout"] in SP_LAYOUTS:
            out += [dict(c, name=f"{c['name']} {m}", sp_mode=m) for m in modes]
        else:
            out.append(c)
    return out


def with_graphs(cases: list[dict], flag: str) -> list[dict]:
    """Each case with graphs off and / or on (the graphed copy's name ends with "graphs")."""
    out = []
    for c in cases:
        if flag in ("off", "both"):
            out.append(dict(c, graphs="off"))
        if flag in ("on", "both"):
            out.append(dict(c, name=f"{c['name']} graphs", graphs="on"))
    return out


def cases_for(part: str, smoke: bool) -> list[dict]:
    """name, variant, size, guidance, layout, world."""
    if smoke:
        return [dict(name=f"tiny g{g:g} {lay} x{w}", variant="u1.5", size=256, guidance=g, layout=lay, world=w)
                for w, lay, g in [(1, "one", 1.0), (1, "one", 4.0), (2, "sp", 1.0), (2, "sp", 4.0),
                                  (2, "cfg", 4.0)]]
    if part == "sp":
        return [dict(name=f"2048² g1 {'SP2' if w == 2 else 'SP1'}", variant="u1-8b", size=2048, guidance=1.0,
                     layout="sp" if w == 2 else "one", world=w) for w in (1, 2)] + \
               [dict(name="2048² CFG SP2 (both branches sharded)", variant="u1-8b", size=2048, guidance=4.0,
                     layout="sp", world=2),
                dict(name="2048² CFG CFG2", variant="u1-8b", size=2048, guidance=4.0, layout="cfg", world=2),
                dict(name="2048² CFG CFG2 x SP2", variant="u1-8b", size=2048, guidance=4.0, layout="cfgxsp",
                     world=4)]
    if part == "4k":
        return [dict(name="4096² g1 SP1", variant="u1.5-8b", size=4096, guidance=1.0, layout="one", world=1),
                dict(name="4096² CFG one GPU", variant="u1.5-8b", size=4096, guidance=4.0, layout="one", world=1),
                dict(name="4096² g1 SP2", variant="u1.5-8b", size=4096, guidance=1.0, layout="sp", world=2),
                dict(name="4096² CFG SP2", variant="u1.5-8b", size=4096, guidance=4.0, layout="sp", world=2),
                dict(name="4096² CFG CFG2", variant="u1.5-8b", size=4096, guidance=4.0, layout="cfg", world=2),
                dict(name="4096² CFG CFG2 x SP2", variant="u1.5-8b", size=4096, guidance=4.0, layout="cfgxsp",
                     world=4)]
    raise ValueError(part)


def _spec(name: str, size: int, guidance: float, steps: int):
    from services.contract.image import SamplerParams
    from services.generation.inputs import parse_job
    branches = SamplerParams(guidance_scale=guidance).branches()
    return parse_job({"request_id": name, "handles": {b: {} for b in branches}, "width": size,
                           "height": size, "num_inference_steps": steps, "guidance_scale": guidance, "seed": 0})


def _config(variant: str):
    from services.model.tiny import full_config, tiny_config
    return tiny_config(variant) if variant in ("u1", "u1.5", "a3b") else full_config(variant)


def _time_case(engine, case, args, device) -> dict:
    m = engine.model
    spec = _spec(case["name"], case["size"], case["guidance"], args.warmup + args.steps + 1)
    kv = {b: torch.zeros((m.num_layers, 2, PREFIX[b], m.num_kv_heads, m.head_dim), device=device,
                         dtype=engine.dtype) for b in spec.handles}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    job = engine.admit_local(spec, kv, {b: PREFIX[b] for b in spec.handles})
    del kv
    engine.add(job)
    for _ in range(args.warmup):
        engine.step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    stride = max(1, case["size"] // 64)          # a 64x64 probe of the final state, to compare layouts
    probe = job.x[:, :, ::stride, ::stride].float().cpu().flatten().tolist()
    engine.abort(job.request_id)
    out = {"step_s": statistics.median(times), "steps": times, "probe": probe}
    if device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _diff_vs_one_gpu(cases: list[dict], res: dict) -> None:
    """Each multi-GPU case's max |x - x of one GPU| / max |x of one GPU| over the probes of the final state
    (same seed and steps; bf16 rounding differs, a wrong layout shows as O(1)). Drops the probes."""
    probes = {name: r.pop("probe") for name, r in res.items() if "probe" in r}
    ref = {(c["size"], c["guidance"], c["graphs"]): probes.get(c["name"]) for c in cases if c["world"] == 1}
    for c in cases:
        p, b = probes.get(c["name"]), ref.get((c["size"], c["guidance"], c["graphs"]))
        if c["world"] > 1 and p and b:
            scale = max(max(abs(y) for y in b), 1e-12)
            res[c["name"]]["diff_vs_one_gpu"] = max(abs(x - y) for x, y in zip(p, b)) / scale


def _comm_for(case: dict, rank: int, world: int, port: int, device, cache: dict):
    """One process group per process; the SP views (one per mode) and the CFG2 view share it."""
    import torch.distributed as dist
    from services.generation.cfg_parallel import CfgComm
    if world == 1:
        return CfgComm.single()
    if "base" not in cache:
        cache["base"] = CfgComm.init(rank, world, port, device, sp=world if world <= 2 else 2)
    base = cache["base"]
    if case["layout"] in SP_LAYOUTS:
        return CfgComm(rank, world, base.control_group, base.data_group, device,
                       _sp_view(base.sp, case["sp_mode"]))
    return CfgComm(rank, world, base.control_group, dist.group.WORLD, device)   # CFG-parallel view


def _sp_view(sp, mode: str):
    """The same SP groups, attending in `mode`."""
    from services.generation.sequence_parallel import SeqParallel
    return SeqParallel(sp.rank, sp.world, sp.group, sp.ctrl_group, mode)


def _rank_main(rank: int, world: int, port: int, cases: list[dict], args, q) -> None:
    try:
        from services.generation.engine import Engine
        from services.model.tiny import build_random_model
        device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        models, comms, res = {}, {}, {}
        for case in cases:
            if case["variant"] not in models:
                models[case["variant"]] = build_random_model(_config(case["variant"]), "gen", dtype, device)
            comm = _comm_for(case, rank, world, port, device, comms)
            try:
                engine = Engine(models[case["variant"]], None, comm, cuda_graphs=case["graphs"])
                res[case["name"]] = _time_case(engine, case, args, device)
            except torch.cuda.OutOfMemoryError as e:
                res[case["name"]] = {"error": f"OOM: {e}"[:200]}
        if rank == 0:
            q.put(res)
        if "base" in comms:
            comms["base"].close()
    except BaseException as e:
        q.put({"error": f"rank {rank}: {e!r}"})
        raise


def spawn(world: int, target, args, *extra) -> dict:
    """target(rank, world, port, *extra, args, q) in `world` processes; rank 0's result."""
    import multiprocessing as mp
    from services.base.netutil import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *extra, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def _comm_rank(rank, world, port, args, q) -> None:
    """Each mode's per-layer collective (Ulysses: the all-to-all of q/k/v and back; kv-gather: the
    all-gather of K/V) and the per-step gather, SP2, one branch."""
    from services.generation.cfg_parallel import CfgComm
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    comm = CfgComm.init(rank, world, port, device, sp=world)
    sp = comm.sp
    hq, hkv, d, hidden = (4, 2, 16, 64) if args.smoke else (32, 8, 128, 4096)
    out = {}
    labels = {"ulysses": "attention all-to-all (there and back), one layer, ulysses",
              "kv-gather": "K/V all-gather, one layer, kv-gather"}
    for side in ([256] if args.smoke else [2048, 4096]):
        n = (side // 32) ** 2
        lay = sp.layout([n], device)
        t = lay.local
        q_, k_, v_ = (torch.randn(t, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
        x = torch.randn(t, hidden, device=device, dtype=dtype)
        # the mode's wrapper around an attention that costs nothing (Ulysses: its output made contiguous,
        # as a real attention's is)
        layer = {m: _sp_view(sp, m).wrap_attend(lay, lambda i, qq, kk, vv: qq.contiguous())
                 for m in sp_modes(args.sp_mode)}
        fns = [(labels[m], lambda f=f: f(0, q_, k_, v_)) for m, f in layer.items()]
        for label, fn in fns + [("hidden gather, once per step", lambda: sp.gather_rows(lay, x))]:
            for _ in range(3):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                ts.append(time.perf_counter() - t0)
            out[f"{side}² {label}"] = {"step_s": statistics.median(ts)}
    if rank == 0:
        q.put(out)
    comm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="sp", choices=["sp", "4k", "comm"])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny geometry")
    p.add_argument("--sp-mode", default="both", choices=[*SP_MODES, "both"],
                   help="the SP mode(s) of the SP cases and of the comm part")
    p.add_argument("--cuda-graphs", default="off", choices=["off", "on", "both"],
                   help="the engine's step graphs: off, on, or each case both ways")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-gpus", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    ngpu = 0 if args.smoke else torch.cuda.device_count()
    limit = args.max_gpus or ngpu
    if args.part == "comm":
        res = spawn(2, _comm_rank, args) if (args.smoke or limit >= 2) else {}
        rows = [(k, v) for k, v in res.items()]
        print("| collective (SP2, one branch, bf16) | ms |\n|---|---:|")
        for k, v in rows:
            print(f"| {k} | {1e3 * v['step_s']:.3f} |")
    else:
        cases = with_graphs(with_modes(cases_for(args.part, args.smoke), sp_modes(args.sp_mode)), args.cuda_graphs)
        res = {}
        for world in sorted({c["world"] for c in cases}):
            mine = [c for c in cases if c["world"] == world]
            if not args.smoke and world > limit:
                for c in mine:
                    res[c["name"]] = {"skipped": f"needs {world} GPUs"}
                continue
            res.update(spawn(world, _rank_main, args, mine))
        _diff_vs_one_gpu(cases, res)
        print("| case | GPUs | s/step | peak GiB (rank 0) | max abs diff of the state vs one GPU, relative |\n"
              "|---|---:|---:|---:|---:|")
        for c in cases:
            r = res.get(c["name"], {"error": "missing"})
            if "step_s" in r:
                peak = f"{r['peak_gb']:.1f}" if "peak_gb" in r else "n/a"
                diff = f"{r['diff_vs_one_gpu']:.2e}" if "diff_vs_one_gpu" in r else ""
                print(f"| {c['name']} | {c['world']} | {r['step_s']:.4f} | {peak} | {diff} |")
            else:
                print(f"| {c['name']} | {c['world']} | {r.get('skipped') or r.get('error')} | | |")
        base = {(c["size"], c["guidance"], c["graphs"]): res.get(c["name"], {}).get("step_s")
                for c in cases if c["world"] == 1}
        for c in cases:
            r = res.get(c["name"], {})
            b = base.get((c["size"], c["guidance"], c["graphs"]))
            if c["world"] > 1 and b and "step_s" in r:
                print(f"- {c['name']}: {b / r['step_s']:.2f}x faster than one GPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)


if __name__ == "__main__":
    main()
