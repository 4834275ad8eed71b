"""Where a 2048² image request spends the time that is not denoising steps.

Two parts, each runs alone:

--part engine (torch + numpy; Pillow for the encode rows): the engine side of the output path
    pixels to uint8: old (uint8 on the device, permuted copy to pageable host memory, then the
    contiguous copy PIL needs) vs new (contiguous uint8 on the device, one copy into pinned memory);
    encoding one image: Pillow PNG level 0/1/3/6, JPEG q90, WebP q90 method 0, base64, and the
    service's own PNG writer (services/generation/encode.py) on one thread and in strips on 2 / 4 / 8
    threads and the service's default count (usable CPUs: affinity and cgroup quota); n = 4
    images encoded by 1 vs 4 threads (Pillow releases the GIL while it encodes).
--part services (the real processes: `u1serve up` machinery, fastapi/uvicorn/pyzmq needed): one
    request through the gateway (non-stream and stream), the prefix call to understanding alone and
    the generate call to generation alone; the breakdown: prefix prefill + export, handoff / import,
    steps, and the tail (last step -> image on the client: uint8, pipe, encode, base64, SSE, gateway).

    python bench/bench_breakdown.py --part engine --device cuda --sizes 1024,2048
    python bench/bench_breakdown.py --part services --model DIR_OR_tiny --device cuda --size 2048
CPU smoke (seconds):
    python bench/bench_breakdown.py --part engine --device cpu --sizes 256
    python bench/bench_breakdown.py --part services --model tiny --device cpu --size 64 --steps 4
Target (GPU): everything but the steps <= 0.35 s for one 2048² image.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.model import sampler as S  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["engine", "services"], default="engine")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="1024,2048", help="--part engine")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--model", default="tiny", help="--part services: checkpoint dir or 'tiny'")
    p.add_argument("--size", type=int, default=2048, help="--part services")
    p.add_argument("--steps", type=int, default=8, help="--part services")
    p.add_argument("--json", default=None)
    return p.parse_args()


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


def part_services(args) -> dict:
    """The real stack (`u1serve up` machinery): gateway, understanding, generation processes."""
    import httpx

    from services.cli import add_stack_flags, build_stack
    from services.contract.image import GenerateRequest, PrefixRequest
    from services.netutil import free_port
    ns = argparse.ArgumentParser()
    add_stack_flags(ns, model_default="tiny")
    port = free_port()
    dev = "cpu" if args.device == "cpu" else "cuda"
    stack_args = ns.parse_args(["--model", args.model, "--device", dev, "--host", "127.0.0.1",
                                "--port", str(port), "--und-port", str(free_port()),
                                "--gen-port", str(free_port()), "--grace", "5",
                                "--default-size", f"{args.size}x{args.size}",
                                "--internal-token", "bench-token"])
    stack_args.run_dir = os.path.join("/tmp", f"u1-breakdown-{port}")
    stack = build_stack(stack_args, echo_logs=False)
    stack.start()
    hdr = {"X-U1-Internal-Token": "bench-token"}
    und, gen = f"http://127.0.0.1:{stack_args.und_port}", f"http://127.0.0.1:{stack_args.gen_port}"
    body = {"prompt": "a lighthouse at dusk", "size": f"{args.size}x{args.size}", "seed": 1,
            "num_inference_steps": args.steps, "guidance_scale": 4.0}
    res = {"size": args.size, "steps": args.steps}
    try:
        with httpx.Client(timeout=600) as c:
            c.post(f"http://127.0.0.1:{port}/v1/images/generations", json=body)   # warm
            t0 = time.perf_counter()
            r = c.post(f"http://127.0.0.1:{port}/v1/images/generations", json=body)
            res["total_s"] = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            marks = []   # (event type, seconds since the request)
            t0 = time.perf_counter()
            with c.stream("POST", f"http://127.0.0.1:{port}/v1/images/generations",
                          json={**body, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        marks.append((json.loads(line[6:])["type"], time.perf_counter() - t0))
            prog = [t for k, t in marks if k.endswith(".progress")]
            done = [t for k, t in marks if k.endswith(".completed")][0]
            res["first_progress_s"] = prog[0]
            res["step_s"] = statistics.median(b - a for a, b in zip(prog, prog[1:]))
            res["tail_s"] = done - prog[-1]
            # the two engines alone (same prompt, the gateway's internal bodies)
            # the gateway's internal bodies, declared once in the request contract
            pre = PrefixRequest(request_id="bd-pre", mode="t2i", prompt=body["prompt"],
                                guidance_scale=4.0).model_dump(exclude_none=True)
            t0 = time.perf_counter()
            r = c.post(und + "/internal/image_prefix", json=pre, headers=hdr)
            assert r.status_code == 200, r.text
            handles = r.json()["handles"]
            res["prefix_s"] = time.perf_counter() - t0
            gb = GenerateRequest(request_id="bd-gen", handles=handles, width=args.size, height=args.size,
                                 num_inference_steps=args.steps, guidance_scale=4.0,
                                 seed=1).model_dump(exclude_none=True)
            t0 = time.perf_counter()
            with c.stream("POST", gen + "/internal/generate", json=gb, headers=hdr) as s:
                for line in s.iter_lines():
                    if '"progress"' in line and "first" not in res:
                        res["first"] = time.perf_counter() - t0
            res["generate_s"] = time.perf_counter() - t0
            res["import_and_first_step_s"] = res.pop("first")
    finally:
        stack.stop()
    steps_total = res["step_s"] * args.steps
    res["non_steps_s"] = res["total_s"] - steps_total
    res["gateway_s"] = res["total_s"] - res["prefix_s"] - res["generate_s"]
    print(f"| {args.size}² x {args.steps} steps | seconds |\n|---|---:|")
    for k in ("total_s", "prefix_s", "import_and_first_step_s", "step_s", "tail_s", "generate_s",
              "gateway_s", "non_steps_s"):
        print(f"| {k} | {res[k]:.4f} |")
    print(f"non-denoising share (total - steps x median step): {res['non_steps_s']:.3f} s (target <= 0.35 s on GPU)")
    return res


def main():
    args = parse_args()
    res = part_engine(args) if args.part == "engine" else part_services(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
