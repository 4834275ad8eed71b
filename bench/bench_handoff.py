"""KV handoff benchmark: export (engine paged KV -> pinned shm pages) and import (pages -> per-request
buffer) bandwidth and latency, vs a plain pinned memcpy of the same bytes in the same run.

GPU (the real measurement, 8B geometry by default):
    python bench/bench_handoff.py --tokens 365,4096
CPU smoke run (tiny shapes):
    python bench/bench_handoff.py --device cpu --layers 2 --tokens 17,100 --iters 3

Prints a markdown table and, with --json PATH, writes the raw numbers. Exits non-zero if any round trip
is not bit-exact.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shm_transfer import KVLayout, ShmKVPool, export_kv, import_kv  # noqa: E402
import kernels  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="365,4096", help="comma-separated prefix lengths")
    p.add_argument("--layers", type=int, default=42)  # SenseNova-U1 8B: 36 + 6 layers
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--image-tokens", type=int, default=4096, help="room after the prefix in the import buffer")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def timed_cuda(fn, iters, warmup, stream):
    """Per-iteration seconds measured with CUDA events on `stream`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    return times


def timed_wall(fn, iters, warmup, sync):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def summarize(name, tokens, nbytes, times):
    med = statistics.median(times)
    return {"op": name, "tokens": tokens, "bytes": nbytes, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
            "gbps": nbytes / med / 1e9}


def main():
    args = parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    lens = [int(x) for x in args.tokens.split(",")]
    lay = KVLayout(args.layers, args.kv_heads, args.head_dim, args.dtype, args.page_tokens)
    max_t = max(lens)
    pool_bytes = (lay.pages_for(max_t) + 1) * lay.page_bytes
    name = f"u1kv-bench-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    pool = ShmKVPool.create(name, lay, pool_bytes, "bench", pin=cuda)
    setup_s = time.perf_counter() - t0
    side = torch.cuda.Stream(dev) if cuda else None
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    S = 2 * max_t + 1024  # the engine's paged pool has more slots than the request
    g = torch.Generator(device="cpu").manual_seed(0)
    kv_pool = torch.randn(lay.kv_shape(S), generator=g, dtype=torch.float32).to(lay.torch_dtype).to(dev)
    rows = []
    ok = True
    try:
        for T in lens:
            nbytes = T * lay.bytes_per_token
            slots = torch.randperm(S, generator=g)[:T].to(torch.int32).to(dev)  # scattered, as in a paged pool
            h = pool.allocate(T, lease_s=600, branch="cond")
            dst = torch.empty(lay.kv_shape(T + args.image_tokens), dtype=lay.torch_dtype, device=dev)

            def do_export():
                export_kv(pool, h, kv_pool, slots, stream=side)  # returns at once when a stream is given

            def do_import():
                import_kv(pool, h, dst, stream=side)

            if cuda:
                t_exp = timed_cuda(do_export, args.iters, args.warmup, side)
                t_imp = timed_cuda(do_import, args.iters, args.warmup, side)
                # end to end from the caller's view: synchronous calls incl. validation and lease bookkeeping
                t_exp_sync = timed_wall(lambda: export_kv(pool, h, kv_pool, slots), args.iters, args.warmup, sync)
                t_imp_sync = timed_wall(lambda: import_kv(pool, h, dst), args.iters, args.warmup, sync)
            else:
                t_exp = t_exp_sync = timed_wall(do_export, args.iters, args.warmup, sync)
                t_imp = t_imp_sync = timed_wall(do_import, args.iters, args.warmup, sync)
            sync()
            ok &= bool(torch.equal(dst[:, :, :T], kv_pool[:, :, slots.long()]))
            rows += [summarize("export (paged -> shm pages)", T, nbytes, t_exp),
                     summarize("import (shm pages -> buffer)", T, nbytes, t_imp),
                     summarize("export, sync call", T, nbytes, t_exp_sync),
                     summarize("import, sync call", T, nbytes, t_imp_sync)]

            if cuda:  # the floor: one plain pinned memcpy of the same bytes each way
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                with torch.cuda.stream(side):
                    d2h = timed_cuda(lambda: host.copy_(devbuf, non_blocking=True), args.iters, args.warmup, side)
                    h2d = timed_cuda(lambda: devbuf.copy_(host, non_blocking=True), args.iters, args.warmup, side)
                    shm_flat = pool.pages.view(-1).view(torch.uint8)[:nbytes]
                    d2s = timed_cuda(lambda: shm_flat.copy_(devbuf, non_blocking=True), args.iters, args.warmup,
                                     side)
                rows += [summarize("plain pinned memcpy D2H", T, nbytes, d2h),
                         summarize("plain pinned memcpy H2D", T, nbytes, h2d),
                         summarize("memcpy D2H into registered shm", T, nbytes, d2s)]
                del host, devbuf
            pool.release(h)
            del dst
        stats = pool.stats()
    finally:
        pool.close()

    env = {"device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "layout": lay.to_dict(), "pool_setup_s": setup_s,
           "copy_backend": ("triton" if cuda and kernels.HAS_TRITON and kernels.kernel_mode() != "ref"
                            else "torch reference") + f" (U1SERVE_KERNELS={kernels.kernel_mode()})",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"# KV handoff: {env['device']}, torch {env['torch']}, copy backend {env['copy_backend']}")
    print(f"# layout {lay.to_dict()} ({lay.bytes_per_token} B/token), pool create+pin {setup_s:.3f} s")
    print("| op | tokens | MB | median ms | min ms | GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | {r['median_ms']:.3f} | {r['min_ms']:.3f} "
              f"| {r['gbps']:.1f} |")
    print(f"round trip bit-exact: {ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "exact": ok, "pool_stats": stats}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
