"""Quality cost of each acceleration, on your own weights: PSNR / SSIM against the exact settings,
with the speed.

For every prompt, the exact image (the checkpoint, the model dtype, --steps, --guidance) is generated
through the generation engine in-process (the serving code path; prefixes from the reference
pipeline); then each setting of --settings is generated with the same seed and compared with it:
    fp8            gen-branch Linear layers in fp8 (services/model/quant.py)
    cache:T        first-block step caching with threshold T (per CFG branch)
    truncate:V     CFG only while t <= V (cond alone on the tail)
    preset:8step   the 8-step recipe (8 steps, guidance 1, shift 3): with --lora the 8-step adapter
It also reports the per-step velocity error of fp8 against the model dtype along the exact 8-step
trajectory of the first prompt (the fp8 numerics check).

    python bench/bench_quality.py --model /models/SenseNova-U1-8B-MoT --prompts prompts.txt \
        --size 2048 --steps 50 --settings fp8,cache:0.05,cache:0.1,truncate:0.8
    python bench/bench_quality.py --smoke        # CPU, tiny checkpoint, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from image_quality import psnr, ssim  # noqa: E402
from services.generation.engine import Engine  # noqa: E402
from services.contract.image import GenerateRequest  # noqa: E402
from services.model import reference as R  # noqa: E402
from services.model import sampler as S  # noqa: E402

DEFAULT_PROMPTS = ["a red fox in the snow, watercolor", "a lighthouse at dusk, photo",
                   "a poster that says OPEN SOURCE in bold letters"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="checkpoint directory, or tiny / tiny-u1.5")
    p.add_argument("--prompts", default=None, help="text file, one prompt per line (or jsonl with 'prompt')")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--settings", default="fp8,cache:0.05,cache:0.1,truncate:0.8")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="adapters for preset:8step runs (e.g. the official 8-step LoRA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--smoke", action="store_true", help="tiny checkpoint on CPU, 128², 4 steps")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.model, args.device, args.size, args.steps = "tiny", "cpu", 128, 4
        args.settings, args.prompts_list = "fp8,cache:0.2,truncate:0.3,preset:8step", DEFAULT_PROMPTS[:1]
    return args


def prompts_of(args) -> list[str]:
    if getattr(args, "prompts_list", None):
        return args.prompts_list
    if not args.prompts:
        return DEFAULT_PROMPTS
    out = []
    for line in open(args.prompts):
        line = line.strip()
        if line:
            out.append(json.loads(line)["prompt"] if line.startswith("{") else line)
    return out


def model_dir(name: str) -> str:
    if name.startswith("tiny"):
        from services.cli import ensure_tiny_checkpoint, tiny_variant
        return ensure_tiny_checkpoint(tiny_variant(name), out=sys.stderr)
    return name


class Runner:
    """One loaded model and its engine; generates a prompt's image with given settings."""

    def __init__(self, path, device, dtype, tok, quantization=None, lora=None):
        from services.model.loader import load_model
        self.model = load_model(path, "both", dtype=dtype, device=device, quantization=quantization,
                                lora=lora or [])
        self.engine = Engine(self.model, None)
        self.tok = tok

    def generate(self, prompt, size, steps, guidance, shift, seed, cache=None):
        params = S.SamplerParams(num_inference_steps=steps, guidance_scale=guidance, timestep_shift=shift)
        pre = R.image_prefixes(self.model, self.tok, "t2i", prompt, [], params)
        spec = GenerateRequest(request_id="q", handles={b: {} for b in pre}, mode="t2i", width=size, height=size,
                               n=1, num_inference_steps=steps, guidance_scale=guidance, timestep_shift=shift,
                               seed=seed, cache=cache)
        job = self.engine.admit_local(spec, {b: p.kv for b, p in pre.items()},
                                      {b: p.t_offset for b, p in pre.items()})
        self.engine.add(job)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        t0 = time.perf_counter()
        while not job.flow.done:
            self.engine.step()
        img = self.engine.pixels(job)[0]
        seconds = time.perf_counter() - t0
        job.free()
        return img, seconds, job.branch_steps, pre


def fp8_velocity_error(base: Runner, fp8: Runner, pre, size: int, seed: int) -> list[float]:
    """Relative velocity error of fp8 vs the base model at each step of the base 8-step trajectory."""
    m16, m8 = base.model, fp8.model
    th = tw = size // 32
    s = S.noise_scale(m16.cfg, th * tw)
    x = S.initial_noise(1, size, size, seed, m16.device, m16.dtype, s)
    grid = S.timesteps(8, 3.0, device=m16.device)
    kv = pre["cond"].kv.to(m16.device, m16.dtype)
    out = []
    with torch.inference_mode():
        for k in range(8):
            t = grid[k]
            v = [R.gen_velocity(m, kv, pre["cond"].t_offset, m.gen_embed(x, t, s), S.patchify(x), t, th, tw, 0.02)
                 for m in (m16, m8)]
            out.append(((v[1].float() - v[0].float()).norm() / v[0].float().norm()).item())
            x = S.unpatchify(S.euler(S.patchify(x), v[0], t, grid[k + 1]), th, tw)
    return out


def main():
    args = parse_args()
    from services.model.presets import PRESETS
    from services.model.tokenizer import NeoTokenizer
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    path = model_dir(args.model)
    tok = NeoTokenizer.from_dir(path)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    base = Runner(path, device, dtype, tok)
    runners = {"base": base}
    if "fp8" in settings:
        runners["fp8"] = Runner(path, device, dtype, tok, quantization="fp8")
    if any(s.startswith("preset:") for s in settings) and args.lora:
        from services.model.lora_spec import parse_lora_spec
        runners["lora"] = Runner(path, device, dtype, tok, lora=[parse_lora_spec(x) for x in args.lora])
    rows = {s: [] for s in ["exact"] + settings}
    velocity = None
    for i, prompt in enumerate(prompts_of(args)):
        common = dict(size=args.size, seed=args.seed)
        exact, t_exact, bs, pre = base.generate(prompt, steps=args.steps, guidance=args.guidance, shift=3.0,
                                                **common)
        rows["exact"].append({"psnr": float("inf"), "ssim": 1.0, "seconds": t_exact, "branch_steps": bs})
        if i == 0 and "fp8" in runners:
            velocity = fp8_velocity_error(base, runners["fp8"], pre, args.size, args.seed)
        for s in settings:
            kind, _, val = s.partition(":")
            run, kw = base, dict(steps=args.steps, guidance=args.guidance, shift=3.0, cache=None)
            if kind == "fp8":
                run = runners["fp8"]
            elif kind == "cache":
                kw["cache"] = {"mode": "first_block", "threshold": float(val)}
            elif kind == "truncate":
                kw["cache"] = {"cfg_truncation": float(val)}
            elif kind == "preset":
                p = PRESETS[val]
                run = runners.get("lora", base)
                kw.update(steps=p.num_inference_steps, guidance=p.guidance_scale, shift=p.timestep_shift)
            else:
                raise SystemExit(f"unknown setting {s!r}")
            img, sec, bs, _ = run.generate(prompt, **kw, **common)
            rows[s].append({"psnr": psnr(img, exact), "ssim": ssim(img, exact), "seconds": sec,
                            "branch_steps": bs})
    print(f"model {args.model}, {args.size}², {args.steps} steps, guidance {args.guidance}, {dtype}, "
          f"{device}, {len(rows['exact'])} prompt(s)")
    print("| setting | PSNR dB vs exact | SSIM vs exact | s / image | speedup | steps computed (cond, uncond) |")
    print("|---|---:|---:|---:|---:|---|")
    t0 = statistics.median(r["seconds"] for r in rows["exact"])
    summary = {}
    for s, rs in rows.items():
        ps = statistics.median(r["psnr"] for r in rs)
        ss = statistics.median(r["ssim"] for r in rs)
        sec = statistics.median(r["seconds"] for r in rs)
        bs = rs[0]["branch_steps"]
        comp = ", ".join(str(bs[b]["computed"]) for b in ("cond", "uncond") if b in bs)
        print(f"| {s} | {ps:.2f} | {ss:.4f} | {sec:.3f} | {t0 / sec:.2f}x | {comp} |")
        summary[s] = {"psnr": ps, "ssim": ss, "seconds": sec, "rows": rs}
    if velocity:
        print(f"\nfp8 vs {dtype} velocity error along the 8-step trajectory: mean {statistics.mean(velocity):.4f}, "
              f"max {max(velocity):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "fp8_velocity_rel_err": velocity}, f, indent=2,
                      default=str)


if __name__ == "__main__":
    main()
