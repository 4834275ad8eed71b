"""Every request speed option takes effect, as reported, in every deployment mode that runs on a CPU.

Colocate here, on the session's real `u1serve up` stack (tiny checkpoint, loopback). The modes that compose —
separate placement, CFG parallelism 2, sequence parallelism 2, fp8 — run in one stack, the one
bench/gpu_defaults.sh's CPU smoke starts, and are checked there (tests/bench/test_bench_defaults.py; a stack
start is what a test costs here). A request with a first-block step cache whose threshold makes every step after
the cache's warm-up reuse, and one without: each image's `applied` must say what ran — the cache's computed /
reused branch-steps (nothing silently ignored), CUDA graphs "not_applicable" (no CUDA here: said, not
pretended), fp8 false (this stack does not quantise). On the H200 bench/gpu_defaults.sh reads the same field.
"""
from __future__ import annotations

import httpx

STEPS, BRANCHES = 4, 2                  # guidance 4: cond + uncond on every step
CACHED = {"mode": "first_block", "threshold": 10.0, "warmup_steps": 1}   # reuse on every step it may


def _applied(base: str, cache: dict | None) -> dict:
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": STEPS, "seed": 7, "guidance_scale": 4.0}
    r = httpx.post(base + "/v1/images/generations", json=body if cache is None else {**body, "cache": cache},
                   timeout=240)
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    assert "applied" in item, item
    return item["applied"]


def test_colocate_reports_what_ran(stack):
    plain, cached = _applied(stack.base, None), _applied(stack.base, CACHED)
    assert plain["cache"] == {"computed": STEPS * BRANCHES, "reused": 0} and plain["cache_mode"] == "off"
    assert cached["cache_mode"] == "first_block"
    assert cached["cache"] == {"computed": BRANCHES, "reused": (STEPS - 1) * BRANCHES}   # the cache took effect
    for a in (plain, cached):
        assert a["graphs"] == "not_applicable" and a["graph_steps"] == 0
        assert a["fp8"] is False and a["fp8_steps"] == 0
