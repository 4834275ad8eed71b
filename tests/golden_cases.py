"""The official outputs stored in tests/golden, and the same requests run by the reference on this host.

Float bits of CPU kernels (MKL's GEMMs, ATen's vectorised ops) depend on the CPU they run on (AVX2, AVX-512,
...), so the stored outputs, made on another machine, are the official code's bits there. Bit for bit, the tests
compare with the reference (services/model/reference.py, the official algorithm restated) computed here, in the
same run; against the stored outputs they allow the cross-host error measured in tests/golden/cross_host.json —
and demand equality where this host's kernels give the bits of the host that reproduced the goldens exactly
(`same_kernels_as_golden_host`). docs/model.md "Bits": what is exact where.

`python -m tests.golden_cases` prints this host's kernel fingerprint and each case's largest error against the
stored outputs (how cross_host.json was measured, under ATEN_CPU_CAPABILITY / MKL_ENABLE_INSTRUCTIONS / MKL_CBWR).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F

from services.contract.image import SamplerParams
from services.model import images as IM
from services.model import reference as R
from tests.conftest import GOLDEN

CKPT = os.path.join(GOLDEN, "tiny-u1")
CASES = os.path.join(GOLDEN, "cases")
CROSS_HOST = os.path.join(GOLDEN, "cross_host.json")
EDIT = "edit_cfg3_img2_64"
INTERLEAVE = "interleave_edit_cfg3_sizes"


def request(name: str) -> dict:
    with open(os.path.join(CASES, name + ".json")) as f:
        return json.load(f)["request"]


def input_png(case: dict) -> bytes:
    with open(os.path.join(CASES, case["images"][0]), "rb") as f:
        return f.read()


def official(name: str):
    """The stored official output (edit: the image tensor; interleave: {text, images})."""
    return torch.load(os.path.join(CASES, name + ".pt"), weights_only=True)


def sampler_params(case: dict) -> SamplerParams:
    return SamplerParams(mode="edit", num_inference_steps=case["num_steps"], guidance_scale=case["cfg_scale"],
                           image_guidance_scale=case["img_cfg_scale"], cfg_norm=case["cfg_norm"],
                           timestep_shift=case["timestep_shift"], t_eps=case["t_eps"])


def model_tok():
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    return load_model(CKPT, "both", torch.float32), NeoTokenizer.from_dir(CKPT)


def reference_edit(model, tok, case: dict) -> torch.Tensor:
    image = IM.load_image(input_png(case))
    x, _ = R.edit(model, tok, case["prompt"], [image], *case["image_size"], sampler_params(case), seed=case["seed"])
    return x


def reference_interleave(model, tok, case: dict, **overrides) -> tuple[str, list[torch.Tensor]]:
    """The case's interleaved answer by the reference loop: (text with `<image>` where each image stands, images)."""
    msgs = [{"role": "user", "content": [{"type": "image", "image": IM.load_image(input_png(case))},
                                         {"type": "text", "text": case["prompt"]}]}]
    sizes = [tuple(s) for s in case["image_size"]]
    kw = dict(seed=case["seed"], think=case["think_mode"], max_new_tokens=case["max_new_tokens"],
              logit_bias={tok.img_start_id: case["img_bias"]}, sizes=sizes)
    ans = R.interleave(model, tok, msgs, sampler_params(case), *sizes[0], **{**kw, **overrides})
    return "<image>".join(tok.decode(s, skip_special_tokens=True) for s in ans.segments), ans.images


# ---- the cross-host check -----------------------------------------------------------------------------------
def cross_host() -> dict:
    with open(CROSS_HOST) as f:
        return json.load(f)


def kernel_fingerprint() -> str:
    """sha256 of the bits this host's kernels give on the tiny model's shapes: GEMMs (MKL picks its kernel by the
    row count and the CPU) at the row counts the cases run (1-token decode, 4/6-token images, prompts) and the
    width of each of its linears, plus the vectorised ATen ops of a layer (softmax, rsqrt, silu, exp)."""
    gen = torch.Generator().manual_seed(0)
    h = hashlib.sha256()
    for rows in (1, 4, 6, 12, 33, 300):
        for n_in, n_out in ((64, 64), (64, 32), (64, 256), (256, 64), (64, 4096), (4096, 64), (64, 264)):
            x = torch.randn(rows, n_in, generator=gen)
            w = torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5
            h.update(F.linear(x, w).numpy().tobytes())
    x = torch.randn(4, 33, 300, generator=gen)
    for y in (x.softmax(-1), x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt(), F.silu(x), x.exp(),
              torch.matmul(x, x.transpose(-1, -2))):
        h.update(y.numpy().tobytes())
    return h.hexdigest()


def same_kernels_as_golden_host() -> bool:
    return kernel_fingerprint() in cross_host()["golden_kernel_fingerprints"]


def assert_official(x: torch.Tensor, gold: torch.Tensor, what: str) -> None:
    """`x` (the reference on this host) against a stored official output: equal where this host's kernels are
    the golden host's, else within the measured cross-host error."""
    err = (x - gold).abs().max().item()
    if same_kernels_as_golden_host():
        assert torch.equal(x, gold), f"{what}: {err:.3g} off the official bits, on kernels that reproduce them"
    else:
        tol = cross_host()["max_abs_error"]
        assert err <= tol, f"{what}: {err:.3g} off the official output (cross-host tolerance {tol:.3g})"


LONG_IMAGES = 10


def reference_long_interleave(model, tok) -> tuple[str, list[torch.Tensor]]:
    """The interleave case grown to a long answer: LONG_IMAGES images of its first size, each re-encoded into the
    cond and tu caches the next one reads (where a float difference compounds, image after image)."""
    case = request(INTERLEAVE)
    return reference_interleave(model, tok, case, max_new_tokens=64, max_images=LONG_IMAGES,
                                sizes=[tuple(case["image_size"][0])])


def main() -> None:
    """No argument: the cases against the stored outputs. `--long OUT.pt`: the long answer's images saved, to
    compare between kernel paths (the stored outputs hold no long answer)."""
    import sys
    model, tok = model_tok()
    if sys.argv[1:2] == ["--long"]:
        torch.save(reference_long_interleave(model, tok)[1], sys.argv[2])
        return
    errors = {}
    x = reference_edit(model, tok, request(EDIT))
    errors[EDIT] = (x - official(EDIT)).abs().max().item()
    case, gold = request(INTERLEAVE), official(INTERLEAVE)
    text, images = reference_interleave(model, tok, case)
    errors[INTERLEAVE] = [(a - b).abs().max().item() for a, b in zip(images, gold["images"])]
    print(json.dumps({"fingerprint": kernel_fingerprint(), "threads": torch.get_num_threads(),
                      "text_equal": text == gold["text"], "max_abs_error": errors,
                      "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                             "MKL_CBWR")}}))


if __name__ == "__main__":
    main()
