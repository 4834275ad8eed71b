"""Quality cost of each acceleration, on your own weights: PSNR / SSIM against the exact settings,
with the speed.

For every prompt, the exact image (the checkpoint, the model dtype, --steps, --guidance) is generated
through the generation engine in-process (the serving code path; prefixes from the reference
pipeline); then each setting of --settings is generated with the same seed and compared with it:
    fp8            gen-branch Linear layers in fp8 (services/model/quant.py)
    int8           gen-branch Linear layers in int8 W8A8 (services/model/quant_int8.py)
    gguf:TYPE      the checkpoint converted to GGUF TYPE (q8_0, q4_k; `u1serve convert`), dequantised at load
    cache:T        first-block step caching with threshold T (per CFG branch)
    tea:T          TeaCache step caching with threshold T (per CFG branch; coefficients: calibrate_teacache.py)
    truncate:V     CFG only while t <= V (cond alone on the tail)
    preset:8step   the 8-step recipe (8 steps, guidance 1, shift 3): with --lora the 8-step adapter
It also reports the per-step velocity error of fp8 against the model dtype along the exact 8-step
trajectory of the first prompt (the fp8 numerics check), and, when both step caches ran, first-block vs
TeaCache at equal quality: for each first-block threshold the TeaCache threshold of at least its PSNR that
computed the fewest steps (a first-block reused step still runs layer 0; a TeaCache one runs no layer).

    python -m bench.bench_quality --model /models/SenseNova-U1-8B-MoT --prompts prompts.txt \
        --size 2048 --steps 50 --settings fp8,cache:0.05,cache:0.1,truncate:0.8
    U1SERVE_TEACACHE_COEFFICIENTS=tea.json python -m bench.bench_quality --model ... --size 1024 --steps 50 \
        --settings cache:0.05,cache:0.1,cache:0.2,tea:0.1,tea:0.2,tea:0.4,tea:0.8
    python -m bench.bench_quality --model /models/SenseNova-U1-8B-MoT --settings fp8,int8,gguf:q8_0,gguf:q4_k \
        --convert-dir /scratch/u1-converted       # the weight formats' quality cost on real weights
    python -m bench.bench_quality --smoke        # CPU, tiny checkpoint, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bench.image_quality import psnr, ssim
from services.generation.engine import Engine
from services.contract.image import GenerateRequest, SamplerParams
from services.model.constants import torch_dtype
from services.model import reference as R
from services.model import sampler as S

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
    p.add_argument("--convert-dir", default=None,
                   help="where gguf:TYPE settings write their converted checkpoint (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.model, args.device, args.size, args.steps = "tiny", "cpu", 128, 4
        args.settings = "fp8,int8,gguf:q4_k,cache:0.2,tea:0.1,tea:0.4,truncate:0.3,preset:8step"
        args.prompts_list = DEFAULT_PROMPTS[:1]
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
        from services.launch.stack import ensure_tiny_checkpoint, tiny_variant
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
        params = SamplerParams(num_inference_steps=steps, guidance_scale=guidance, timestep_shift=shift)
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


def converted(path: str, to: str, out_root: str | None) -> str:
    """`path` converted by `u1serve convert --to TO` (reused when out_root already holds it)."""
    import tempfile

    from services.model.convert import convert_checkpoint
    out_root = out_root or tempfile.mkdtemp(prefix="u1-quality-")
    out = os.path.join(out_root, to.replace(":", "_"))
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    return convert_checkpoint(path, out, to)


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


def equal_quality(summary: dict) -> list[tuple[str, str | None]]:
    """(first-block setting, the TeaCache setting of at least its median PSNR with the fewest computed steps,
    then the fastest; None if none is as good) for every first-block setting, when both kinds ran."""
    fbs = [s for s in summary if s.startswith("cache:")]
    teas = [s for s in summary if s.startswith("tea:")]
    out = []
    for fb in fbs if teas else []:
        ok = [t for t in teas if summary[t]["psnr"] >= summary[fb]["psnr"]]
        out.append((fb, min(ok, key=lambda t: (summary[t]["computed"], summary[t]["seconds"])) if ok else None))
    return out


def main():
    args = parse_args()
    from services.model.presets import PRESETS
    from services.model.tokenizer import NeoTokenizer
    device = torch.device(args.device)
    dtype = torch_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    path = model_dir(args.model)
    tok = NeoTokenizer.from_dir(path)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    base = Runner(path, device, dtype, tok)
    runners = {"base": base}
    for s in settings:
        if s in ("fp8", "int8"):
            runners[s] = Runner(path, device, dtype, tok, quantization=s)
        elif s.startswith("gguf"):
            runners[s] = Runner(converted(path, s, args.convert_dir), device, dtype, tok)
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
            if kind in ("fp8", "int8", "gguf"):
                run = runners[s]
            elif kind == "cache":
                kw["cache"] = {"mode": "first_block", "threshold": float(val)}
            elif kind == "tea":
                kw["cache"] = {"mode": "teacache", "threshold": float(val)}
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
        summary[s] = {"psnr": ps, "ssim": ss, "seconds": sec, "rows": rs,
                      "computed": sum(bs[b]["computed"] for b in ("cond", "uncond") if b in bs)}
    equal = equal_quality(summary)
    if equal:
        print("\nfirst-block vs TeaCache at equal quality (the TeaCache threshold with PSNR >= the first-block one's "
              "and the fewest computed steps):\n")
        print("| first_block | PSNR | SSIM | computed | s | teacache | PSNR | SSIM | computed | s | steps saved |")
        print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        for fb, tea in equal:
            cells = []
            for name in (fb, tea):
                r = summary.get(name) if name else None
                cells.append(f"{name} | {r['psnr']:.2f} | {r['ssim']:.4f} | {r['computed']} | {r['seconds']:.3f}"
                             if r else "none as good | | | |")
            saved = summary[fb]["computed"] - summary[tea]["computed"] if tea else ""
            print(f"| {cells[0]} | {cells[1]} | {saved} |")
    if velocity:
        print(f"\nfp8 vs {dtype} velocity error along the 8-step trajectory: mean {statistics.mean(velocity):.4f}, "
              f"max {max(velocity):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "fp8_velocity_rel_err": velocity,
                       "equal_quality": equal}, f, indent=2,
                      default=str)


if __name__ == "__main__":
    main()
