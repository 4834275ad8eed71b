"""The generation service gives the reference pipeline's image (fp32, bit-exact), through the pool.

A test producer writes the reference prefix KV into the shared-memory pool (as the understanding
service does); the generation service imports it and denoises; the PNG must decode to exactly the
reference's uint8 image. Sizes keep >= 16 image tokens per image (see docs/architecture.md,
"Generation engine": below that CPU BLAS picks shape-dependent kernels).
"""
from __future__ import annotations

import numpy as np
import pytest
from .genhelp import (body, errors_of, generate, images_of, photo, prefixes, publish,
                      reference_pixels)


def run_and_compare(gen_server, pool, ref_model, pre, rid, **kw):
    b = body(rid, publish(pool, pre), **kw)
    status, events = generate(gen_server.url, b)
    assert status == 200, events
    assert not errors_of(events), errors_of(events)
    assert events[0] == {"type": "queued"} and events[-1] == "[DONE]"
    steps = [e["step"] for e in events if isinstance(e, dict) and e["type"] == "progress"]
    assert steps == list(range(1, b["num_inference_steps"] + 1))
    got = images_of(events)
    want = reference_pixels(ref_model[0], pre, b)
    assert len(got) == b["n"]
    for g, w in zip(got, want):
        assert g.shape == (b["height"], b["width"], 3)
        assert np.array_equal(g, w)
    return got


@pytest.mark.parametrize("cfg_norm", ["none", "global", "channel", "cfg_zero_star"])
def test_t2i_every_cfg_norm(gen_server, pool, ref_model, cfg_norm):
    pre = prefixes(ref_model, guidance_scale=4.0)
    run_and_compare(gen_server, pool, ref_model, pre, f"t2i-{cfg_norm}", cfg_norm=cfg_norm,
                    n=2 if cfg_norm == "none" else 1)
    assert pool.stats()["pages_used"] == 0  # pages freed right after the import


def test_t2i_single_branch_and_cfg_interval(gen_server, pool, ref_model):
    pre = prefixes(ref_model, guidance_scale=1.0)
    assert set(pre) == {"cond"}
    run_and_compare(gen_server, pool, ref_model, pre, "t2i-nocfg", guidance_scale=1.0,
                    width=160, height=128)
    pre = prefixes(ref_model, guidance_scale=3.0)
    run_and_compare(gen_server, pool, ref_model, pre, "t2i-interval", guidance_scale=3.0,
                    cfg_interval=[0.2, 0.8], num_inference_steps=4, timestep_shift=2.0, t_eps=0.05)


@pytest.mark.parametrize("g,gi,branches", [
    (4.0, 1.0, {"cond", "img_cond"}),            # the default: 2 branches
    (3.0, 3.0, {"cond", "uncond"}),
    (4.0, 1.5, {"cond", "img_cond", "uncond"}),  # 3 branches
])
def test_edit_matches_reference(gen_server, pool, ref_model, g, gi, branches):
    pre = prefixes(ref_model, "edit", "make it blue", [photo(1), photo(2, 96, 64)],
                   guidance_scale=g, image_guidance_scale=gi, cfg_norm="global")
    assert set(pre) == branches
    run_and_compare(gen_server, pool, ref_model, pre, f"edit-{len(branches)}-{g}", mode="edit",
                    guidance_scale=g, image_guidance_scale=gi, cfg_norm="global", width=128,
                    height=160)


def test_think_prefix(gen_server, pool, ref_model):
    pre = prefixes(ref_model, think=True, guidance_scale=4.0)
    assert pre["cond"].think_text is not None
    assert pre["cond"].t_offset != pre["uncond"].t_offset
    run_and_compare(gen_server, pool, ref_model, pre, "t2i-think", cfg_norm="channel")


def test_output_formats(gen_server, pool, ref_model):
    pre = prefixes(ref_model, guidance_scale=4.0)
    for fmt in ("jpeg", "webp"):
        b = body(f"fmt-{fmt}", publish(pool, pre), output_format=fmt)
        status, events = generate(gen_server.url, b)
        assert status == 200 and not errors_of(events)
        img = [e for e in events if isinstance(e, dict) and e["type"] == "image"][0]
        assert img["format"] == fmt and img["seed"] == 11 and img["width"] == 128
        assert images_of(events)[0].shape == (128, 128, 3)
