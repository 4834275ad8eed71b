"""How `u1serve up` launches the fused mode: the understanding and generation specs of a colocate stack become one
service, `python -m services.fused.server`, with each side's flags after `--und` / `--gen`. Light (no torch): the
launcher imports it. The flags the fused launch adds to each side are here, in one place."""
from __future__ import annotations

import sys

from services.base import knobs

ENGINES = ("processes", "fused")
DEFAULT_ENGINES = "processes"       # fused becomes the 1-GPU default only once it measures better on a GPU
DEFAULT_WHY = "the default (fused is opt-in until measured better on a GPU: docs/deployment.md)"
# each engine's loop a thread of the fused process, on a stream of its priority (services/model/streams.py)
# and the image prefix KV handed over in device pages (shm_transfer/device_pages.py): it never leaves the GPU
UND_FLAGS = ("--engine-unit", "thread", "--stream-priority", "high", "--kv-transport", "device")
GEN_FLAGS = ("--engine-unit", "thread", "--stream-priority", "low")
# the device pool's default size (--kv-pool-gb): its pages take GPU memory from understanding's share, and they
# hold only in-flight prefixes (8B: ~172 KB a token). One request may take half of it (--max-prefix-pool-share):
# 3 GiB is the smallest whose half holds a 2048² edit's prefixes (146 pages of 64 tokens,
# memory_plan.prefix_pool_pages; at 2 GiB such an edit was 400 kv_request_too_large), and ~26 T2I requests of two
# 365-token branches waiting for import at once (more get a fast 429 kv_pool_full)
DEVICE_POOL_GB = 3.0
UND_MARK, GEN_MARK = "--und", "--gen"
SERVICE = "fused"


def refusal(args) -> str | None:
    """Why these flags cannot run fused (None: they can)."""
    if args.mode != "colocate":
        return "--colocate-engines fused is for --mode colocate (both engines on one device)"
    if (args.und_replicas, args.gen_replicas) != (1, 1):
        return "--colocate-engines fused runs one understanding and one generation replica"
    if args.und_tp != 1 or args.gen_cfg_parallel * args.gen_sp != 1:
        return "--colocate-engines fused runs one rank of each engine (--und-tp 1, --gen-cfg-parallel 1, --gen-sp 1)"
    if args.gpu_sharing == "mps":
        return "--gpu-sharing mps shares a GPU between processes; the fused engines are one process"
    if args.lora:
        return "--lora merges adapters at load per engine process; serve them with --lora-modules in the fused mode"
    return None


def fuse(specs: list, placement, extra: list[str] = (), gen_sm_percent: int | None = None) -> list:
    """The stack's specs with its `und` and `gen` replaced by the one fused service (at und's place in the start
    order). Each side's argv is its server's, minus `python -m services.X.server`, plus UND_FLAGS / GEN_FLAGS; the
    memory shares move from the environment (one process) to flags of the fused server; `extra`: --fused-args;
    `gen_sm_percent` (up's --gen-sm-percent): generation's stream in a green context of that SM share."""
    import dataclasses
    und = next(s for s in specs if s.name == "und")
    gen = next(s for s in specs if s.name == "gen")
    env = {k: v for k, v in {**und.env, **gen.env}.items() if k != knobs.GPU_MEMORY_FRACTION.name}
    argv = [sys.executable, "-m", "services.fused.server"]
    if placement.und_fraction is not None:
        argv += ["--und-memory-fraction", f"{placement.und_fraction:.3f}",
                 "--gen-memory-fraction", f"{placement.gen_fraction:.3f}"]
    green = ["--green-sm-percent", str(gen_sm_percent)] if gen_sm_percent and gen_sm_percent < 100 else []
    argv += [*extra, UND_MARK, *und.argv[3:], *UND_FLAGS, GEN_MARK, *gen.argv[3:], *GEN_FLAGS, *green]
    # ready once generation is: the fused process starts generation's server after understanding's engine is ready
    fused = dataclasses.replace(gen, name=SERVICE, argv=argv, env=env)
    out = []
    for s in specs:
        if s is und:
            out.append(fused)
        elif s is not gen:
            out.append(s)
    return out
