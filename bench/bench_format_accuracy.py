"""What each weight format costs in accuracy, per branch and per layer group, on the same random weights (the only
weights here): the velocity of one denoise step (generation branch) and the logits of one decode step
(understanding branch) against the unquantised model (fp32 on the CPU, bf16 on a GPU), so a per-layer mix
(`u1serve convert --to gguf:q8_0:0-17,q4_k:18-`) is chosen from numbers.

Each row quantises ONE branch's targets (quant.target_linears: q/k/v/o, gate/up/down) in ONE layer group (or all
layers, or a mix) with the serving code's own path, runs the step, and puts the weights back:
    int8, fp8   W8A8 (quant.quantize_model on copies of the group's layers, every row count in 8 bits; the CPU runs
                the exact int8 GEMM and the fp8 emulation, so the numbers are the GPU's up to summation order)
    q8_0, q4_k  weight-only, each weight through the converter's encoder and gguf's dequantiser
                (gguf_io._encode + gguf.quants.dequantize), exactly what a converted checkpoint loads
    mix         q8_0 on the first 43 % of the layers (18 of 42), q4_k after (the mix the issue asks about)
Errors: relative L2 (||x - ref|| / ||ref||) and max |x - ref|; for logits also whether the argmax agrees.

    python -m bench.bench_format_accuracy --tiny --json out.json       # CPU smoke: tiny checkpoint, fp32
    python -m bench.bench_format_accuracy --variant u1-8b --device cuda --formats int8,fp8,q4_k   # 8B geometry
    python -m bench.bench_format_accuracy --tiny --markdown docs/benchmarks/formats.md
"""
from __future__ import annotations

import argparse
import copy
import json
import time
import types

import torch

from services.contract.image import SamplerParams
from services.model import reference as R
from services.model import sampler as S
from services.model.model import NeoModel
from services.model.quant import target_linears

FORMATS = ("int8", "fp8", "q8_0", "q4_k")
MIX_SHARE = 18 / 42                       # q8_0 up to here, q4_k after


def load(args, device, dtype) -> tuple[NeoModel, object]:
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    from services.launch.stack import ensure_tiny_checkpoint
    if args.tiny:
        path = ensure_tiny_checkpoint("u1")
        model = load_model(path, branch="both", dtype=dtype, device=device)
    else:
        import tempfile

        from services.model.tiny import write_full_config
        path = write_full_config(tempfile.mkdtemp(prefix="u1acc-"), args.variant)
        model = load_model(path, branch="both", dtype=dtype, device=device, random_weights=True)
    return model, NeoTokenizer.from_dir(path)


def groups(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


# ----------------------------------------------------------------------------------------- quantised copies
class Swap:
    """Quantise `branch`'s targets in layers [a, b) (per-layer types for GGUF), undo on exit."""

    def __init__(self, model: NeoModel, branch: str, fmt: str, a: int, b: int, mix_at: int | None = None):
        self.model, self.branch, self.fmt, self.a, self.b, self.mix_at = model, branch, fmt, a, b, mix_at
        self.saved = []

    def __enter__(self):
        layers = self.model.language_model.model.layers
        if self.fmt in ("int8", "fp8"):
            from services.model.quant import GemmPolicy, quantize_model
            from services.model.quant_schemes import scheme
            copies = [copy.deepcopy(layers[i]) for i in range(self.a, self.b)]
            view = types.SimpleNamespace(language_model=types.SimpleNamespace(
                model=types.SimpleNamespace(layers=copies)), device=self.model.device)
            # every row count in 8 bits (GemmPolicy(): min_tokens 0): served fp8 on CUDA runs short row counts
            # (these probes' decode step and small image) from its bf16 copy, which would measure nothing
            quantize_model(view, (self.branch,), policy=GemmPolicy(), scheme=scheme(self.fmt))
            for i, layer in zip(range(self.a, self.b), copies):
                self.saved.append((i, layers[i]))
                layers[i] = layer
            return self
        for owner, name, full in target_linears(self.model, (self.branch,)):
            layer = int(full.split(".")[3])
            if not self.a <= layer < self.b:
                continue
            w = getattr(owner, name).weight
            typ = self.fmt if self.mix_at is None else ("q8_0" if layer < self.mix_at else "q4_k")
            self.saved.append((w, w.data.clone()))
            w.data.copy_(gguf_round_trip(w.data, typ))
        return self

    def __exit__(self, *exc):
        layers = self.model.language_model.model.layers
        for key, value in self.saved:
            if isinstance(key, int):
                layers[key] = value
            else:
                key.data.copy_(value)


def gguf_round_trip(w: torch.Tensor, typ: str) -> torch.Tensor:
    """The weight as a converted checkpoint loads it: bf16 source, encoded as `typ`, dequantised."""
    import gguf
    import numpy as np

    from services.model.gguf_io import _encode, write_types
    data, qtype = _encode(w.detach().to("cpu", torch.bfloat16), write_types()[typ])
    out = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype)))
    return out.reshape(w.shape).to(w.device, w.dtype)


# ----------------------------------------------------------------------------------------- the two steps
class Probe:
    """One decode step's logits and one denoise step's velocity on fixed inputs (the reference's prefix KV: the gen
    rows see the unquantised prompt, so a gen row measures the gen branch alone)."""

    def __init__(self, model: NeoModel, tok, side: int, prompt_tokens: int, seed: int = 0):
        self.model = model
        g = torch.Generator().manual_seed(seed)
        vocab = min(model.cfg.llm.vocab_size, 256)         # byte ids: valid in the tiny tokenizer and any other
        self.ids = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
        params = SamplerParams(num_inference_steps=4, guidance_scale=4.0)
        with torch.no_grad():
            self.prefix = R.image_prefixes(model, tok, "t2i", "a red fox in the snow", [], params)["cond"]
        self.th = self.tw = side // S.BLOCK
        self.s = S.noise_scale(model.cfg, self.th * self.tw)
        self.x = S.initial_noise(1, side, side, seed, model.device, model.dtype, self.s)
        self.t = S.timesteps(4, 3.0, device=model.device)[1]

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        m = self.model
        cache = R._Cache(m.num_layers)
        ids = torch.tensor(self.ids[:-1])
        t = torch.arange(len(ids))
        pos = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)]).to(m.device)
        R._forward_und(m, cache, m.embed(ids), pos, torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool,
                                                                            device=m.device)))
        hidden, _ = R._append_text(m, cache, self.ids[-1:], len(ids) - 1)    # the decode step
        return m.lm_logits(hidden[-1:]).float()

    @torch.no_grad()
    def velocity(self) -> torch.Tensor:
        m = self.model
        z = S.patchify(self.x)
        x_in = m.gen_embed(self.x, self.t, self.s)
        kv = self.prefix.kv.to(m.device, m.dtype)
        return R.gen_velocity(m, kv, self.prefix.t_offset, x_in, z, self.t, self.th, self.tw,
                              m.cfg.raw.get("t_eps", 0.05)).float()


def errors(x: torch.Tensor, ref: torch.Tensor, logits: bool) -> dict:
    out = {"rel_l2": float((x - ref).norm() / ref.norm().clamp_min(1e-30)), "max_abs": float((x - ref).abs().max())}
    if logits:
        out["argmax_agrees"] = bool(x.argmax(-1).eq(ref.argmax(-1)).all())
    return out


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    t0 = time.time()
    model, tok = load(args, device, dtype)
    n = model.num_layers
    probe = Probe(model, tok, args.size, args.prompt_tokens)
    ref = {"und": probe.logits(), "gen": probe.velocity()}
    size = args.group_size or max(1, -(-n // 6))
    spans = [("all", 0, n)] + [(f"{a}-{b - 1}", a, b) for a, b in groups(n, size)]
    mix_at = max(1, round(n * MIX_SHARE))
    rows = []
    for branch in ("und", "gen"):
        measure = probe.logits if branch == "und" else probe.velocity
        for fmt in args.formats:
            for label, a, b in spans:
                with Swap(model, branch, fmt, a, b):
                    rows.append({"branch": branch, "format": fmt, "layers": label,
                                 **errors(measure(), ref[branch], branch == "und")})
        if {"q8_0", "q4_k"} <= set(args.formats):
            with Swap(model, branch, "mix", 0, n, mix_at=mix_at):
                rows.append({"branch": branch, "format": f"q8_0:0-{mix_at - 1},q4_k:{mix_at}-", "layers": "all",
                             **errors(measure(), ref[branch], branch == "und")})
    restored = torch.equal(probe.logits(), ref["und"]) and torch.equal(probe.velocity(), ref["gen"])
    return {"geometry": "tiny" if args.tiny else args.variant, "restored": restored, "device": str(device),
            "reference": str(dtype),
            "layers": n, "image_side": args.size, "prompt_tokens": args.prompt_tokens, "rows": rows,
            "seconds": round(time.time() - t0, 1)}


def table(out: dict) -> str:
    lines = [f"geometry {out['geometry']} ({out['layers']} layers), {out['device']}, reference {out['reference']}, "
             f"{out['image_side']}² image, {out['prompt_tokens']}-token prompt",
             "", "| branch | format | layers | rel L2 | max abs | argmax |", "|---|---|---|---|---|---|"]
    for r in out["rows"]:
        agree = {True: "same", False: "differs"}.get(r.get("argmax_agrees"), "-")
        lines.append(f"| {r['branch']} | {r['format']} | {r['layers']} | {r['rel_l2']:.3g} | {r['max_abs']:.3g} "
                     f"| {agree} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint (CPU smoke)")
    p.add_argument("--variant", default="u1-8b", help="full-size geometry, random weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--size", type=int, default=None, help="image side (default 64 tiny, 512 full-size)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--group-size", type=int, default=0, help="layers per group (default: six groups)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    args.size = args.size or (64 if args.tiny else 512)
    out = run(args)
    text = table(out)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
