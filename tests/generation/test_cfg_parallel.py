"""CFG-parallel over 2 gloo ranks: each rank imports only its branches' prefix KV, velocities are
all-gathered, every rank runs combine + Euler; the image equals the sequential (reference) one."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from .genhelp import (assert_same_images_as_reference, GenServer, body, generate, generate_all, photo, prefixes,
                      publish)


@pytest.fixture(scope="module")
def cfgp_server(tiny_dir, pool, tmp_path_factory):
    # Same torch thread count as the test process: CPU reductions (norms, sums) split work by
    # thread, so bit-exactness with the in-process reference needs it. Weight updates come from the tests' tmp dirs.
    s = GenServer(tiny_dir, pool.name, cfg_parallel=2,
                  knobs={"U1SERVE_WEIGHTS_ALLOWED_DIRS": str(tmp_path_factory.getbasetemp())}).start()
    yield s
    s.stop()


def test_cfg_parallel_equals_sequential(cfgp_server, pool, ref_model):
    status, health = cfgp_server.health()
    assert status == 200 and health["cfg_parallel"] == 2 and len(health["engine_pids"]) == 2
    cases = [
        ("cfgp-t2i", prefixes(ref_model, guidance_scale=4.0),
         dict(n=2, cfg_norm="cfg_zero_star")),
        ("cfgp-1branch", prefixes(ref_model, guidance_scale=1.0),
         dict(guidance_scale=1.0, width=160)),
        ("cfgp-edit3", prefixes(ref_model, "edit", "make it blue", [photo(5)], guidance_scale=4.0,
                                image_guidance_scale=1.5),
         dict(mode="edit", guidance_scale=4.0, image_guidance_scale=1.5, num_inference_steps=3)),
    ]
    bodies = {rid: body(rid, publish(pool, pre), **kw) for rid, pre, kw in cases}
    results = generate_all(cfgp_server.url, bodies, timeout=180)
    assert_same_images_as_reference(ref_model[0], results, cases, bodies)
    assert pool.stats()["pages_used"] == 0  # each rank released its own branches' pages


def test_cfg_parallel_ranks_decide_their_own_step_cache_branch(cfgp_server, pool, ref_model):
    """Step cache under CFG-parallel: each rank caches its own branch; the response reports both ranks'
    branches (the reference is test_step_cache's per-branch pipeline)."""
    from services.contract.image import CacheOptions
    from .genhelp import errors_of, images_of
    from .test_step_cache import _ref
    pre = prefixes(ref_model, guidance_scale=4.0)
    opts = {"mode": "first_block", "threshold": 0.5}
    b = {**body("cfgp-cache", publish(pool, pre), num_inference_steps=4, seed=3), "cache": opts}
    status, events = generate(cfgp_server.url, b)
    assert status == 200 and not errors_of(events), events
    want, counts = _ref(ref_model[0], pre, b, CacheOptions(**opts))
    assert sum(r for _, r in counts.values()) > 0
    img = [e for e in events if isinstance(e, dict) and e.get("type") == "image"][0]
    assert img["branch_steps"] == {k: {"computed": c, "reused": r} for k, (c, r) in counts.items()}
    assert np.array_equal(images_of(events)[0], want[0])


def test_live_weight_update_on_both_cfg_ranks(cfgp_server, pool, ref_model, tmp_path):
    """The internal weights API on 2 CFG ranks (generation/weights.py): both stage and commit; a job whose
    prefix carries the staged version waits for the commit, one of another version is refused (retryable);
    the image equals the reference on the updated weights. Reverted at the end (the server is shared)."""
    import copy

    import httpx
    import torch

    from services.model import weights_io as W
    from .genhelp import HEADERS, errors_of, images_of, reference_pixels
    model = ref_model[0]
    keys = ("language_model.model.layers.1.self_attn.v_proj_mot_gen.weight", "fm_modules.fm_head.0.weight")
    base = W.checkpoint_state(model, "gen")
    g = torch.Generator().manual_seed(5)
    upd = W.write_tensors({k: 0.1 * torch.randn(base[k].shape, generator=g) for k in keys}, str(tmp_path / "u"))
    revert = W.write_tensors({k: base[k] for k in keys}, str(tmp_path / "r"))
    updated = copy.deepcopy(model)
    W.stage_update(updated, upd).commit()

    def op(path: str, body: dict) -> httpx.Response:
        return httpx.post(cfgp_server.url + "/internal/weights/" + path, json=body, headers=HEADERS, timeout=60)

    def job(rid: str, version: str) -> dict:
        handles = publish(pool, pre)
        for h in handles.values():
            h["weights_version"] = version
        return body(rid, handles, num_inference_steps=2)

    pre = prefixes(ref_model, guidance_scale=4.0)
    r = op("stage", {"id": "t1", "version": "7", "path": upd})
    assert r.status_code == 200 and r.json()["updated"] == len(keys), r.text
    status, events = generate(cfgp_server.url, job("wv-other", "6"))
    assert errors_of(events)[0]["error"]["code"] == "weights_version_mismatch", events
    held = job("wv-held", "7")
    results = {}
    t = threading.Thread(target=lambda: results.update(held=generate(cfgp_server.url, held)))
    t.start()
    t.join(1.0)
    assert t.is_alive()                             # held until the commit
    r = op("commit", {"id": "t1"})
    assert r.status_code == 200 and r.json()["weights_version"] == "7", r.text
    t.join(120)
    status, events = results["held"]
    assert status == 200 and not errors_of(events), events
    assert [e["weights_version"] for e in events if isinstance(e, dict) and e.get("type") == "image"] == ["7"]
    assert np.array_equal(images_of(events)[0], reference_pixels(updated, pre, held)[0])
    assert cfgp_server.health()[1]["weights_version"] == "7"
    assert op("stage", {"id": "t2", "version": "0", "path": revert}).status_code == 200
    assert op("commit", {"id": "t2"}).json()["weights_version"] == "0"
    assert pool.stats()["pages_used"] == 0
