"""Weight streaming in the generation engine (--weight-streaming-layers, services/model/weight_streaming.py):
- in process, on a 5-layer tiny checkpoint (more layers than slots): two CFG jobs in one forward, one of them with a
  first-block step cache that reuses (forwards that stop after layer 0 and restart there), give the resident engine's
  images and step counts bit for bit;
- through a real generation server started with the flag: /health says it is on and the image equals the one of
  the package's server without it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.contract.image import SamplerParams
from services.generation.engine import Engine
from services.generation.inputs import parse_job
from services.model import reference as R
from services.model import sampler as S
from services.model.loader import load_model
from services.model.tokenizer import NeoTokenizer
from services.model.weight_streaming import stream_decoder_layers

from .genhelp import GenServer, body, errors_of, generate, images_of, prefixes, publish

GUIDANCE = 4.0


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(checkpoint with 5 decoder layers, its reference prefixes of one prompt at CFG 4)."""
    from services.model.tiny import write_tiny_checkpoint
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-deep")), "u1", seed=0, num_hidden_layers=5)
    model = load_model(path, "both")
    pre = R.image_prefixes(model, NeoTokenizer.from_dir(path), "t2i", "a red cat", [],
                           SamplerParams(mode="t2i", guidance_scale=GUIDANCE))
    return path, pre


def _two_jobs(model, pre) -> tuple[list, list]:
    """A first-block caching job and an exact job, batched in every forward: (images, step counts)."""
    engine = Engine(model, prefix_source=None)
    jobs = []
    for rid, cache in (("cached", {"mode": "first_block", "threshold": 0.5}), ("exact", None)):
        spec = parse_job({"request_id": rid, "handles": {b: {} for b in pre}, "width": 128, "height": 128,
                          "num_inference_steps": 4, "guidance_scale": GUIDANCE, "seed": 3,
                          **({"cache": cache} if cache else {})})
        job = engine.admit_local(spec, {b: p.kv for b, p in pre.items()}, {b: p.t_offset for b, p in pre.items()})
        engine.add(job)
        jobs.append(job)
    while engine.running:
        engine.step()
    return [S.to_uint8(j.x).numpy() for j in jobs], [j.step_counts() for j in jobs]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_streamed_engine_equals_the_resident_one(deep, quantization):
    path, pre = deep
    load = lambda: load_model(path, branch="gen", dtype=torch.float32, quantization=quantization)  # noqa: E731
    want, want_counts = _two_jobs(load(), pre)
    assert sum(r for _, r in want_counts[0].values()) > 0     # the cache reused: some forwards stopped after layer 0
    model = load()
    streamer = stream_decoder_layers(model, 2)
    got, counts = _two_jobs(model, pre)
    assert counts == want_counts
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert streamer.report()["loads"]["prefetched"] > 0


def test_server_with_streaming_serves_the_same_image(tiny_dir, pool, ref_model, gen_server):
    pre = prefixes(ref_model, guidance_scale=GUIDANCE)
    streamed = GenServer(tiny_dir, pool.name, "--weight-streaming-layers", "1").start()
    try:
        status, health = streamed.health()
        assert status == 200 and health["weight_streaming"] == {"device_layers": 1}
        assert gen_server.health()[1]["weight_streaming"] is None
        images = []
        for server in (gen_server, streamed):
            status, events = generate(server.url, body(f"ws-{server.port}", publish(pool, pre), num_inference_steps=3,
                                                        guidance_scale=GUIDANCE))
            assert status == 200 and not errors_of(events), events
            images.append(images_of(events))
        assert len(images[0]) == 1 and np.array_equal(images[0][0], images[1][0])
    finally:
        streamed.stop()


def test_a_weight_update_reaches_the_streamed_layers(deep, tmp_path):
    """A live update commits into the layers' host copies (they hold them at rest); the commit through the rank's
    weights op forgets what the slots held, so the next forward runs the new weights: as a resident model updated
    the same way."""
    from services.generation.cfg_parallel import CfgComm
    from services.generation.weights import RankWeights
    from services.model import weights_io as W
    from tests.model.stack_forward import stack_forward
    path, _ = deep
    keys = ("language_model.model.layers.0.self_attn.k_proj_mot_gen.weight",
            "language_model.model.layers.3.mlp_mot_gen.up_proj.weight")
    resident = load_model(path, branch="gen", dtype=torch.float32)
    shapes = W.checkpoint_shapes(resident)
    g = torch.Generator().manual_seed(5)
    update = W.write_tensors({k: 0.05 * torch.randn(shapes[k], generator=g) for k in keys}, str(tmp_path / "update"))
    W.stage_update(resident, update).commit()
    model = load_model(path, branch="gen", dtype=torch.float32, layers_to_host=True)
    stream_decoder_layers(model, 2)
    before = stack_forward(model, "gen")          # the slots now hold the old weights of some layers
    weights = RankWeights(Engine(model, prefix_source=None), CfgComm.single())
    weights.live.stage("1", update)
    assert weights.run({"op": "commit", "id": "c"})["ok"]
    after = stack_forward(model, "gen")
    assert not torch.equal(before, after) and torch.equal(after, stack_forward(resident, "gen"))
