"""End to end through the real handoff: understanding service -> shm pool -> generation service.

Two oracles per image: the reference denoise over the prefix KV the understanding service exported
(bit-exact: this isolates the generation side), and the whole reference pipeline (prompt -> image),
which differs only by the understanding engine's own fp32 rounding of the prefix (<= 1 level)."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
from .genhelp import (GenServer, UndServer, body, data_url, errors_of, generate, images_of,
                      photo, reference_pixels)

from services.contract.image import SamplerParams
from services.model import reference as R


@pytest.fixture(scope="module")
def stack(tiny_dir):
    name = f"u1gen-e2e-{uuid.uuid4().hex[:8]}"
    # both at once, as `u1serve up` starts them: generation waits for the pool understanding creates
    gen = GenServer(tiny_dir, name, "--kv-pool-wait-s", "60").launch()
    und = UndServer(tiny_dir, name, pool_gb=0.002).start()  # ~3900 tokens: 3 T2I prefixes
    gen.wait_healthy()
    yield und, gen
    gen.stop()
    und.stop()


def _exported(und, handles):
    from shm_transfer import KVHandle, ShmKVPool, read_kv
    pool = ShmKVPool.attach(und.pool_name, pin=False)
    try:
        return {b: R.PrefixKV(read_kv(pool, KVHandle.from_dict(h)), h["t_offset"])
                for b, h in handles.items()}
    finally:
        pool.close()


def test_generation_opened_the_pool_before_ready(stack):
    """Started with its producer, generation opened understanding's pool before its /health turned 200 (on CUDA
    the pinning and the import kernel's JIT are then not the first request's)."""
    und, gen = stack
    kv_pool = gen.health()[1]["kv_pool"]
    assert kv_pool["attached"] and kv_pool["before_ready"] and kv_pool["pool"] == und.pool_name
    assert kv_pool["warm_import_seconds"] is not None


CASES = [
    ("e2e-t2i", dict(mode="t2i", prompt="a red cube", guidance_scale=4.0),
     dict(cfg_norm="global", n=2)),
    ("e2e-think", dict(mode="t2i", prompt="a cat", guidance_scale=4.0, think=True, max_think_tokens=5),
     dict(cfg_norm="cfg_zero_star")),
    ("e2e-edit2", dict(mode="edit", prompt="make it blue", guidance_scale=4.0, image_guidance_scale=1.0),
     dict(mode="edit", cfg_norm="channel")),
    ("e2e-edit3", dict(mode="edit", prompt="add a hat", guidance_scale=4.0, image_guidance_scale=2.0),
     dict(mode="edit", image_guidance_scale=2.0)),
]


@pytest.mark.parametrize("rid,prefix_req,gen_kw", CASES, ids=[c[0] for c in CASES])
def test_understanding_to_generation(stack, ref_model, rid, prefix_req, gen_kw):
    und, gen = stack
    model, tok = ref_model
    pils = [photo(3)] if prefix_req["mode"] == "edit" else []
    status, out = und.image_prefix(request_id=rid, images=[data_url(p) for p in pils],
                                   stream=False, **prefix_req)
    assert status == 200, out
    handles = out["handles"]
    exported = _exported(und, handles)
    b = body(rid, handles, guidance_scale=prefix_req["guidance_scale"], **gen_kw)
    status, events = generate(gen.url, b)
    assert status == 200 and not errors_of(events), events
    got = images_of(events)

    # 1) the generation side is exact over the KV it was handed
    want = reference_pixels(model, exported, b)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    # 2) the whole pipeline agrees with the reference pipeline from the prompt
    params = SamplerParams(guidance_scale=prefix_req["guidance_scale"],
                             image_guidance_scale=prefix_req.get("image_guidance_scale", 1.0),
                             mode=prefix_req["mode"])
    pre = R.image_prefixes(model, tok, prefix_req["mode"], prefix_req["prompt"], pils, params,
                           prefix_req.get("think", False), prefix_req.get("max_think_tokens", 1024))
    assert out["think_text"] == pre["cond"].think_text
    full = reference_pixels(model, pre, b)
    for g, w in zip(got, full):
        diff = np.abs(g.astype(int) - w.astype(int))
        assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    # the generation service freed every page right after importing
    stats = _pool_stats(und)
    assert stats["pages_used"] == 0


def _pool_stats(und):
    from shm_transfer import ShmKVPool
    pool = ShmKVPool.attach(und.pool_name, pin=False)
    try:
        return pool.stats()
    finally:
        pool.close()


def test_pool_full_is_429_then_succeeds(stack):
    und, gen = stack
    held = []
    for i in range(50):  # hold prefixes without generating until the pool is full
        status, out = und.image_prefix(request_id=f"fill-{i}", mode="t2i", prompt="x" * 40,
                                       guidance_scale=4.0, stream=False)
        if status != 200:
            break
        held.append(out["handles"])
    assert status == 429 and out["error"]["code"] == "kv_pool_full", out
    assert held
    # a generation request with handles from before the pool filled still works ...
    status, events = generate(gen.url, body("full-ok", held.pop(), n=1))
    assert status == 200 and not errors_of(events)
    # ... and once the rest are released, new prefixes succeed end to end
    und.release([h for hs in held for h in hs.values()])
    status, out = und.image_prefix(request_id="after-full", mode="t2i", prompt="a boat",
                                   guidance_scale=4.0, stream=False)
    assert status == 200, out
    status, events = generate(gen.url, body("after-full", out["handles"]))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1
    assert _pool_stats(und)["pages_used"] == 0
