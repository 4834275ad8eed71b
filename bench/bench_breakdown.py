"""Where a 2048² image request spends the time that is not denoising steps.

Three parts, each runs alone:

--part engine (torch + numpy; Pillow for the encode rows): the engine side of the output path
    pixels to uint8: old (uint8 on the device, permuted copy to pageable host memory, then the
    contiguous copy PIL needs) vs new (contiguous uint8 on the device, one copy into pinned memory);
    encoding one image: Pillow PNG level 0/1/3/6, JPEG q90, WebP q90 method 0, base64, and the
    service's own PNG writer (services/generation/encode.py) on one thread and in strips on 2 / 4 / 8
    threads and the service's default count (usable CPUs: affinity and cgroup quota); n = 4
    images encoded by 1 vs 4 threads (Pillow releases the GIL while it encodes).
--part services (the real processes: `u1serve up` machinery, fastapi/uvicorn/pyzmq needed): image
    requests through the gateway, one at a time, with the services' stage marks on (U1SERVE_TIMELINE=1,
    services/kit/timeline.py); the median time of each stage: gateway, prefix prefill + export, admission
    (KV import), the steps (measured on the device), pixels, pipe, encode, SSE, transfers, response.
--part handoff (torch; one process, as the fused colocate mode runs both engines): the prefix handoff of one
    image, shm pages vs device pages (shm_transfer's "shm" and "device" transports, the code the services run):
    understanding's side (allocate the CFG branches' handles, export from the engine's paged KV) and
    generation's (claim, import into the job's buffer, release), each synchronised; the median of --repeat and
    the difference: what the device transport takes off the non-step time of one image.

    python -m bench.bench_breakdown --part engine --device cuda --sizes 1024,2048
    python -m bench.bench_breakdown --part services --model DIR_OR_tiny --device cuda --size 2048
    python -m bench.bench_breakdown --part services --model DIR --device cuda --size 1024 --steps 8 --guidance 1 \
        --prompts vary --up-args "--quantization fp8"    # each request a prompt of a new length, as users send
    python -m bench.bench_breakdown --part handoff --device cuda --prefix-tokens 365,24
CPU smoke (seconds):
    python -m bench.bench_breakdown --part engine --device cpu --sizes 256
    python -m bench.bench_breakdown --part services --model tiny --device cpu --size 64 --steps 4 --repeat 2
    python -m bench.bench_breakdown --part handoff --smoke
Target (GPU): everything but the steps <= 0.35 s for one 2048² image.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shlex
import statistics
import time

import torch

from services.model import sampler as S


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["engine", "services", "handoff"], default="engine")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="1024,2048", help="--part engine")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--model", default="tiny", help="--part services: checkpoint dir or 'tiny'")
    p.add_argument("--size", type=int, default=2048, help="--part services")
    p.add_argument("--steps", type=int, default=8, help="--part services")
    p.add_argument("--guidance", type=float, default=4.0,
                   help="--part services: 4 = CFG (two prefixes); 1 = one branch, as issue 39's 8-step targets")
    p.add_argument("--prompts", choices=["same", "vary"], default="same",
                   help="--part services: the same prompt every request, or one of a new length each (users' prompts "
                        "differ: a prompt length the engine has not run is a new shape for generation's graphs)")
    p.add_argument("--up-args", default="", help="--part services: extra `u1serve up` flags (shell quoting), "
                   "e.g. '--quantization fp8'")
    p.add_argument("--prefix-tokens", default="365,24",
                   help="--part handoff: the prefix tokens of each CFG branch of one image (cond,uncond)")
    p.add_argument("--smoke", action="store_true", help="--part handoff: tiny geometry on the CPU, seconds")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.device, args.repeat = "cpu", 3
    return args


def _median_s(fn, repeat: int, sync=None) -> float:
    fn()
    out = []
    for _ in range(repeat):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def test_image(size: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    """A photo-like [-1, 1] image (smooth shapes, texture, mild noise): compresses like real output."""
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    chans = [torch.sin(6.3 * xx * (c + 1)) * torch.cos(4.1 * yy * (c + 2)) * 0.6
             + 0.3 * torch.sin(40 * (xx + yy * c)) * (xx > 0.5) for c in range(3)]
    img = torch.stack(chans)[None] + 0.03 * torch.randn(1, 3, size, size, generator=g)
    return img.clamp(-1, 1).to(device=device, dtype=dtype)


def part_engine(args) -> dict:
    import numpy as np
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "rows": []}
    try:
        from PIL import Image
    except ImportError:
        Image = None

    def old_path(x):   # the previous to_uint8: permuted view copied to pageable memory, then made contiguous
        y = ((x.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
        return np.ascontiguousarray(y.numpy())

    def new_path(x):
        return S.to_host(S.to_uint8_device(x)).numpy()

    print(f"device: {out['device']}")
    print("| image | uint8 + to host, old | new (device uint8, pinned copy) | format | encode s | "
          "bytes | base64 s |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        x = test_image(size, device)
        old = _median_s(lambda: old_path(x), args.repeat, sync)
        new = _median_s(lambda: new_path(x), args.repeat, sync)
        assert np.array_equal(old_path(x), new_path(x))
        pixels = new_path(x)[0]
        row = {"size": size, "to_host_old_s": old, "to_host_new_s": new, "encode": {}}
        if Image is None:
            print(f"| {size}² | {old:.4f} | {new:.4f} | (Pillow not installed: no encode rows) | | | |")
        for name, kw in [("png0", {"format": "PNG", "compress_level": 0}),
                         ("png1", {"format": "PNG", "compress_level": 1}),
                         ("png3", {"format": "PNG", "compress_level": 3}),
                         ("png6", {"format": "PNG", "compress_level": 6}),
                         ("jpeg90", {"format": "JPEG", "quality": 90}),
                         ("webp90m0", {"format": "WEBP", "quality": 90, "method": 0})] if Image else []:
            buf = io.BytesIO()

            def enc():
                buf.seek(0)
                buf.truncate()
                Image.fromarray(pixels, "RGB").save(buf, **kw)
            sec = _median_s(enc, max(2, args.repeat // 2))
            data = buf.getvalue()
            b64 = _median_s(lambda: base64.b64encode(data), args.repeat)
            row["encode"][name] = {"seconds": sec, "bytes": len(data), "base64_s": b64}
            print(f"| {size}² | {old:.4f} | {new:.4f} | {name} | {sec:.4f} | {len(data)} | {b64:.4f} |")
        if Image is not None:   # ours: sub filter + RLE deflate in strips (services/generation/encode.py)
            from concurrent.futures import ThreadPoolExecutor

            from services.generation.encode import encode_png, png_threads, usable_cpus
            runs = [("u1png_1thread", False, None)] + [
                (f"u1png_strips_{n}threads", True, n) for n in sorted({2, 4, 8, png_threads()}) if n > 1]
            for name, par, n in runs:
                with ThreadPoolExecutor(n or 1) as pool:
                    sec = _median_s(lambda: encode_png(pixels, parallel=par, pool=pool), max(3, args.repeat))
                    data = encode_png(pixels, parallel=par, pool=pool)
                row["encode"][name] = {"seconds": sec, "bytes": len(data)}
                print(f"| {size}² | | | {name} | {sec:.4f} | {len(data)} | |")
            row["png_threads_default"], row["usable_cpus"] = png_threads(), usable_cpus()
            print(f"| {size}² | | | (service default: {png_threads()} threads; usable CPUs {usable_cpus()}, "
                  f"os.cpu_count {os.cpu_count()}) | | | |")

            def encode_one(_):
                b = io.BytesIO()
                Image.fromarray(pixels, "RGB").save(b, format="PNG", compress_level=1)
                return len(b.getvalue())
            for threads in (1, 4):
                with ThreadPoolExecutor(threads) as pool:
                    sec = _median_s(lambda: list(pool.map(encode_one, range(4))), 2)
                row[f"png1_4images_{threads}threads_s"] = sec
            print(f"| {size}² | | | png1 x4 images, 1 vs 4 threads | {row['png1_4images_1threads_s']:.4f} / "
                  f"{row['png1_4images_4threads_s']:.4f} | | |")
        out["rows"].append(row)
    return out


# (label, from mark, to mark): consecutive stages of one request; marks are (service, stage), see
# services/kit/timeline.py. "steps" is measured, not estimated: admission -> the last step's end on the device.
STAGES = [
    ("client -> gateway (HTTP, validation)", ("client", "start"), ("gateway", "request")),
    # the prefix: understanding prefill + KV export, in seven
    ("gateway -> understanding (validation, HTTP)", ("gateway", "request"), ("und", "request")),
    ("understanding: prompt, pages, submit", ("und", "request"), ("und", "submitted")),
    ("understanding engine: socket, queue, schedule", ("und", "submitted"), ("und", "engine_step")),
    ("understanding engine: prefill forward (device)", ("und", "engine_step"), ("und", "engine_forward")),
    ("understanding engine: KV export (device)", ("und", "engine_forward"), ("und", "engine_export")),
    ("understanding engine: sample, outputs back", ("und", "engine_export"), ("und", "exported")),
    ("understanding -> gateway (handles, HTTP)", ("und", "exported"), ("gateway", "prefix_done")),
    ("gateway -> generation", ("gateway", "prefix_done"), ("gen", "request")),
    ("admission: queue, KV import, job set-up", ("gen", "request"), ("gen", "admitted")),
    ("denoising steps", ("gen", "admitted"), ("gen", "step_done#last")),
    ("pixels -> uint8 on the device -> pinned host", ("gen", "step_done#last"), ("gen", "pixels")),
    ("engine -> HTTP process (pipe)", ("gen", "pixels"), ("gen", "image_event")),
    ("encode (PNG + base64)", ("gen", "image_event"), ("gen", "encoded")),
    ("SSE event", ("gen", "encoded"), ("gen", "sse_event")),
    ("generation -> gateway (HTTP, parse)", ("gen", "sse_event"), ("gateway", "image_event")),
    ("gateway response built", ("gateway", "image_event"), ("gateway", "response")),
    ("response -> client (serialise, transfer, read)", ("gateway", "response"), ("client", "done")),
]


def stage_times(marks: list[tuple[float, str, str]]) -> dict[str, float]:
    """Seconds per stage of one request from its marks (time-ordered (t, service, stage))."""
    at: dict[tuple[str, str], float] = {}
    steps = [t for t, svc, st in marks if (svc, st) == ("gen", "step_done")]
    for t, svc, st in marks:
        at.setdefault((svc, st), t)
    at[("gen", "step_done#last")] = steps[-1]
    out = {label: at[b] - at[a] for label, a, b in STAGES}
    out["steps"] = len(steps)
    out["step_s_each"] = [b - a for a, b in zip([at[("gen", "admitted")]] + steps, steps)]   # the first from admission
    out["step_s_median"] = statistics.median(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 0.0
    return out


def part_services(args) -> dict:
    """The real stack (`u1serve up` machinery) with stage marks on (U1SERVE_TIMELINE=1): one non-stream request at
    a time through the gateway; each stage's median over --repeat requests, and the first request's (run before them,
    right after ready: what it pays more is what the warm-ups miss)."""
    import glob

    import httpx

    from services.launch.stack import add_stack_flags, build_stack
    from services.base import knobs
    from services.kit import timeline
    from services.base.netutil import free_port
    os.environ[knobs.TIMELINE.name] = "1"           # the services inherit it
    ns = argparse.ArgumentParser()
    add_stack_flags(ns, model_default="tiny")
    port = free_port()
    dev = "cpu" if args.device == "cpu" else "cuda"
    stack_args = ns.parse_args(["--model", args.model, "--device", dev, "--host", "127.0.0.1",
                                "--port", str(port), "--und-port", str(free_port()),
                                "--gen-port", str(free_port()), "--grace", "5",
                                "--default-size", f"{args.size}x{args.size}"] + shlex.split(args.up_args))
    stack_args.run_dir = os.path.join("/tmp", f"u1-breakdown-{port}")
    stack = build_stack(stack_args, echo_logs=False)
    stack.start()
    body = {"prompt": "a lighthouse at dusk", "size": f"{args.size}x{args.size}", "seed": 1,
            "num_inference_steps": args.steps, "guidance_scale": args.guidance}
    windows = []   # (client start, client done, response bytes)
    try:
        with httpx.Client(timeout=600) as c:
            for i in range(args.repeat + 1):             # the first one: what a first request after ready pays
                t0 = time.time()
                prompt = body["prompt"] + " and a gull" * (i if args.prompts == "vary" else 0)   # longer each time
                r = c.post(f"http://127.0.0.1:{port}/v1/images/generations",
                           json={**body, "prompt": prompt, "seed": 1 + i})
                windows.append((t0, time.time(), len(r.content)))
                assert r.status_code == 200, r.text
                time.sleep(0.3)                          # no overlap between requests' marks
    finally:
        stack.stop()
    marks = []
    for path in glob.glob(os.path.join(stack_args.run_dir, "**", "*.log"), recursive=True):
        with open(path, errors="replace") as f:
            marks += timeline.parse(f)
    timed = []
    for t0, t1, _ in windows:
        mine = [(t0, "client", "start")] + [m for m in marks if t0 <= m[0] <= t1] + [(t1, "client", "done")]
        timed.append(stage_times(mine))
    first, per_request = timed[0], timed[1:]
    res = {"size": args.size, "steps": args.steps, "up_args": args.up_args, "prompts": args.prompts,
           "requests": len(per_request),
           "response_bytes": windows[-1][2], "stages": {}, "first_request": first}
    for label, _, _ in STAGES:
        res["stages"][label] = statistics.median(p[label] for p in per_request)
    res["total_s"] = statistics.median(t1 - t0 for t0, t1, _ in windows[1:])
    res["first_total_s"] = windows[0][1] - windows[0][0]
    res["step_s"] = statistics.median(p["step_s_median"] for p in per_request)
    res["non_steps_s"] = statistics.median(t1 - t0 - p["denoising steps"]
                                           for (t0, t1, _), p in zip(windows[1:], per_request))
    print(f"{args.size}² x {args.steps} steps {args.up_args}, prompts: {args.prompts}, median of {len(per_request)} "
          "requests, "
          f"response {res['response_bytes'] / 1e6:.1f} MB; the first request after ready beside them\n")
    print("| stage | seconds | first request s |\n|---|---:|---:|")
    for label, v in res["stages"].items():
        print(f"| {label} | {v:.4f} | {first[label]:.4f} |")
    print(f"| **total** (client) | {res['total_s']:.4f} | {res['first_total_s']:.4f} |")
    print(f"| **everything but the steps** | **{res['non_steps_s']:.4f}** |")
    print("\nthe first request's steps, s: " + ", ".join(f"{v:.4f}" for v in first["step_s_each"]))
    print("a later request's steps, s:   " + ", ".join(f"{v:.4f}" for v in per_request[-1]["step_s_each"]))
    print(f"\nmedian step {res['step_s']:.4f} s (device end to device end); target for everything but the "
          f"steps: <= 0.35 s on GPU")
    return res


def _one_handoff(kind: str, args, geometry: dict, branches: list[int]) -> dict:
    """One transport: --repeat images' handoffs (after one warm-up), each side synchronised; medians."""
    import uuid

    from shm_transfer import DeviceTransport, KVHandle, KVLayout, LocalShmTransport
    from shm_transfer.producer import attach_exporter, create_producer
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    lay = KVLayout(**geometry)
    name, fp = f"u1kv-breakdown-{uuid.uuid4().hex[:8]}", "bench-breakdown"
    size = 4 * sum(lay.pages_for(n) for n in branches) * lay.page_bytes
    producer = create_producer(kind, name, lay, size, fp, pin=False,           # as understanding's HTTP side
                               **({"device": device} if kind == "device" else {}))
    exporter = attach_exporter(name, fp)                                  # the understanding engine
    consumer = (DeviceTransport if kind == "device" else LocalShmTransport).attach(name, expected_fingerprint=fp)
    g = torch.Generator().manual_seed(0)
    kv_pool = torch.randn(lay.kv_shape(max(4096, 2 * sum(branches))), generator=g).to(device, lay.torch_dtype)
    slots = [torch.randperm(kv_pool.shape[2], generator=g)[:n].to(device) for n in branches]
    bufs = [torch.empty(lay.kv_shape(n + 16), dtype=lay.torch_dtype, device=device) for n in branches]
    exports, imports, exact = [], [], True
    try:
        for i in range(args.repeat + 1):
            sync()
            t0 = time.perf_counter()
            wired = []
            for n, sl in zip(branches, slots):         # understanding: allocate (HTTP side), export (engine)
                h = producer.allocate(n, lease_s=60)
                exporter.export_kv(h, kv_pool, sl)
                wired.append(json.loads(json.dumps(h.to_dict())))
            sync()
            t1 = time.perf_counter()
            for d, buf in zip(wired, bufs):            # generation: claim (HTTP side), import, release (engine)
                h = consumer.claim(KVHandle.from_dict(d))
                consumer.import_kv(h, buf)
                consumer.release(h)
            sync()
            t2 = time.perf_counter()
            if i:
                exports.append(t1 - t0)
                imports.append(t2 - t1)
        for sl, buf, n in zip(slots, bufs, branches):
            exact &= bool(torch.equal(buf[:, :, :n], kv_pool[:, :, sl]))
        left = producer.stats()["pages_used"]
    finally:
        consumer.close()
        exporter.close()
        producer.close()
    return {"export_s": statistics.median(exports), "import_s": statistics.median(imports), "bit_exact": exact,
            "pages_left": left}


def part_handoff(args) -> dict:
    """The prefix handoff of one image (its CFG branches' prefixes), shm pages vs device pages, in one process."""
    branches = [int(n) for n in args.prefix_tokens.split(",")]
    geometry = (dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_tokens=16) if args.smoke else
                dict(num_layers=42, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_tokens=64))  # 8B: 36 + 6
    rows = {kind: _one_handoff(kind, args, geometry, branches) for kind in ("shm", "device")}
    dev = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    nbytes = sum(branches) * geometry["num_layers"] * 2 * geometry["num_kv_heads"] * geometry["head_dim"] * (
        2 if geometry["dtype"] == "bfloat16" else 4)
    print(f"prefix handoff of one image ({'+'.join(map(str, branches))} tokens, {nbytes / 1e6:.1f} MB) on {dev}, "
          f"median of {args.repeat}\n")
    print("| stage | shm s | device s |\n|---|---:|---:|")
    for key, label in (("export_s", "prefix: allocate + KV export"), ("import_s", "admission: claim + KV import + release")):
        print(f"| {label} | {rows['shm'][key]:.5f} | {rows['device'][key]:.5f} |")
    total = {k: r["export_s"] + r["import_s"] for k, r in rows.items()}
    print(f"| **handoff, non-step time of one image** | **{total['shm']:.5f}** | **{total['device']:.5f}** |")
    print(f"\ndevice pages take {total['shm'] - total['device']:+.5f} s off the non-step time of one image "
          f"(negative: they add it)")
    exact = all(r["bit_exact"] and r["pages_left"] == 0 for r in rows.values())
    print(f"imports bit-exact, no pages left: {exact}")
    if not exact:
        raise SystemExit(1)
    return {"device": dev, "prefix_tokens": branches, "bytes": nbytes, "geometry": geometry, "rows": rows,
            "handoff_s": total}


def main():
    args = parse_args()
    res = {"engine": part_engine, "services": part_services, "handoff": part_handoff}[args.part](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
