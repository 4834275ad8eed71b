"""The generation service gives the reference pipeline's image (fp32, bit-exact), through the pool."""
from __future__ import annotations

import numpy as np
import pytest
from genhelp import body, errors_of, generate, images_of, publish, reference_pixels

from services.model import reference as R
from services.model import sampler as S


def _prefixes(ref_model, kind="t2i", prompt="a red cat", images=(), **params):
    model, tok = ref_model
    p = S.SamplerParams(mode=kind, **params)
    return R.image_prefixes(model, tok, kind, prompt, list(images), p, think=params.pop("think", False)
                            if False else False)


def _run(gen_server, pool, ref_model, prefixes, rid, **kw):
    b = body(rid, publish(pool, prefixes), **kw)
    status, events = generate(gen_server.url, b)
    assert status == 200, events
    assert not errors_of(events), errors_of(events)
    assert events[0] == {"type": "queued"} and events[-1] == "[DONE]"
    steps = [e["step"] for e in events if isinstance(e, dict) and e["type"] == "progress"]
    assert steps == list(range(1, b["num_inference_steps"] + 1))
    got = images_of(events)
    want = reference_pixels(ref_model[0], prefixes, b)
    assert len(got) == b["n"]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    return got


@pytest.mark.parametrize("cfg_norm", ["none", "global", "channel", "cfg_zero_star"])
def test_t2i_matches_reference(gen_server, pool, ref_model, cfg_norm):
    pre = _prefixes(ref_model, cfg_scale=4.0)
    _run(gen_server, pool, ref_model, pre, f"t2i-{cfg_norm}", cfg_norm=cfg_norm, n=2)
    assert pool.stats()["pages_used"] == 0  # released right after the import
