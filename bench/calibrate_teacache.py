"""TeaCache coefficients per resolution bucket (services/model/step_cache.py, `"cache": {"mode": "teacache"}`).

For every size and prompt, an exact full-step trajectory (the reference pipeline, no reuse) records, per CFG
branch and step, the gen stack's input x (patch tokens + the additive time embedding) and its residual
r = h_L - x; between consecutive steps it takes the relative L1 changes (mean|a - a_prev| / mean|a_prev|) of
both and fits y (the residual's change) as a polynomial of x (the input's change), numpy.polyfit, one bucket
per size (max_tokens = that size's image tokens). TeaCache accumulates that polynomial of the input's change
and reuses the residual while the sum stays below the request's threshold. Writes the coefficients file
(`--out`; the service reads $U1SERVE_TEACACHE_COEFFICIENTS, else services/model/data/teacache_coefficients.json).

Coefficients belong to a checkpoint and a schedule (steps, shift): random weights (U1SERVE_RANDOM_WEIGHTS=1)
calibrate only the mechanism; operators run this on their real checkpoint:

    python -m bench.calibrate_teacache --model /models/SenseNova-U1-8B-MoT --sizes 1024,2048 --steps 50 \\
        --out /models/SenseNova-U1-8B-MoT/teacache_coefficients.json
    python -m bench.calibrate_teacache --smoke --out /tmp/tea.json   # CPU, tiny checkpoint, seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from services.contract.image import SamplerParams
from bench.bench_quality import DEFAULT_PROMPTS, model_dir, prompts_of
from services.model.constants import torch_dtype
from services.model import reference as R
from services.model import sampler as S
from services.model.step_cache import relative_change


class StackRecorder:
    """A step-cache object that reuses nothing (the exact forward: the whole stack on every row) and keeps,
    per step, the relative changes of the stack's input and residual against the previous step."""

    def __init__(self):
        self.prev: tuple[torch.Tensor, torch.Tensor] | None = None
        self.points: list[tuple[float, float]] = []

    def forward(self, model, x: torch.Tensor, rope, attend) -> torch.Tensor:
        h = model.gen_layers(x, rope, attend)
        r = h - x
        if self.prev is not None:
            self.points.append((relative_change(x, self.prev[0]).item(), relative_change(r, self.prev[1]).item()))
        self.prev = (x.clone(), r)
        return h


def trajectory_points(model, tok, prompt: str, size: int, steps: int, guidance: float, shift: float,
                      seed: int) -> list[tuple[float, float]]:
    """(input change, residual change) of every step after the first, of every CFG branch."""
    params = SamplerParams(num_inference_steps=steps, guidance_scale=guidance, timestep_shift=shift)
    pre = R.image_prefixes(model, tok, "t2i", prompt, [], params)
    rec = {b: StackRecorder() for b in pre}
    R.denoise(model, pre, size, size, params, seed=seed, observe=rec.__getitem__)
    return [p for r in rec.values() for p in r.points]


def fit(points: list[tuple[float, float]], degree: int) -> dict:
    """The polynomial (highest power first) of the residual's change in the input's change, and how well
    it predicts: the relative RMS error of the prediction."""
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    degree = max(1, min(degree, len(points) - 1))
    coef = np.polyfit(x, y, degree)
    pred = np.polyval(coef, x)
    rms = float(np.sqrt(np.mean((pred - y) ** 2)) / max(float(np.sqrt(np.mean(y ** 2))), 1e-12))
    return {"coefficients": [float(c) for c in coef], "degree": degree, "points": len(points),
            "fit_rel_rms_err": rms, "input_change": [float(x.min()), float(x.max())],
            "residual_change": [float(y.min()), float(y.max())]}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="checkpoint directory, or tiny / tiny-u1.5")
    p.add_argument("--prompts", default=None, help="text file, one prompt per line (or jsonl with 'prompt')")
    p.add_argument("--sizes", default="1024,2048", help="square sizes, one bucket each")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=4.0)
    p.add_argument("--shift", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--degree", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--out", required=True, help="the coefficients file to write")
    p.add_argument("--smoke", action="store_true", help="tiny checkpoint on CPU, 32² and 64², 5 steps")
    args = p.parse_args()
    args.prompts_list = None
    if args.smoke:
        args.model, args.device, args.sizes, args.steps = "tiny", "cpu", "32,64", 5
        args.prompts_list = DEFAULT_PROMPTS[:1]
    return args


def main() -> int:
    args = parse_args()
    from services.base import knobs
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    device = torch.device(args.device)
    dtype = torch_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    path = model_dir(args.model)
    model = load_model(path, "both", dtype=dtype, device=device)
    tok = NeoTokenizer.from_dir(path)
    prompts = prompts_of(args)
    t0 = time.time()
    buckets = []
    print(f"model {args.model}, {args.steps} steps, guidance {args.guidance}, shift {args.shift}, {dtype}, {device}, "
          f"{len(prompts)} prompt(s)")
    print("| size | tokens | points | input change (min-max) | residual change (min-max) | fit rel RMS err | "
          "coefficients (highest power first) |")
    print("|---|---:|---:|---|---|---:|---|")
    with torch.inference_mode():
        for size in sorted(int(s) for s in args.sizes.split(",")):
            points = [p for prompt in prompts
                      for p in trajectory_points(model, tok, prompt, size, args.steps, args.guidance, args.shift,
                                                 args.seed)]
            b = {"max_tokens": (size // S.BLOCK) ** 2, "size": size, **fit(points, args.degree)}
            buckets.append(b)
            print(f"| {size}² | {b['max_tokens']} | {b['points']} | {b['input_change'][0]:.4f}-{b['input_change'][1]:.4f}"
                  f" | {b['residual_change'][0]:.4f}-{b['residual_change'][1]:.4f} | {b['fit_rel_rms_err']:.3f} | "
                  f"{', '.join(f'{c:.6g}' for c in b['coefficients'])} |")
    out = {"source": f"bench/calibrate_teacache.py --model {args.model} --steps {args.steps} --guidance "
                     f"{args.guidance} --shift {args.shift} ({dtype}, {device}, {len(prompts)} prompt(s), "
                     f"{time.strftime('%Y-%m-%d')})",
           "random_weights": knobs.RANDOM_WEIGHTS.get() or args.model.startswith("tiny"),
           "x": "relative L1 change of the gen stack's input between consecutive steps",
           "y": "relative L1 change of the stack's residual (h_L - x) between the same steps",
           "median_fit_rel_rms_err": statistics.median(b["fit_rel_rms_err"] for b in buckets),
           "buckets": buckets}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out} ({len(buckets)} bucket(s), {time.time() - t0:.1f} s); serve it with "
          f"U1SERVE_TEACACHE_COEFFICIENTS={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
