"""KV handoff benchmark between two processes: a producer process exports (engine paged KV -> its pool
pages) and this process, the consumer, imports (pages -> per-request buffer), through the Transport the
engines use: `--transport shm` (same-host pool) or `--transport network` (NIXL: one-sided reads of the
producer's pool over what UCX finds: RDMA, CUDA IPC, shared memory or TCP). On CUDA also a plain pinned
memcpy of the same bytes as the floor.

GPU (the real measurement, 8B geometry by default):
    python -m bench.bench_handoff --transport shm --tokens 365,4096
    python -m bench.bench_handoff --transport network --tokens 365,4096
CPU smoke run (tiny shapes, seconds; CI runs it):
    python -m bench.bench_handoff --smoke --transport shm
    UCX_TLS=tcp python -m bench.bench_handoff --smoke --transport network
Across two network namespaces joined by a veth pair (as two hosts on one machine: root, Linux, iproute2; the
namespaces and the pair are made for the run and removed after it):
    python -m bench.bench_handoff --transport network --netns --tokens 365,4096

Prints a markdown table and, with --json PATH, writes the raw numbers. Exits non-zero if any import is
not bit-exact.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from shm_transfer import KVHandle, KVLayout
from shm_transfer.producer import create_producer
from shm_transfer.transport import LocalShmTransport
import kernels

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
    p.add_argument("--transport", choices=("shm", "network"), default="shm")
    p.add_argument("--netns", action="store_true",
                   help="network transport between two network namespaces joined by a veth pair (root)")
    p.add_argument("--veth-mtu", type=int, default=1500, help="MTU of the veth pair (--netns)")
    p.add_argument("--in-netns", default=None, help=argparse.SUPPRESS)   # the run inside the pair (JSON)
    p.add_argument("--smoke", action="store_true", help="tiny geometry on the CPU, a few seconds")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.netns and args.transport != "network":
        p.error("--netns measures the network transport: add --transport network")
    if args.smoke:
        args.tokens, args.layers, args.kv_heads, args.head_dim = "17,300", 2, 2, 64
        args.page_tokens, args.image_tokens, args.iters, args.warmup, args.device = 16, 16, 5, 1, "cpu"
    return args


NETNS_SUBNET = "10.213.{}.{}"


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def netns_pair(mtu: int):
    """Two network namespaces joined by a veth pair (producer .1, consumer .2 of a /30): {"producer": (ns, ip,
    device), "consumer": (...)}; both removed afterwards (the pair goes with them)."""
    tag = f"{os.getpid() % 100000}"
    side = {"producer": (f"u1kv-p{tag}", NETNS_SUBNET.format(os.getpid() % 250, 1), f"u1p{tag}"),
            "consumer": (f"u1kv-c{tag}", NETNS_SUBNET.format(os.getpid() % 250, 2), f"u1c{tag}")}
    made = []
    try:
        for ns, _, _ in side.values():
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        (pns, pip, pdev), (cns, cip, cdev) = side["producer"], side["consumer"]
        _ip("link", "add", pdev, "mtu", str(mtu), "netns", pns, "type", "veth", "peer", "name", cdev, "mtu", str(mtu),
            "netns", cns)
        for ns, dev, addr in ((pns, pdev, pip), (cns, cdev, cip)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield side
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def netns_executable(ns: str, workdir: str) -> str:
    """A python that starts inside network namespace `ns` (`ip netns exec` also shows the process that
    namespace's /sys/class/net, where UCX looks for its devices): the producer process's executable."""
    path = os.path.join(workdir, f"python-in-{ns}")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec ip netns exec {ns} {sys.executable} "$@"\n')
    os.chmod(path, 0o755)
    return path


def in_netns_main(args, argv: list[str]) -> int:
    """--netns: make the pair, run this benchmark again inside the consumer's namespace (it starts the producer
    in the other one), remove the pair."""
    with netns_pair(args.veth_mtu) as side:
        inner = [a for a in argv if a != "--netns"] + ["--in-netns", json.dumps(side)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["ip", "netns", "exec", side["consumer"][0], sys.executable, "-m", "bench.bench_handoff",
                               *inner], cwd=root).returncode


def engine_kv(lay: KVLayout, max_t: int, device) -> tuple[torch.Tensor, dict]:
    """The producer's paged KV and each length's scattered slots; the same in both processes (seeded)."""
    S = 2 * max_t + 1024  # the engine's paged pool has more slots than the request
    g = torch.Generator(device="cpu").manual_seed(0)
    kv_pool = torch.randn(lay.kv_shape(S), generator=g, dtype=lay.torch_dtype).to(device)  # no fp32 copy: 8B x 9k slots
    return kv_pool, g


def producer_main(conn, args, lay_dict, name, netns=None) -> None:
    """The understanding side: create the transport, export each length, hand the handle over."""
    network = {}
    if netns is not None:                     # (namespace, address, device): the producer "host"
        os.environ["UCX_NET_DEVICES"] = netns[2]   # its veth end, as one names the NIC on a real host
        network["advertise_host"] = netns[1]
    lay = KVLayout.from_dict(lay_dict)
    dev = torch.device(args.device)
    lens = [int(x) for x in args.tokens.split(",")]
    max_t = max(lens)
    kind = "nixl" if args.transport == "network" else "shm"
    t0 = time.perf_counter()
    tr = create_producer(kind, name, lay, (lay.pages_for(max_t) + 1) * lay.page_bytes, "bench",
                         pin=dev.type == "cuda", **network)
    setup_s = time.perf_counter() - t0
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    kv_pool, g = engine_kv(lay, max_t, dev)
    try:
        conn.send(("ready", setup_s))
        for T in lens:
            slots = torch.randperm(kv_pool.shape[2], generator=g)[:T].to(torch.int32).to(dev)
            h = tr.allocate(T, lease_s=600, branch="cond")
            times = timed_wall(lambda: tr.export_kv(h, kv_pool, slots), args.iters, args.warmup, sync)
            conn.send(("handle", h.to_dict(), times))
            assert conn.recv() == "imported"
            tr.release(h)
        conn.send(("stats", tr.stats()))
        conn.recv()
    finally:
        tr.close()


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


def consumer(args, lay: KVLayout, name: str):
    if args.transport == "network":
        from shm_transfer.nixl_transport import NixlTransport
        # the network path itself: on one host the consumer would otherwise read the pool through shm
        return NixlTransport.connect(expected_fingerprint="bench", same_host_shm=False)
    return LocalShmTransport.attach(name, expected_fingerprint="bench", pin=args.device == "cuda")


def main():
    args = parse_args()
    if args.netns:
        return in_netns_main(args, sys.argv[1:])
    return run(args, json.loads(args.in_netns) if args.in_netns else None)


def run(args, netns=None):
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    lens = [int(x) for x in args.tokens.split(",")]
    lay = KVLayout(args.layers, args.kv_heads, args.head_dim, args.dtype, args.page_tokens)
    name = f"u1kv-bench-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    if netns:     # this process runs in the consumer's namespace; the producer starts in the other one
        os.environ["UCX_NET_DEVICES"] = netns["consumer"][2]
        ctx.set_executable(netns_executable(netns["producer"][0], tempfile.mkdtemp(prefix="u1kv-netns-")))
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(child, args, lay.to_dict(), name,
                                                   netns["producer"] if netns else None), daemon=True)
    proc.start()
    if not conn.poll(300):
        raise RuntimeError(f"the producer process did not start (exit code {proc.exitcode})")
    tag, setup_s = conn.recv()
    tr = consumer(args, lay, name)
    side = torch.cuda.Stream(dev) if cuda else None
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    kv_pool, g = engine_kv(lay, max(lens), "cpu")  # the producer's KV, to check the imports against
    rows, ok = [], True
    where = f"{args.transport}, veth netns" if netns else args.transport
    try:
        for T in lens:
            slots = torch.randperm(kv_pool.shape[2], generator=g)[:T]
            tag, hd, t_exp = conn.recv()
            h = KVHandle.from_dict(hd)
            nbytes = T * lay.bytes_per_token
            dst = torch.empty(lay.kv_shape(T + args.image_tokens), dtype=lay.torch_dtype, device=dev)
            t_imp = timed_wall(lambda: tr.import_kv(h, dst), args.iters, args.warmup, sync)
            rows += [summarize(f"export ({args.transport} producer, sync call)", T, nbytes, t_exp),
                     summarize(f"import ({where}, other process, sync call)", T, nbytes, t_imp)]
            if cuda and args.transport == "shm":  # the kernel alone, on a side stream
                rows.append(summarize("import (shm pages -> buffer, side stream)", T, nbytes, timed_cuda(
                    lambda: tr.import_kv(h, dst, stream=side), args.iters, args.warmup, side)))
            sync()
            ok &= bool(torch.equal(dst[:, :, :T].cpu(), kv_pool[:, :, slots.long()]))
            if cuda:  # the floor: one plain pinned memcpy of the same bytes each way
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                with torch.cuda.stream(side):
                    h2d = timed_cuda(lambda: devbuf.copy_(host, non_blocking=True), args.iters, args.warmup, side)
                rows.append(summarize("plain pinned memcpy H2D", T, nbytes, h2d))
                del host, devbuf
            conn.send("imported")
        tag, stats = conn.recv()
        conn.send("done")
        consumer_stats = tr.stats()
    finally:
        tr.close()
        proc.join(30)

    env = {"device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "layout": lay.to_dict(), "transport": args.transport,
           "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"), "producer_setup_s": setup_s,
           "path": f"veth pair between two network namespaces, MTU {args.veth_mtu}" if netns else "one namespace",
           "copy_backend": ("triton" if cuda and kernels.HAS_TRITON and kernels.kernel_mode() != "ref"
                            else "torch reference") + f" (U1SERVE_KERNELS={kernels.kernel_mode()})",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"# KV handoff between two processes, transport {where}"
          f"{' (UCX_TLS=' + env['ucx_tls'] + ')' if args.transport == 'network' else ''}: {env['device']}, "
          f"torch {env['torch']}, copy backend {env['copy_backend']}")
    print(f"# layout {lay.to_dict()} ({lay.bytes_per_token} B/token), producer setup {setup_s:.3f} s")
    print("| op | tokens | MB | median ms | min ms | GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | {r['median_ms']:.3f} | {r['min_ms']:.3f} "
              f"| {r['gbps']:.1f} |")
    print(f"imports bit-exact: {ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "exact": ok, "producer_stats": stats,
                       "consumer_stats": consumer_stats}, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
