"""Whether a request's step cache took effect in a running stack: one image through the public API with
`"cache": {"mode": "first_block", ...}`, read back from the response's `branch_steps` (steps each CFG branch
computed / reused). The tests of every GPU-sharing mode call it (tests/generation/test_qos_up.py,
tests/launcher/test_mps.py)."""
from __future__ import annotations

import httpx

# threshold 10 (the contract's maximum): on the tiny checkpoint every step after the first may reuse
CACHE = {"mode": "first_block", "threshold": 10.0}


def reused_steps(base_url: str, steps: int = 4, timeout: float = 120.0,
                 headers: dict | None = None) -> dict[str, dict[str, int]]:
    """branch_steps of one 64x64 CFG image with the step cache on ({branch: {"computed", "reused"}})."""
    r = httpx.post(base_url + "/v1/images/generations", timeout=timeout, headers=headers,
                   json={"prompt": "a fox", "size": "64x64", "num_inference_steps": steps, "seed": 5,
                         "guidance_scale": 4.0, "cache": CACHE})
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["branch_steps"]


def assert_cache_took_effect(base_url: str, steps: int = 4, headers: dict | None = None) -> None:
    got = reused_steps(base_url, steps, headers=headers)
    assert set(got) == {"cond", "uncond"}, got
    for branch, n in got.items():
        assert n["computed"] + n["reused"] == steps and n["reused"] > 0, got
