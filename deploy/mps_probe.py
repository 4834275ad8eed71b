#!/usr/bin/env python3
"""Where do NaN images under CUDA MPS come from? (docs/benchmarks/generation.md "NaN images under MPS").

On an H200 every text-to-image of a `u1serve up --gpu-sharing mps` stack (generation at 85 % of the SMs) came out
NaN, edits did not, time-sliced stacks and one stack at 60 % were finite. This probe takes the stack away: per
setting (no MPS, then MPS with generation capped at each `--sm-percents` value, under this probe's own daemon,
services/launch/mps.py) one child process builds the random-weight gen branch, publishes random prefix KV of a short
(t2i-like) and a long (edit-like) prompt into its own shm pool, runs CFG jobs through the real engine
(services/generation/engine.py: the import kernel, CUDA graphs as served, the step cache off) and checks, step by
step, that the state stays finite; on the first non-finite step it reruns that step eagerly with a forward hook on
every module of the gen branch and names the first one whose output is not finite (if its input was not finite
either, the NaN came from the functional code before it: attention, RoPE). One table: setting x prompt -> finite, or
the step and module where NaN appeared.

    python -m deploy.mps_probe                               # one H200: none, 85, 60 (~2-3 min)
    python -m deploy.mps_probe --sm-percents 85 --size 1024  # one setting
    python -m deploy.mps_probe --sm-percents 85 --runs default,nobucket,triton,eager  # which suspect it is
    python -m deploy.mps_probe --sm-percents '' --runs poison  # no MPS, but unwritten memory reads NaN
    python -m deploy.mps_probe --sm-percents 85 --baseline-runs '' --runs check,checkeager,check1024,ltnows
                                   # which GEMM computes a wrong value first (no host syncs), graphed or eager, at
                                   # the stack's shapes, and whether cuBLASLt's workspace algorithms (split-K /
                                   # stream-K) are it (~3-4 min on an H100)
    python -m deploy.mps_probe --cpu [--nan-prefix|--huge-prefix|--runs check --wrong-gemm MODULE]  # the tiny model
                                                             # on the CPU, no MPS (CI: the probe
                                                             # runs; a NaN prefix is refused at admission, an
                                                             # overflowing one is named where it first shows)

If every in-process setting is finite, the NaN needs the stack (understanding's prefill of the prefix under MPS,
or the prefix crossing processes through the pool): `deploy/gpu_smoke.sh --profiles colocate-1-mps` reproduces it
there (its "step cache reuses" check fails on NaN images).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = {"short (t2i)": (12, 8), "long (edit)": (320, 300)}     # (cond, uncond) prefix tokens
# --runs: the same setting again with one suspect swapped out, each in its own process (torch reads the cuDNN
# switch once): cuDNN's bucketed plans, cuDNN SDPA itself (the Triton denoise kernel instead), CUDA graphs;
# "poison": no suspect swapped out, but memory no kernel wrote reads NaN (MPS may hand a client memory another left).
# "blocking": every launch waits for the one before on the host (CUDA_LAUNCH_BLOCKING): a NaN that goes is a race;
# "sync": a device synchronize after every module (what the diagnosis's hooks add, without their checks);
# "noaddmmlt": addmm (the biased linears) on cuBLAS instead of cuBLASLt; "wsdet": cuBLAS with a fixed small
# workspace (its deterministic configuration, other algorithms); "normalprio": MPS client priority normal.
# Measured on an H100 (85 %): NaN in every run but "sync" and "noaddmmlt". Until 2026-12-06 the engine here ignored
# U1SERVE_CUDA_GRAPHS (it took "auto" as is), so "eager" and "blocking" replayed CUDA graphs like "default", and
# "sync" ran eagerly only because its synchronize broke the capture: the one eager run was the finite one. Now:
# "check": every Linear / Conv2d output compared with fp32 from its own input after each step (hooks that queue
# device copies only, no host sync; captured into the graphs, so replayed steps are checked as served;
# deploy/module_check.py): the first module that computed a wrong value, at which step, and whether running it
# again eagerly (once, then 20 times back to back), or as mm + bias, reproduces it; "checkeager": the same with
# CUDA graphs off; "ltnows": cuBLASLt with a 1 KiB workspace (no split-K / stream-K algorithm fits: their partial
# sums live there); "nows": the same for cuBLAS too; "preferlt": every GEMM on cuBLASLt (torch's preferred BLAS),
# not only the biased ones; "check1024": "check" at 1024² (the stack's shapes: 16x the rows, other GEMM algorithms;
# a stack with DISABLE_ADDMM_CUDA_LT=1 still made NaN; the check's copies take ~13 GB there, twice while a step is
# captured: MPS_PROBE_JOBS=2 in the environment batches two jobs per prompt, as the stack does, at twice that);
# "checklt": "check" with every GEMM on cuBLASLt (is the wrong GEMM cuBLAS's alone?);
# "ref": none of our Triton kernels (torch reference ops instead); "ltlog": "default" with cuBLASLt's API trace
# (every matmul's layouts, epilogue and algorithm) in cublaslt-<pid>.log at the repository root (copy it out).
POISON = "MPS_PROBE_POISON"
SYNC = "MPS_PROBE_SYNC"
CHECK = "MPS_PROBE_CHECK"
SIZE = "MPS_PROBE_SIZE"         # a run's image size instead of --size
JOBS = "MPS_PROBE_JOBS"         # jobs of each prompt batched in every step (default 1)
VARIANTS = {"default": {}, "nobucket": {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "0"},
            "triton": {"U1SERVE_DENOISE_BACKEND": "triton"}, "eager": {"U1SERVE_CUDA_GRAPHS": "0"},
            "poison": {POISON: "1"}, "blocking": {"CUDA_LAUNCH_BLOCKING": "1", "U1SERVE_CUDA_GRAPHS": "0"},
            "sync": {SYNC: "1", "U1SERVE_CUDA_GRAPHS": "0"}, "noaddmmlt": {"DISABLE_ADDMM_CUDA_LT": "1"},
            "wsdet": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, "normalprio": {"CUDA_MPS_CLIENT_PRIORITY": "0"},
            "check": {CHECK: "1"}, "checkeager": {CHECK: "1", "U1SERVE_CUDA_GRAPHS": "0"},
            "ltnows": {"CUBLASLT_WORKSPACE_SIZE": "1"},
            "nows": {"CUBLASLT_WORKSPACE_SIZE": "1", "CUBLAS_WORKSPACE_CONFIG": ":1:1"},
            "preferlt": {"TORCH_BLAS_PREFER_CUBLASLT": "1"},
            "check1024": {CHECK: "1", SIZE: "1024"},
            "checklt": {CHECK: "1", "TORCH_BLAS_PREFER_CUBLASLT": "1"},
            "ref": {"U1SERVE_KERNELS": "ref"},
            "ltlog": {"CUBLASLT_LOG_LEVEL": "5", "CUBLASLT_LOG_FILE": "cublaslt-%i.log"}}


def poison_unwritten_memory(device) -> None:
    """Make reads of memory no kernel wrote come back NaN. CUDA: fill torch's caching allocator with NaN-filled
    blocks of both pools (large and small) and free them into its cache, where later tensors are carved from.
    CPU: every float torch.empty / empty_like / new_empty starts NaN."""
    import torch
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        blocks = [torch.full((64 << 20,), float("nan"), dtype=torch.float16, device=device)    # 128 MiB each
                  for _ in range(min(64, max(1, int(free * 0.5) // (128 << 20))))]
        blocks += [torch.full((1 << 18,), float("nan"), dtype=torch.float16, device=device) for _ in range(512)]
        torch.cuda.synchronize(device)
        blocks.clear()          # back into torch's cache (not to the driver): later tensors are carved from them
        return

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty = lambda *a, **k: nan(empty(*a, **k))
    torch.empty_like = lambda *a, **k: nan(empty_like(*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: nan(new_empty(self, *a, **k))


def child(args) -> dict:
    """One setting, in this process (its MPS variables were set by the parent)."""
    import torch
    from shm_transfer import write_kv
    from bench.bench_generation import make_pool
    from services.contract.image import GenerateRequest
    from services.generation.engine import Engine
    from services.generation.kv_source import PrefixSource
    from services.generation.config import resolve_mode
    from services.kit.errors import APIError
    from services.model.tiny import build_random_model, full_config, tiny_config

    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = build_random_model(tiny_config("u1") if args.cpu else full_config(args.variant), "gen", dtype, device)
    if os.environ.get(POISON) == "1":
        poison_unwritten_memory(device)
    if os.environ.get(SYNC) == "1" and device.type == "cuda":
        for m in model.modules():
            m.register_forward_hook(lambda *_: torch.cuda.synchronize())
    if args.wrong_gemm:         # the check's own test: one module returns finite but wrong values
        model.get_submodule(args.wrong_gemm).register_forward_hook(lambda m, i, o: o * 3 + 1)
    check = None
    if os.environ.get(CHECK) == "1":
        from deploy.module_check import ModuleCheck
        check = ModuleCheck(model)
    n_jobs = int(os.environ.get(JOBS) or 1)
    pool = make_pool(model, 2 * n_jobs * sum(sum(p) for p in PROMPTS.values()), dtype)
    layout = pool.layout
    source = PrefixSource(pool.name, model.fingerprint, device)
    # as the server resolves --cuda-graphs auto: U1SERVE_CUDA_GRAPHS=0|1 (the eager runs) overrides it. Until
    # 2026-12-06 the probe passed "auto" straight to the engine, so its eager and blocking runs replayed graphs too.
    engine = Engine(model, source, cuda_graphs=resolve_mode("auto"))
    out = {"sm_count": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
           else None, "checked": check is not None, "jobs": n_jobs, "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    size = int(os.environ.get(SIZE) or args.size)

    def publish(branch: str, n: int, seed: int):
        """A handle of n random prefix tokens of `branch` in the pool."""
        h = pool.allocate(n, 600, branch=branch, t_offset=n)
        kv = torch.randn(layout.kv_shape(n), generator=torch.Generator().manual_seed(seed))
        if args.nan_prefix:          # the probe's own checks: a NaN prefix is refused at admission,
            kv[:, :, n // 2] = float("nan")
        if args.huge_prefix:         # a finite one that overflows is found in the layers and named
            kv[:, :, n // 2] = 3e38
        write_kv(pool, h, kv.to(layout.torch_dtype))
        return h

    try:
        for name, (p_cond, p_uncond) in PROMPTS.items():
            jobs = []
            try:                # n_jobs of this prompt (other seeds), batched in every step as the stack batches
                for j in range(n_jobs):
                    handles = {}
                    for branch, n in (("cond", p_cond), ("uncond", p_uncond)):
                        handles[branch] = publish(branch, n, n + j).to_dict()
                    spec = GenerateRequest(request_id=f"probe-{p_cond}-{j}", handles=handles, mode="t2i", width=size,
                                           height=size, n=1, num_inference_steps=args.steps, guidance_scale=4.0,
                                           seed=j)
                    job, _ = engine.admit(spec)
                    engine.add(job)
                    jobs.append(job)
            except APIError as e:           # nonfinite_prefix: the prefix came in NaN (engine.check_prefix_finite)
                out[name] = {"finite": False, "step": None, "first_nonfinite": f"refused at admission: {e.message}"}
                _drop(engine, jobs)
                continue
            out[name] = res = {"finite": True, "x_absmax": []}
            for step in range(args.steps):
                x_before = {id(j): j.x.clone() for j in jobs}
                engine.step()
                res["x_absmax"].append(max(float(j.x.abs().max()) for j in jobs))      # NaN shows as nan
                if check is not None and "wrong" not in res:
                    bad = check.first_offender()
                    if bad is not None:
                        res["wrong"] = {"step": step, **bad}
                broken = next((j for j in jobs if not bool(torch.isfinite(j.x).all())), None)
                if broken is not None:
                    res.update(finite=False, step=step,
                               first_nonfinite=_first_nonfinite(engine, broken, x_before[id(broken)]))
                    break
                if jobs[0].flow.done:
                    break
            _drop(engine, jobs)
        g = engine.graphs
        out["graphs"] = {"enabled": g.enabled, "captures": g.captures, "replays": g.replays, "failure": g.failure}
    finally:
        source.close()
        pool.close()
    return out


def _drop(engine, jobs) -> None:
    for job in jobs:
        if job in engine.running:
            engine.abort(job.request_id)
        job.free()


def _first_nonfinite(engine, job, x_before) -> str:
    """Rerun the failing step's forward eagerly (graphs off) from the state before it, hooks on every module: the
    first module (in call order) whose output holds NaN/Inf, or what the eager rerun saw."""
    import torch
    seen: list[str] = []

    def hook(name):
        def check(module, inputs, output):
            if not seen and isinstance(output, torch.Tensor) and output.is_floating_point() \
                    and not bool(torch.isfinite(output).all()):
                bad_in = any(isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                             for t in inputs)
                seen.append(f"{name} ({type(module).__name__}; its input {'was not' if bad_in else 'was'} finite)")
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in engine.model.named_modules() if n]
    graphs = engine.graphs.enabled
    try:
        engine.graphs.release()
        engine.graphs.enabled = False
        job.x = x_before
        job.flow.index -= 1                 # the failing step again
        if job not in engine.running:       # it was the last step: the job was retired
            engine.add(job)
        engine.step()
    except Exception as e:          # the diagnosis must come back even if the rerun trips
        return f"eager rerun failed: {type(e).__name__}: {e}"[:300]
    finally:
        for h in handles:
            h.remove()
        engine.graphs.enabled = graphs
    if seen:
        return seen[0]
    return ("no module output was non-finite in the eager rerun (the graphed step made the NaN)"
            if bool(torch.isfinite(job.x).all()) else "only the state update after the layers (sampler)")


def run_setting(label: str, env: dict, args) -> dict:
    cmd = [sys.executable, "-m", "deploy.mps_probe", "--child", "--size", str(args.size), "--steps", str(args.steps),
           "--variant", args.variant] + (["--cpu"] if args.cpu else []) + (["--nan-prefix"] if args.nan_prefix else []) \
        + (["--huge-prefix"] if args.huge_prefix else []) + (["--wrong-gemm", args.wrong_gemm] if args.wrong_gemm else [])
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"exit {r.returncode}: {(r.stderr or r.stdout)[-600:]}"}
    return json.loads(lines[-1])


def table_row(label: str, r: dict) -> str:
    """One setting's row: per prompt finite or where NaN appeared, the first wrong module ("check"), |x| per step."""
    if "error" in r:
        return f"| {label} | - | - | " + " | ".join([r["error"][:200]] * len(PROMPTS)) + " |"
    cells = []
    for k in PROMPTS:
        c = r[k]
        text = "finite" if c["finite"] else c["first_nonfinite"] if c["step"] is None \
            else f"NaN at step {c['step']}: {c['first_nonfinite']}"
        if "wrong" in c:
            text += f"; first wrong value at step {c['wrong']['step']}: {c['wrong']['detail']}"
        elif r.get("checked"):
            text += "; every checked output agreed with fp32"
        if c.get("x_absmax"):
            text += "; max abs x by step " + " ".join(f"{v:.3g}" for v in c["x_absmax"])
        cells.append(text)
    g = r.get("graphs") or {}
    graphs = (f"off ({g['failure'][:80]})" if g.get("failure") else "off" if not g.get("enabled")
              else f"{g['captures']} captured, {g['replays']} steps replayed")
    return f"| {label} | {r['sm_count'] or '-'} | {graphs} | " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sm-percents", default="85,60", help="MPS settings to try after the no-MPS one ('' for none)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variant", default="u1-8b")
    p.add_argument("--cpu", action="store_true", help="the tiny model on the CPU, no MPS settings (checks the probe)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--nan-prefix", action="store_true", help="write NaN into the prefix KV (checks the admission check)")
    p.add_argument("--huge-prefix", action="store_true", help="write 3e38 into the prefix KV (finite; checks the hooks)")
    p.add_argument("--wrong-gemm", default=None, metavar="MODULE",
                   help="make this module of the gen branch return finite but wrong values (checks the 'check' run)")
    p.add_argument("--runs", default="default",
                   help=f"per setting, the runs to make: {', '.join(VARIANTS)} (e.g. default,nobucket,triton,eager: "
                        "which suspect, swapped out, makes the NaN go)")
    p.add_argument("--baseline-runs", default=None, help="the runs of the no-MPS setting (default: --runs)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if args.cpu:
        args.size, args.sm_percents = min(args.size, 64), ""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    variants = [v.strip() for v in args.runs.split(",") if v.strip()]
    baseline = variants if args.baseline_runs is None else [v.strip() for v in args.baseline_runs.split(",") if v.strip()]
    unknown = set(variants + baseline) - set(VARIANTS)
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")

    header = ["| setting | SMs seen | CUDA graphs | " + " | ".join(PROMPTS) + " |", "|---|---:|---|" + "---|" * len(PROMPTS)]
    print("\n".join(header), flush=True)

    def run_variants(label: str, base_env: dict, runs: list[str]) -> None:
        for v in runs:           # each row as it comes: a run cut short by a time limit still says what it saw
            name = label if v == "default" else f"{label}, {v}"
            results[name] = run_setting(name, {**base_env, **VARIANTS[v]}, args)
            print(table_row(name, results[name]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)

    results: dict = {}
    run_variants("no MPS", env, baseline)
    for pct in [int(v) for v in args.sm_percents.split(",") if v.strip()]:
        from services.launch.mps import MpsDaemon
        with tempfile.TemporaryDirectory(prefix="u1-mps-probe-") as run_dir:
            daemon = MpsDaemon(run_dir, ["0"], pct)
            daemon.start(print)
            try:
                run_variants(f"MPS {pct} %", daemon.client_env(env, capped=True), variants)
            finally:
                daemon.stop(print)
    print("\n" + "\n".join(header + [table_row(label, r) for label, r in results.items()]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
