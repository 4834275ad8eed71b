"""Live weight update latency through the API: a whole generation-branch update (random values at the model's
geometry, under the checkpoint's key names) written to disk, then `POST /v1/rl/weights` against a running
`u1serve up`; the answer's stage / commit / total seconds, and an image request after each update (serving
goes on, with the new weights).

GPU, one H200 (8B geometry, random weights; the update is the full gen branch, ~15 GB bf16 on disk):
    python -m bench.bench_weight_update --profiles colocate-1 --repeat 3 --json weight_update.json
CPU smoke run (tiny checkpoint, seconds; also the upload route):
    python -m bench.bench_weight_update --tiny --profiles cpu-colocate --repeat 1

The update directory goes to --update-dir (default: a temporary directory, removed at the end).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import httpx

from bench.stack import enable_rl, exit_status, prepare_model, profile_table, run_all, stack_args


def write_gen_update(model_dir: str, out_dir: str, seed: int = 0) -> tuple[int, int]:
    """Random values for every gen-branch key of the checkpoint's geometry, as bf16 safetensors shards (made on
    the GPU when there is one: fast). Returns (tensors, bytes)."""
    import torch
    from safetensors.torch import save_file

    from services.model.config import load_config
    from services.model.skeleton import skeleton
    from services.model.weights_io import key_branch
    meta = skeleton(load_config(model_dir), "gen")
    shapes = {k: p.shape for k, p in meta.named_parameters() if key_branch(k) == "gen"}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    total, shard, size, n_shard = 0, {}, 0, 0
    keys = sorted(shapes)
    os.makedirs(out_dir, exist_ok=True)
    for i, k in enumerate(keys):
        t = torch.empty(shapes[k], device=dev, dtype=torch.float32)
        t.normal_(0, 0.02, generator=g) if t.dim() > 1 else t.fill_(1.0)
        shard[k] = t.to(torch.bfloat16).cpu()
        size += shard[k].numel() * 2
        if size >= (2 << 30) or i == len(keys) - 1:     # one directory of files, no index: the update reader
            n_shard += 1                                 # takes every *.safetensors of it
            save_file(shard, os.path.join(out_dir, f"update-{n_shard:03d}.safetensors"))
            total += size
            shard, size = {}, 0
    return len(keys), total


async def measure(base: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=3600) as c:
        async def image() -> float:
            t0 = time.perf_counter()
            r = await c.post("/v1/images/generations", json={"prompt": "a lighthouse", "size": args.size,
                                                              "num_inference_steps": args.steps, "seed": 1})
            r.raise_for_status()
            return time.perf_counter() - t0
        first_image = await image()
        runs = []
        for i in range(args.repeat):
            t0 = time.perf_counter()
            r = await c.post("/v1/rl/weights", json={"path": args.update_dir, "version": f"bench-{i + 1}"})
            wall = time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(f"update failed: {r.status_code} {r.text[:500]}")
            body = r.json()
            runs.append({"wall_s": wall, **{k: body[k] for k in ("seconds", "stage_seconds", "commit_seconds",
                                                                  "updated", "weights_version")},
                         "image_after_s": await image()})
        out = {"runs": runs, "image_before_s": first_image}
        if args.tiny:     # the upload route too (a small model's whole update in the body)
            files = sorted(os.listdir(args.update_dir))
            with open(os.path.join(args.update_dir, files[0]), "rb") as f:
                data = f.read()
            t0 = time.perf_counter()
            r = await c.post("/v1/rl/weights/upload", params={"version": "bench-upload"}, content=data,
                             headers={"content-type": "application/octet-stream"})
            if r.status_code != 200:
                raise RuntimeError(f"upload failed: {r.status_code} {r.text[:500]}")
            out["upload"] = {"wall_s": time.perf_counter() - t0, "bytes": len(data), **r.json()}
        v = (await c.get("/v1/rl/weights")).json()
        if v["weights_version"] is None:
            raise RuntimeError(f"engines disagree on the version after the updates: {v}")
        out["final_version"] = v["weights_version"]
        return out


def table(results: dict, args) -> str:
    def row(r: dict) -> list[str]:
        med = {k: statistics.median(x[k] for x in r["runs"])
               for k in ("stage_seconds", "commit_seconds", "seconds", "wall_s", "image_after_s")}
        return [f"{med['stage_seconds']:.2f}", f"{med['commit_seconds']:.2f}", f"{med['seconds']:.2f}",
                f"{med['wall_s']:.2f}", f"{med['image_after_s']:.2f} ({r['image_before_s']:.2f})"]
    return profile_table(
        f"Whole generation-branch update ({args.update_tensors} tensors, {args.update_bytes / 2**30:.2f} GiB "
        f"bf16 on disk), `POST /v1/rl/weights`, {args.repeat} runs (median); then one {args.size} "
        f"{args.steps}-step image.",
        ["profile", "stage s", "commit s", "total s (API)", "wall s", "image after s (before)"], results, row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_args(p, "colocate-1")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--size", default="512x512")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--update-dir", default=None, help="where the update is written (default: a temporary dir)")
    args = p.parse_args()
    if args.tiny:
        args.size = "64x64" if args.size == "512x512" else args.size
    model_dir = prepare_model(args)
    made = args.update_dir is None
    args.update_dir = args.update_dir or tempfile.mkdtemp(prefix="u1bench-update-")
    enable_rl(args, args.update_dir)
    try:
        t0 = time.perf_counter()
        args.update_tensors, args.update_bytes = write_gen_update(model_dir, args.update_dir)
        print(f"update written: {args.update_tensors} tensors, {args.update_bytes / 2**30:.2f} GiB in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        results = run_all(args, model_dir, measure, table)
    finally:
        if made:
            shutil.rmtree(args.update_dir, ignore_errors=True)
    sys.exit(exit_status(results))


if __name__ == "__main__":
    main()
