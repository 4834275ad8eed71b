"""In-process pieces: request validation, admission order, branch placement, bf16 parity, the job's
KV layout (prefix imported once, never rewritten by steps)."""
from __future__ import annotations

import pytest
import torch
from .conftest import make_pool
from .genhelp import publish

from services.contract.image import SamplerParams
from services.generation.cfg_parallel import local_branches
from services.generation.engine import Engine
from services.generation.kv_source import PrefixSource
from services.generation.inputs import check_handles, parse_job
from services.kit.errors import APIError
from services.generation.scheduler import Scheduler
from services.model import reference as R
from services.model import sampler as S


def _handles(fingerprint: str = "f") -> dict:
    from shm_transfer import LAYOUT_VERSION, KVHandle
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "page_tokens": 16}
    return {b: KVHandle(handle_id=i + 1, pool_name="p", pool_generation="g", page_ids=(i,), num_tokens=9,
                        t_offset=9, model_fingerprint=fingerprint, layout_version=LAYOUT_VERSION, layout=layout, branch=b,
                        lease_deadline=0.0).to_dict() for i, b in enumerate(("cond", "uncond"))}


H = _handles()


def spec(rid, side, handles=H):
    return parse_job({"request_id": rid, "handles": handles, "width": side, "height": side, "seed": 1})


def test_parse_defaults_and_errors():
    """The body is the contract's GenerateRequest (+ the server's cache defaults); the engine adds handle parsing
    and the fingerprint."""
    job = parse_job({"request_id": "r", "handles": H, "width": 64, "height": 96, "seed": 3})
    assert (job.n, job.num_inference_steps, job.guidance_scale, job.cfg_norm, job.output_format) == (1, 50, 4.0, "none", "png")
    assert job.num_tokens == 6 and list(job.handles) == ["cond", "uncond"]
    for bad, param in [({"width": 33}, "width"), ({"n": 0}, "n"), ({"num_inference_steps": 1.5},
                       "num_inference_steps"), ({"cfg_interval": [0.9, 0.1]}, "cfg_interval"),
                       ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"output_format": "gif"}, "output_format"),
                       ({"mode": "edit", "cfg_norm": "cfg_zero_star"}, "cfg_norm"),
                       ({"guidance_scale": "x"}, "guidance_scale"), ({"bogus": 1}, "bogus")]:
        with pytest.raises(APIError) as e:
            parse_job({"request_id": "r", "handles": H, "seed": 1, "width": 64, "height": 64, **bad})
        assert e.value.status == 400 and e.value.param == param, (bad, e.value.body())
    with pytest.raises(APIError) as e:   # guidance 4 needs uncond too
        parse_job({"request_id": "r", "handles": {"cond": H["cond"]}, "seed": 1, "width": 64, "height": 64})
    assert e.value.status == 400 and "need handles" in e.value.message
    check_handles(job, "f")
    with pytest.raises(APIError) as e:
        check_handles(job, "g")
    assert e.value.code == "kv_fingerprint_mismatch" and e.value.param == "handles.cond"
    with pytest.raises(APIError) as e:
        check_handles(parse_job({"request_id": "r", "handles": {**H, "cond": {"page_ids": [1]}}, "seed": 1,
                                 "width": 64, "height": 64}), None)
    assert e.value.code == "kv_malformed_handle"


def test_branch_placement():
    assert local_branches(["cond", "uncond"], 0, 2) == ["cond"]
    assert local_branches(["cond", "uncond"], 1, 2) == ["uncond"]
    assert local_branches(["cond", "uncond", "img_cond"], 0, 2) == ["cond", "img_cond"]
    assert local_branches(["cond"], 1, 2) == []
    assert local_branches(["cond", "img_cond", "uncond"], 0, 1) == ["cond", "img_cond", "uncond"]


def test_scheduler_fifo_within_token_budget():
    s = Scheduler(max_batch_tokens=200, max_running_jobs=3, world=1)
    s.pending.extend([spec("a", 256), spec("big", 512), spec("c", 64)])  # 64*2, 256*2, 4*2 tokens
    assert [j.request_id for j in s.pick(0, 0)] == ["a"]          # big does not fit; c waits (FIFO)
    assert [j.request_id for j in s.pick(0, 0)] == ["big"]        # alone it may exceed the budget
    assert [j.request_id for j in s.pick(512, 1)] == []
    assert [j.request_id for j in s.pick(0, 0)] == ["c"]
    s2 = Scheduler(max_batch_tokens=10**6, max_running_jobs=2, world=2)
    s2.pending.extend([spec("x", 256), spec("y", 256), spec("z", 256)])
    assert s2.tokens(s2.pending[0]) == 64  # 2 branches over 2 ranks: one per rank
    assert [j.request_id for j in s2.pick(0, 0)] == ["x", "y"]    # job-count bound


def test_scheduler_turns_commands_into_plans():
    """Rank 0's scheduler in-process: typed commands in, StepPlans out."""
    import queue
    from types import SimpleNamespace

    from services.generation.protocol import AbortJob, Stop, SubmitJob
    released = []
    s = Scheduler(max_batch_tokens=10**6, max_running_jobs=4, world=1, release=released.extend)
    inbox = queue.SimpleQueue()
    for rid in ("a", "b"):
        inbox.put(SubmitJob(spec(rid, 64)))
    inbox.put(AbortJob("b"))                       # still queued: leaves the queue, its pages are freed
    plan = s.schedule(inbox, running=[])
    assert [j.request_id for j in plan.admit] == ["a"] and plan.abort == [] and not plan.stop
    assert released == list(H.values())
    running = [SimpleNamespace(request_id="a", spec=plan.admit[0])]
    inbox.put(AbortJob("a"))                       # running: aborted on every rank by the plan
    inbox.put(Stop())
    plan = s.schedule(inbox, running)
    assert plan.abort == ["a"] and plan.stop and plan.admit == [] and plan.weights is None


def test_the_scheduler_owns_the_pages_of_jobs_that_never_imported():
    """`update` frees a failed admission's pages before the emitter tells the failure; `refuse` frees a queued
    job's pages and tells its error: the scheduler is the one place, the emitter only encodes."""
    import queue

    from services.generation.protocol import SubmitJob
    from services.kit.errors import APIError
    released, failures = [], []
    s = Scheduler(max_batch_tokens=10**6, max_running_jobs=4, world=1, release=released.extend,
                  failed=lambda rid, event: failures.append((rid, event["error"]["code"])))
    inbox = queue.SimpleQueue()
    inbox.put(SubmitJob(spec("a", 64)))
    plan = s.schedule(inbox, running=[])
    s.update(plan, {"a": APIError(503, "no room", code="engine_oom").event()})
    assert released == list(H.values()) and failures == []       # the emitter encodes the failure with the plan
    released.clear()
    s.refuse(spec("b", 64), APIError(503, "mismatch", code="weights_version_mismatch"))
    assert released == list(H.values()) and failures == [("b", "weights_version_mismatch")]


def test_bf16_engine_matches_bf16_reference(tiny_dir):
    """bf16: equal to the bf16 reference here (same CPU kernels); the stated tolerance is 1 uint8 level,
    and bf16 vs fp32 differs by up to ~0.1 in [-1, 1] units on the tiny model (model_spec 12.10)."""
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    dt = torch.bfloat16
    ref_model, gen = load_model(tiny_dir, "both", dtype=dt), load_model(tiny_dir, "gen", dtype=dt)
    tok = NeoTokenizer.from_dir(tiny_dir)
    params = SamplerParams(num_inference_steps=3, guidance_scale=4.0, cfg_norm="global")
    pre = R.image_prefixes(ref_model, tok, "t2i", "a red cat", [], params)
    want = R.denoise(ref_model, pre, 128, 160, params, seed=5, n=2)
    pool = make_pool(gen, dtype="bfloat16")
    try:
        job = parse_job({"request_id": "bf", "handles": publish(pool, pre), "width": 128,
                         "height": 160, "n": 2, "num_inference_steps": 3, "seed": 5,
                         "cfg_norm": "global"})
        engine = Engine(gen, PrefixSource(pool.name, gen.fingerprint, torch.device("cpu")))
        state, stats = engine.admit(job)
        assert pool.stats()["pages_used"] == 0 and [type(s).__name__ for s in stats] == ["KvImportStats"] * 2
        # layout: per (branch, image) segment [prefix ; N image slots], prefixes copied in once
        assert [(s.branch, s.image) for s in state.segments] == [("cond", 0), ("cond", 1),
                                                                   ("uncond", 0), ("uncond", 1)]
        prefix_before = {(s.branch, s.image): state.kv[:, :, s.start:s.start + s.prefix_len].clone()
                         for s in state.segments}
        engine.add(state)
        finished = []
        while engine.running:
            finished += engine.step()[0]
        for s in state.segments:  # steps only ever wrote the image slots
            assert torch.equal(state.kv[:, :, s.start:s.start + s.prefix_len],
                               prefix_before[(s.branch, s.image)])
        got = finished[0].x
        diff = (S.to_uint8(got).int() - S.to_uint8(want).int()).abs()
        assert diff.max() <= 1
    finally:
        pool.close()


def test_pool_of_another_dtype_is_a_clear_503(ref_model):
    model = ref_model[0]
    pool = make_pool(model, dtype="bfloat16")
    try:
        src = PrefixSource(pool.name, model.fingerprint, torch.device("cpu"),
                           geometry=(model.num_layers, model.num_kv_heads, model.head_dim,
                                     torch.float32))
        with pytest.raises(APIError) as e:
            src.pool()
        assert e.value.status == 503 and e.value.code == "kv_pool_mismatch"
        assert "--dtype" in e.value.message
    finally:
        pool.close()
