"""Every request speed option takes effect, as reported, in every deployment mode that runs on a CPU.

A real `u1serve up` (tiny checkpoint, loopback): colocate (the session's stack), and one stack of the modes
that compose: separate placement, CFG parallelism 2, sequence parallelism 2 and fp8. One image request with
a first-block step cache whose threshold makes every step after the cache's warm-up reuse, and one without:
each image's `applied` must say what ran — the cache's computed / reused branch-steps (nothing silently
ignored), CUDA graphs "not_applicable" (no CUDA here: said, not pretended), fp8 "emulated" where the stack
quantises (CPU: the numerics, not the speed) and false where it does not. Whether graphs and fp8 apply on
CUDA is what bench/gpu_defaults.sh reads from the same field on the H200.
"""
from __future__ import annotations

import httpx

from .stackproc import RunningStack

STEPS = 4
CACHED = {"mode": "first_block", "threshold": 10.0, "warmup_steps": 1}   # reuse on every step it may


def _applied(base: str, cache: dict | None, guidance: float = 4.0) -> dict:
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": STEPS, "seed": 7,
            "guidance_scale": guidance}
    if cache is not None:
        body["cache"] = cache
    r = httpx.post(base + "/v1/images/generations", json=body, timeout=240)
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    assert "applied" in item, item
    return item["applied"]


def _check(base: str, fp8) -> None:
    branches = 2                                        # guidance 4: cond + uncond on every step
    plain = _applied(base, None)
    assert plain["cache"] == {"computed": STEPS * branches, "reused": 0} and plain["cache_mode"] == "off"
    assert plain["graphs"] == "not_applicable" and plain["graph_steps"] == 0
    assert plain["fp8"] == fp8 and plain["fp8_steps"] == (STEPS if fp8 else 0)
    cached = _applied(base, CACHED)
    assert cached["cache_mode"] == "first_block"
    assert cached["cache"]["reused"] == (STEPS - 1) * branches, cached   # the step cache took effect
    assert cached["cache"]["computed"] == branches
    assert cached["graphs"] == "not_applicable" and cached["fp8"] == fp8


def test_colocate(stack):
    _check(stack.base, fp8=False)


def test_separate_cfg_parallel_sequence_parallel_fp8(tiny_model, tmp_path):
    """The other modes compose, so one stack runs them all (a stack start is the cost here): separate placement,
    CFG branches over 2 ranks, each branch's tokens over 2 SP ranks, fp8 GEMMs; `applied` merges every rank's
    branch-steps (the cache decisions are collective)."""
    s = RunningStack(tiny_model, "separate", str(tmp_path),
                     extra=["--gen-cfg-parallel", "2", "--gen-sp", "2", "--quantization", "fp8"])
    try:
        s.wait_ready()
        _check(s.base, "emulated")
    finally:
        s.stop_clean()
