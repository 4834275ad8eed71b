"""The whole-stack benches' common part (bench_deployment, bench_interleave, bench_weight_update, bench_rl,
bench_ray): a `u1serve up` stack per deployment profile on free loopback ports (or the running one of --up-url), a
measurement against it, and the markdown table with one row a profile (a failed profile is a row saying so, and a
non-zero exit)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

from services.base import knobs
from services.base.netutil import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROFILES = {  # name -> u1serve up flags
    "colocate-tp2-cfg2": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2",
    "colocate-tp2-cfg2-yield": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 --qos-yield-share 0.5",
    "separate-tp2-cfg2": "--mode separate --und-gpus 0,1 --gen-gpus 2,3 --und-tp 2 --gen-cfg-parallel 2",
    "separate-1+1": "--mode separate --und-gpus 0 --gen-gpus 1",
    "colocate-1": "--mode colocate --und-gpus 0",
    # the colocate QoS defaults off, explicitly: today's behaviour before issue 25 (bench/bench_qos.py's A side)
    "colocate-1-timeslice": "--mode colocate --und-gpus 0 --gpu-sharing time-slice --qos-yield-share 0",
    # both engines in one process, each loop a thread on its own CUDA stream (services/fused; issue 38)
    "colocate-1-fused": "--mode colocate --und-gpus 0 --colocate-engines fused",
    # and generation's stream in a CUDA green context of 75 % of the SMs (services/model/streams.py)
    "colocate-1-fused-green75": "--mode colocate --und-gpus 0 --colocate-engines fused --gen-sm-percent 75",
    "colocate-1-fused-green50": "--mode colocate --und-gpus 0 --colocate-engines fused --gen-sm-percent 50",
    # the A/B at equal offered load: the device pool as deep as the load's image requests (64 clients x two 365-token
    # prefixes ~ 4.5 GiB), so image requests queue as they do behind the two-process side's 16 GiB host pool; the
    # pool is made inside understanding's memory share, so that share grows by the pool and generation's shrinks
    # (with 0.35 understanding kept 1,666 KV tokens: docs/benchmarks/load.md)
    "colocate-1-fused-green75-pool8": "--mode colocate --und-gpus 0 --colocate-engines fused --gen-sm-percent 75 "
                                      "--kv-pool-gb 8 --und-memory-fraction 0.45 --gen-memory-fraction 0.45",
    "colocate-1-fused-green50-pool8": "--mode colocate --und-gpus 0 --colocate-engines fused --gen-sm-percent 50 "
                                      "--kv-pool-gb 8 --und-memory-fraction 0.45 --gen-memory-fraction 0.45",
    "colocate-1-mps-nogate": "--mode colocate --und-gpus 0 --gpu-sharing mps --qos-yield-share 0",
    "colocate-1-mps": "--mode colocate --und-gpus 0 --gpu-sharing mps",
    "colocate-tp2-cfg2-mps": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 --gpu-sharing mps",
    "colocate-tp2-cfg2-mps-normal": "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 --gpu-sharing "
                                    "mps --gen-priority normal",
    "cpu-colocate": "--mode colocate --device cpu",
    "cpu-colocate-timeslice": "--mode colocate --device cpu --gpu-sharing time-slice --qos-yield-share 0",
    "cpu-colocate-fused": "--mode colocate --device cpu --colocate-engines fused",
    "cpu-colocate-yield": "--mode colocate --device cpu --qos-yield-share 0.5",
    "cpu-separate": "--mode separate --device cpu",
    "cpu-separate-cfg2-sp2": "--mode separate --device cpu --gen-cfg-parallel 2 --gen-sp 2",
}


def stack_args(p: argparse.ArgumentParser, profiles: str) -> None:
    """The flags of every whole-stack bench."""
    p.add_argument("--profiles", default=profiles)
    p.add_argument("--variant", default="u1-8b", help="full-size config (random weights)")
    p.add_argument("--tiny", action="store_true", help="tiny checkpoint instead (CPU smoke run)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--port", type=int, default=0, help="the gateway's port (default: a free one; the engines "
                                                       "always take free ones)")
    p.add_argument("--up-args", default="", help="extra `u1serve up` flags for every profile (shell quoting), e.g. "
                        "--quantization fp8 --gen-args '--cache-mode first_block --cache-threshold 0.1'")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--up-url", default=None, help="measure this running `u1serve up` instead of starting one (one "
                        "profile: the stack's own flags; an RL bench's needs the RL routes and its update dir allowed)")


def enable_rl(args, *update_dirs: str) -> None:
    """An RL bench's stack: the RL routes on (they are off unless the operator turns them on) and the directories
    its weight updates are read from allowed (docs/deployment.md "Tenants and the operator")."""
    extra = ["--enable-rl"] + (["--allowed-local-dirs", ",".join(update_dirs)] if update_dirs else [])
    args.up_args = " ".join([shlex.join(extra), args.up_args]).strip()


def prepare_model(args) -> str:
    """The checkpoint directory (tiny, or a full-size config with random weights) and the log directory."""
    from services.model.tiny import write_full_config, write_tiny_checkpoint
    work = tempfile.mkdtemp(prefix="u1bench-")
    args.log_dir = args.log_dir or os.path.join(work, "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    model_dir = os.path.join(work, "model")
    (write_tiny_checkpoint(model_dir, "u1") if args.tiny else write_full_config(model_dir, args.variant))
    return model_dir


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"u1serve up exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError("stack did not become healthy in time")


def run_profile(name: str, model_dir: str, args, measure: Callable, label: str | None = None) -> dict:
    """Start the profile's stack on free ports, run `measure(base, args)` against it (async), stop it. `label`:
    its run directory and log name (default: the profile's name). A bench whose settings are the stack's flags (one
    stack per setting) cannot measure a running stack: --up-url is refused here, not ignored (run_all honours it)."""
    if getattr(args, "up_url", None):
        raise SystemExit("--up-url: this bench starts a stack per setting (its flags are what it measures)")
    from services.launch.stack import TINY_DEFAULT_SIZE
    port = args.port or free_port()
    label = (label or name).replace("/", "-")
    # a tiny checkpoint's directory is no `--model tiny` to the launcher: its default size said here, else the
    # generation engine warms a 2048x2048 image before ready (14 s of each CPU stack start, 2026-12-07)
    tiny = ["--default-size", TINY_DEFAULT_SIZE] if args.tiny else []
    cmd = [sys.executable, "-m", "services.launch.cli", "up", "--model", model_dir, "--port", str(port),
           "--und-port", str(free_port()), "--gen-port", str(free_port()), "--host", "127.0.0.1",
           "--no-restart", "--run-dir", os.path.join(args.log_dir, label), *PROFILES[name].split(), *tiny,
           *shlex.split(args.up_args)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{knobs.RANDOM_WEIGHTS.name: "0" if args.tiny else "1"})
    log = open(os.path.join(args.log_dir, f"{label}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    before = signal.signal(signal.SIGTERM, _interrupt)   # a bench killed by `timeout` / kill still stops its stack
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, args.startup_timeout)
        startup_s = time.time() - t0
        res = asyncio.run(measure(base, args))
        res["startup_s"] = startup_s
        res["command"] = "u1serve up " + PROFILES[name]
        return res
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        signal.signal(signal.SIGTERM, before)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_all(args, model_dir: str, measure: Callable, table: Callable) -> dict:
    """Every profile in turn (a failed one is reported, the others still run); prints the table, writes --json.
    With --up-url: the running stack, as the one profile named (its own flags, not the profile's or --up-args)."""
    if args.up_url and "," in args.profiles:
        raise SystemExit("--up-url measures one running stack: name one profile (the row it is reported as)")
    results = {}
    for name in args.profiles.split(","):
        try:
            results[name] = ({**asyncio.run(measure(args.up_url, args)), "command": f"running stack at {args.up_url}"}
                             if args.up_url else run_profile(name, model_dir, args, measure))
        except Exception as e:
            results[name] = {"error": repr(e)}
        print(name, json.dumps(results[name]), flush=True)
    print(table(results, args))
    write_json(args, results)
    return results


def write_json(args, results: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


def exit_status(results: dict) -> int:
    """1 when a profile (or side) failed: its row says why, the exit status makes it count."""
    return 1 if any("error" in r for r in results.values()) else 0


def profile_table(intro: str, columns: list[str], results: dict, row: Callable[[dict], list[str]]) -> str:
    """A markdown table, one row a profile: `row(result)` gives the cells after the name; a failed profile's row
    says why."""
    rows = [intro, "", "| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for name, r in results.items():
        cells = ([f"failed: {r['error'][:80]}"] + [""] * (len(columns) - 2)) if "error" in r else row(r)
        rows.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(rows)
