"""Weight streaming (services/model/weight_streaming.py, --weight-streaming-layers): one CFG denoise step of the
generation engine with every decoder layer resident vs streamed from pinned host memory through K device slots.

Per format (bf16, int8 W8A8) and size: the median step time of --steps after --warmup (guidance 4: two branches in
one forward, eager: streaming turns CUDA graphs off, so both sides run eager), the peak device memory of each case
(weights included), whether the streamed job's latent equals the resident one bit for bit, and the streamer's load
counts (on-demand loads mean a prefetch missed). Also the host->device bandwidth: one layer's tensors copied from
their pinned host copies into a slot on the side stream, and a plain pinned memcpy of the same bytes.

GPU (8B geometry, random weights; about 2 minutes on an H100):
    python -m bench.bench_weight_streaming --json /tmp/ws.json
CPU smoke (tiny geometry with 4 layers, 1 slot so slots are reused within a forward; CI runs it):
    python -m bench.bench_weight_streaming --smoke --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from services.generation.engine import Engine
from services.model.tiny import build_random_model, full_config, tiny_config
from services.model.weight_streaming import stream_decoder_layers

from bench.bench_generation import pinned_memcpy_seconds
from bench.genperf_common import admit, device_name, spec, sync


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variant", default="u1-8b", help="full config variant")
    p.add_argument("--sizes", default="1024,2048", help="image sides")
    p.add_argument("--formats", default="bf16,int8")
    p.add_argument("--slots", type=int, default=2, help="--weight-streaming-layers")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny geometry on the CPU, 1 slot, 1 step")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.device, args.sizes, args.slots, args.steps, args.warmup = "cpu", "64", 1, 1, 1
    return args


def _model(args, device, fmt: str):
    config = tiny_config("u1", num_hidden_layers=4) if args.smoke else full_config(args.variant)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if fmt == "int8":
        from services.model.quant_int8 import check_int8_device
        check_int8_device(device)
    return build_random_model(config, "gen", dtype, device, quantization="none" if fmt == "bf16" else fmt)


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def _case(engine: Engine, size: int, args) -> tuple[float, torch.Tensor, float | None]:
    """(median step seconds, the latent after every step, peak device GiB) of one CFG job at size²."""
    device = engine.device
    _peak_reset(device)
    job = admit(engine, spec(f"ws-{size}", size, args.warmup + args.steps + 1, 4.0))
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    x = job.x.detach().cpu().clone()
    peak = _peak_gib(device)
    engine.abort(job.request_id)
    return statistics.median(times), x, peak


def _bandwidth(streamer, device) -> dict:
    """One layer's tensors host -> slot on the side stream (what each prefetch does), and a plain pinned memcpy."""
    nbytes = streamer.report()["layer_bytes"]
    times = []
    for _ in range(7):
        sync(device)
        t0 = time.perf_counter()
        if streamer.stream is not None:
            with torch.cuda.stream(streamer.stream):
                for d, h in zip(streamer.slots[0], streamer.host[0]):
                    d.copy_(h, non_blocking=True)
            streamer.stream.synchronize()
        else:
            for d, h in zip(streamer.slots[0], streamer.host[0]):
                d.copy_(h)
        times.append(time.perf_counter() - t0)
    streamer.invalidate()      # slot 0 was overwritten behind the streamer's back
    sec = statistics.median(times[2:])
    memcpy = pinned_memcpy_seconds(nbytes, device)
    return {"layer_bytes": nbytes, "layer_copy_s": sec, "layer_copy_gb_s": nbytes / sec / 1e9,
            "memcpy_gb_s": nbytes / memcpy / 1e9 if memcpy else None,
            "all_layers_copy_s": sec * streamer.report()["layers"]}


def run_format(args, device, fmt: str) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    model = _model(args, device, fmt)
    engine = Engine(model, None)
    resident = {size: _case(engine, size, args) for size in sizes}
    streamer = stream_decoder_layers(model, args.slots)
    streamed = {size: _case(engine, size, args) for size in sizes}
    out = {"format": fmt, "streamer": streamer.report(), "bandwidth": _bandwidth(streamer, device), "rows": []}
    for size in sizes:
        (rs, rx, rp), (ss, sx, sp) = resident[size], streamed[size]
        out["rows"].append({"size": size, "resident_step_s": rs, "streamed_step_s": ss, "slowdown": ss / rs,
                            "bit_equal": bool(torch.equal(rx, sx)),
                            "resident_peak_gib": rp, "streamed_peak_gib": sp})
    del engine, model, streamer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main():
    args = parse_args()
    device = torch.device(args.device)
    res = {"device": device_name(device), "torch": torch.__version__, "slots": args.slots, "steps": args.steps,
           "formats": {fmt: run_format(args, device, fmt) for fmt in args.formats.split(",")}}
    print(f"device: {res['device']}, torch {res['torch']}, {args.slots} device slots, CFG 4, eager, median of "
          f"{args.steps} steps")
    print("| format | size | resident s/step | streamed s/step | slowdown | bit-equal | peak GiB resident | "
          "peak GiB streamed |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    gib = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    for f in res["formats"].values():
        for r in f["rows"]:
            print(f"| {f['format']} | {r['size']}² | {r['resident_step_s']:.4f} | {r['streamed_step_s']:.4f} | "
                  f"{r['slowdown']:.2f}x | {r['bit_equal']} | {gib(r['resident_peak_gib'])} | "
                  f"{gib(r['streamed_peak_gib'])} |")
    for f in res["formats"].values():
        b = f["bandwidth"]
        memcpy = "n/a" if b["memcpy_gb_s"] is None else f"{b['memcpy_gb_s']:.1f}"
        print(f"{f['format']}: one layer {b['layer_bytes'] / 2 ** 20:.1f} MiB host->device {b['layer_copy_gb_s']:.1f} "
              f"GB/s (plain pinned memcpy {memcpy} GB/s); all layers {b['all_layers_copy_s']:.3f} s a forward; "
              f"loads {f['streamer']['loads']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    if args.smoke and not all(r["bit_equal"] for f in res["formats"].values() for r in f["rows"]):
        raise SystemExit("a streamed step differs from the resident one")


if __name__ == "__main__":
    main()
