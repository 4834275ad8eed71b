"""CUDA graphs of the denoise step (services/generation/step_graph.py), what a CPU can check.

- the rules: which steps may run from a graph, the flag and its environment override;
- the keying: eager on the first step of a composition, capture on the second, replay after; a new
  composition or a job of the key leaving releases the graph (before its KV is freed);
- the engine and the real server with `--cuda-graphs on` on CPU run eagerly and give exactly the images of
  `off` (the reference's); a capture that fails falls back to the eager step, bit for bit, and turns graphs
  off for the engine's life;
- graphs keyed by shape (`--graph-keys shape`): with the CUDA graph itself stood in for by a recording that
  replays what it recorded on the same buffers (genhelp's `RecordingGraphs`: no CUDA here; the rest is the
  engine's own path), a later job of the same shape replays from its first step and every job's image is
  `off`'s bit for bit, also when two jobs of one shape step apart on the one graph.
Whether capture and replay work on CUDA is measured on the GPU (bench/gpu_genperf.sh --only graphs: replay vs
eager, torch.equal of the final image).
"""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from services.generation import engine as engine_mod
from services.generation.engine import Engine
from services.contract.image import GenerateRequest, SamplerParams
from services.generation.config import CUDA_GRAPHS_ENV as ENV
from services.generation.config import resolve_mode
from services.generation.step_graph import (CAPTURE, EAGER, MAX_OOM_CAPTURES, REPLAY, GraphPlan, StepGraphs,
                                            composition_key, graphable, layer_segments, out_of_memory)

from .genhelp import (REPO, GenServer, RecordingGraphs, body, errors_of, generate, images_of, prefixes, publish,
                      reference_pixels, run_jobs)

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def test_flag_and_environment_override():
    assert [resolve_mode(m, {}) for m in ("auto", "on", "off")] == ["auto", "on", "off"]
    assert resolve_mode("auto", {ENV: "0"}) == "off" and resolve_mode("off", {ENV: "1"}) == "on"
    assert resolve_mode("on", {ENV: " "}) == "on"
    with pytest.raises(ValueError, match="0 or 1"):
        resolve_mode("auto", {ENV: "yes"})
    with pytest.raises(ValueError, match="--cuda-graphs"):
        resolve_mode("sometimes", {})


def test_which_steps_are_graphable():
    assert graphable(CUDA, False)            # step caches, the yield gate, sequence parallelism too (segments)
    assert not graphable(CPU, False)         # eager on CPU, whatever the flag
    assert not graphable(CUDA, True)         # LoRA adapter rows


def test_layer_segments_cover_the_stack_in_order():
    assert layer_segments(36, 0, False) == [(0, 36)]                       # no gate, no probe: one graph
    assert layer_segments(36, 0, True) == [(0, 1), (1, 36)]                # first-block cache decides after layer 0
    assert layer_segments(10, 4, False) == [(0, 4), (4, 8), (8, 10)]       # the yield gate runs between these
    assert layer_segments(10, 4, True) == [(0, 1), (1, 5), (5, 9), (9, 10)]
    assert layer_segments(1, 4, True) == [(0, 1)]


class _Job:   # only identity matters to the key
    pass


def test_key_is_job_identity_branches_and_rows():
    a, b = _Job(), _Job()
    k = composition_key([(a, ["cond", "uncond"], 0, 8), (b, ["cond"], 8, 12)], 12)
    assert k == composition_key([(a, ("cond", "uncond")), (b, ("cond",))], 12)
    assert k != composition_key([(a, ["cond"]), (b, ["cond"])], 12)               # active branches
    assert k != composition_key([(b, ["cond", "uncond"]), (a, ["cond"])], 12)     # order
    assert k != composition_key([(a, ["cond", "uncond"]), (_Job(), ["cond"])], 12)  # another job object
    assert k != composition_key([(a, ["cond", "uncond"]), (b, ["cond"])], 16)     # row count


class _Shaped(_Job):
    def __init__(self, shape):
        self.shape = shape

    def graph_shape(self):
        return self.shape


def test_keyed_by_shape_jobs_of_one_shape_share_a_key_and_leaving_releases_nothing():
    a, b, c = _Shaped("s"), _Shaped("s"), _Shaped("t")
    k = composition_key([(a, ["cond"])], 4, by_shape=True)
    assert k == composition_key([(b, ["cond"])], 4, by_shape=True)
    assert k != composition_key([(c, ["cond"])], 4, by_shape=True)
    assert k != composition_key([(b, ["cond", "uncond"])], 4, by_shape=True)
    plan = GraphPlan()
    assert plan.action(k) == EAGER and plan.action(k) == CAPTURE
    plan.captured(k)
    assert not plan.forget(a) and not plan.forget(b)          # no job in the key: the graph stays
    assert plan.action(composition_key([(b, ["cond"])], 4, by_shape=True)) == REPLAY
    # with `remember` (keys by shape), a key that ran before captures on its first step when it comes back
    kt = composition_key([(c, ["cond"])], 4, by_shape=True)
    warm = GraphPlan(remember=True)
    assert warm.action(k) == EAGER and warm.action(k) == CAPTURE
    warm.captured(k)
    warm.released()
    assert warm.action(kt) == EAGER and warm.action(kt) == CAPTURE
    warm.captured(kt)
    warm.released()
    assert warm.action(k) == CAPTURE                          # warm: no eager step
    assert plan.action(kt) == EAGER                           # without `remember`: as before
    # a family (the shape less what a prompt's length sets) that ran: its new keys capture on their first step
    fam = GraphPlan(remember=True)
    k1, k2, k3 = (composition_key([(_Shaped(s), ["cond"])], 4, by_shape=True) for s in ("s1", "s2", "s3"))
    f, g = (lambda: "f"), (lambda: "g")
    assert fam.action(k1, f) == EAGER and fam.action(k1, f) == CAPTURE
    fam.captured(k1)
    assert fam.action(k2, f) == CAPTURE and fam.guessed == k2
    assert fam.action(k3, g) == EAGER                         # another family: warms up first
    fam.family_captures = False                               # (after a guessed capture failed)
    assert fam.action(composition_key([(_Shaped("s4"), ["cond"])], 4, by_shape=True), f) == EAGER


def test_plan_eager_then_capture_then_replay_and_invalidation():
    a, b = _Job(), _Job()
    ka, kab = composition_key([(a, ["cond"])], 4), composition_key([(a, ["cond"]), (b, ["cond"])], 8)
    plan = GraphPlan()
    assert plan.action(ka) == EAGER            # first step of the composition: also the warm-up
    assert plan.action(ka) == CAPTURE          # second in a row
    plan.captured(ka)
    assert [plan.action(ka) for _ in range(3)] == [REPLAY] * 3
    # b joins: the held graph goes, the new composition starts over
    assert plan.release_needed(kab) and not plan.release_needed(ka)
    plan.released()
    assert plan.action(kab) == EAGER and plan.action(kab) == CAPTURE
    plan.captured(kab)
    # a job of the key leaves (finished / dropped / cancelled): release before its KV is freed
    assert not plan.forget(_Job())
    assert plan.forget(b)
    plan.released()
    assert plan.action(ka) == EAGER
    # a job seen only on an eager step is forgotten too: no capture for a composition that never repeated
    assert not plan.forget(a) and plan.action(ka) == EAGER
    # a composition that alternates never captures
    plan = GraphPlan()
    assert [plan.action(k) for k in (ka, kab, ka, kab)] == [EAGER] * 4


def test_plan_a_composition_whose_capture_ran_out_of_memory_stays_eager_and_others_still_capture():
    a, b = _Job(), _Job()
    ka, kab = composition_key([(a, ["cond"])], 4), composition_key([(a, ["cond"]), (b, ["cond"])], 8)
    plan = GraphPlan()
    assert plan.action(ka) == EAGER and plan.action(ka) == CAPTURE
    plan.refuse(ka)                                   # the capture ran out of memory
    assert [plan.action(ka) for _ in range(3)] == [EAGER] * 3
    assert plan.action(kab) == EAGER and plan.action(kab) == CAPTURE   # b joins: a new composition captures
    plan.captured(kab)
    assert plan.forget(b)
    plan.released()
    assert plan.action(ka) == EAGER and plan.action(ka) == EAGER        # still refused while a runs
    assert not plan.forget(a) and plan.refused is None                  # a leaves: forgotten


def test_out_of_memory_is_told_from_other_capture_failures():
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not out_of_memory(RuntimeError("operation not permitted when stream is capturing"))
    assert MAX_OOM_CAPTURES >= 2


def test_graphs_are_off_on_cpu_whatever_the_flag(caplog):
    with caplog.at_level(logging.INFO, logger="u1serve.generation.engine"):
        g = StepGraphs(CPU, "on")
    assert not g.enabled and "not a CUDA device" in caplog.text
    assert not StepGraphs(CPU, "auto").enabled and not StepGraphs(CUDA, "off").enabled
    with pytest.raises(ValueError):
        StepGraphs(CPU, "maybe")


def _spec(rid: str, guidance: float, steps: int = 4, size: int = 128) -> GenerateRequest:
    branches = SamplerParams(guidance_scale=guidance).branches()
    return GenerateRequest(request_id=rid, handles={b: {} for b in branches}, mode="t2i", width=size,
                           height=size, n=1, num_inference_steps=steps, guidance_scale=guidance, seed=5)


def _run_jobs(engine: Engine, ref_model, specs) -> dict[str, torch.Tensor]:
    """Run jobs together to the end (reference prefix KV, no pool); {request_id: final x}."""
    return {rid: job.x for rid, job in run_jobs(engine, ref_model, specs).items()}


def test_engine_with_graphs_on_runs_eagerly_on_cpu_bit_for_bit(ref_model):
    torch.manual_seed(0)
    specs = [_spec("cfg", 4.0), _spec("single", 1.0, steps=3)]
    off = _run_jobs(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, specs)
    engine = Engine(ref_model[0], None, cuda_graphs="on")
    on = _run_jobs(engine, ref_model, specs)
    assert all(torch.equal(on[k], off[k]) for k in off)
    g = engine.graphs
    assert (g.captures, g.replays, g.last, g.failure) == (0, 0, EAGER, None)


def test_a_failed_capture_runs_the_step_eagerly_and_turns_graphs_off(ref_model, monkeypatch, caplog):
    """The fallback path, not a claim about CUDA: on a CPU every capture fails for real (no CUDA), so with
    the graphability rule forced open the engine's second step tries one and must recompute the step
    eagerly; the images stay exactly those of `off`, one warning, and no capture is tried again."""
    torch.manual_seed(0)
    specs = [_spec("a", 4.0, steps=5), _spec("b", 1.0, steps=3)]
    off = _run_jobs(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, specs)
    monkeypatch.setattr(engine_mod, "graphable", lambda *a: True)
    engine = Engine(ref_model[0], None, cuda_graphs="off")
    engine.graphs.enabled = True      # what `on` means on a CUDA device
    with caplog.at_level(logging.WARNING, logger="u1serve.generation.engine"):
        got = _run_jobs(engine, ref_model, specs)
    assert all(torch.equal(got[k], off[k]) for k in off)
    g = engine.graphs
    assert not g.enabled and g.failure and (g.captures, g.replays) == (0, 0)
    assert caplog.text.count("CUDA graphs turned off") == 1


def test_server_with_graphs_on_keyed_by_shape_gives_the_reference_images_on_cpu(tiny_dir, pool, ref_model):
    pre = prefixes(ref_model, guidance_scale=4.0)
    server = GenServer(tiny_dir, pool.name, "--cuda-graphs", "on", "--graph-keys", "shape").start()
    try:
        b = body("graphs-on", publish(pool, pre), num_inference_steps=3, n=2)
        status, events = generate(server.url, b)
        metrics = server.metrics()
    finally:
        server.stop()
    assert status == 200 and not errors_of(events), events
    for got, want in zip(images_of(events), reference_pixels(ref_model[0], pre, b)):
        assert np.array_equal(got, want)
    assert metrics["u1_gen_graph_replays_total"] == 0 and metrics["u1_gen_graph_captures_total"] == 0


def test_bad_environment_value_stops_the_server_at_start(tiny_dir, pool):
    env = dict(GenServer.env(), **{ENV: "maybe"})
    argv = GenServer(tiny_dir, pool.name).argv
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"{ENV} must be 0 or 1" in proc.stderr


def test_u1serve_up_passes_the_flag_only_when_not_the_default():
    def gen_line(*extra):
        out = subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "tiny", "--device", "cpu",
                              "--dry-run", *extra], cwd=REPO, check=True, capture_output=True, text=True).stdout
        return next(ln for ln in out.splitlines() if ln.startswith("gen:"))
    assert "--cuda-graphs on" in gen_line("--cuda-graphs", "on")
    assert "--cuda-graphs off" in gen_line("--cuda-graphs", "off")
    assert "--cuda-graphs" not in gen_line()          # auto: the generation server's own default


def _one_by_one(engine: Engine, ref_model, specs, kv_scale: dict, prompts: dict | None = None) -> dict:
    """Each job admitted after the previous one finished, its prefix KV scaled by kv_scale[request_id] (another
    prefix of the same shape) or, given `prompts`, the reference prefix of its own prompt (prompts of other lengths:
    shapes of one family): {request_id: (final x, steps from graphs)}."""
    out = {}
    for spec in specs:
        f = kv_scale.get(spec.request_id, 1.0)
        pre = prefixes(ref_model, prompt=(prompts or {}).get(spec.request_id, "a red cat"), guidance_scale=4.0)
        job = engine.admit_local(spec, {b: pre[b].kv * f for b in spec.handles},
                                 {b: pre[b].t_offset for b in spec.handles})
        engine.add(job)
        while engine.running:
            for done in engine.step()[0]:
                done.free()
        out[spec.request_id] = (job.x, job.graph_steps)
    return out


def test_graphs_keyed_by_shape_replay_a_later_jobs_every_step_bit_for_bit(ref_model, monkeypatch):
    specs = [_spec("a", 4.0, steps=4), _spec("b", 4.0, steps=4).model_copy(update={"seed": 9}),
             _spec("c", 1.0, steps=3), _spec("d", 4.0, steps=4).model_copy(update={"seed": 13})]
    scale = {"b": 0.75, "d": 1.25}             # b, d: other prefixes (and seeds) of a's shape
    off = _one_by_one(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, specs, scale)
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)   # CUDA's rule, here
    by_job = Engine(ref_model[0], None)
    by_job.graphs = RecordingGraphs("job")
    got_job = _one_by_one(by_job, ref_model, specs, scale)
    shaped = Engine(ref_model[0], None)
    shaped.graphs = RecordingGraphs("shape")
    got = _one_by_one(shaped, ref_model, specs, scale)
    for rid in off:
        assert torch.equal(got[rid][0], off[rid][0]) and torch.equal(got_job[rid][0], off[rid][0]), rid
    assert not torch.equal(off["a"][0], off["b"][0])
    # keyed by job, every request pays an eager and a capturing step; keyed by shape, b (a's shape)
    # replays all 4 of its steps and captures nothing; c (another shape) starts over; d (a's shape again, after c's
    # graph took the place) captures on its first step: the shape is warm, no eager step
    assert [got_job[r][1] for r in "abcd"] == [3, 3, 2, 3]
    assert [got[r][1] for r in "abcd"] == [3, 4, 2, 4]
    assert by_job.graphs.captures == 4 and shaped.graphs.captures == 3
    assert shaped.graphs.holds() and not by_job.graphs.holds()    # kept for the next c, let go by job


_FAMILY = {"a": "a red cat", "b": "a red cat on a wall at dusk", "c": "a red cat on a wall at dusk, seen from far"}


def _family_specs():
    return [_spec("a", 4.0, steps=4), _spec("b", 4.0, steps=4).model_copy(update={"seed": 9}),
            _spec("c", 4.0, steps=4).model_copy(update={"seed": 13})]


def test_a_new_prompt_length_of_a_warm_family_captures_on_its_first_step_bit_for_bit(ref_model, monkeypatch):
    """Users' prompts differ in length, and each length is a shape of its own: once a size and branch set ran, a
    prompt of another length captures on its first step (no eager step) and gives `off`'s image bit for bit."""
    specs = _family_specs()
    off = _one_by_one(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, specs, {}, _FAMILY)
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)
    shaped = Engine(ref_model[0], None)
    shaped.graphs = RecordingGraphs("shape")
    got = _one_by_one(shaped, ref_model, specs, {}, _FAMILY)
    assert len({off[r][0].shape for r in off}) == 1 and not torch.equal(off["a"][0], off["b"][0])
    for rid in off:
        assert torch.equal(got[rid][0], off[rid][0]), rid
    assert [got[r][1] for r in "abc"] == [3, 4, 4]        # a: eager, capture, replays; b and c: capture, replays
    assert shaped.graphs.captures == 3 and shaped.graphs.plan.family_captures


def test_a_failed_first_step_capture_of_a_new_prompt_length_runs_eagerly_and_graphs_stay_on(ref_model, monkeypatch,
                                                                                             caplog):
    """Such a capture is a guess (a new length might need something not yet warm): when it fails, that job runs
    eagerly, bit for bit, graphs stay on, and later new lengths warm up with an eager step again."""
    specs = _family_specs()
    off = _one_by_one(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, specs, {}, _FAMILY)
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)
    engine = Engine(ref_model[0], None)
    engine.graphs = graphs = RecordingGraphs("shape")
    record = graphs._record

    def fail_guessed(held, fn, static):
        if graphs._key == graphs.plan.guessed:
            raise RuntimeError("operation not permitted when stream is capturing")
        return record(held, fn, static)
    graphs._record = fail_guessed
    with caplog.at_level(logging.WARNING, logger="u1serve.generation.engine"):
        got = _one_by_one(engine, ref_model, specs, {}, _FAMILY)
    for rid in off:
        assert torch.equal(got[rid][0], off[rid][0]), rid
    # b's guess failed: b ran eagerly; c then warmed up eagerly and captured on its second step
    assert [got[r][1] for r in "abc"] == [3, 0, 3]
    assert graphs.enabled and graphs.failure is None and not graphs.plan.family_captures
    assert caplog.text.count("first step of a new prompt length failed") == 1


def test_two_jobs_of_one_shape_stepped_apart_keep_their_own_kv(ref_model, monkeypatch):
    """RL's exact steps run jobs one by one: both use the one graph; the one running on its buffer moves to a
    copy when the other binds, so neither reads the other's prefix."""
    pre_specs = [_spec("x", 4.0, steps=5), _spec("y", 4.0, steps=5).model_copy(update={"seed": 11})]
    off = _one_by_one(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, pre_specs, {"y": 0.75})
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)
    engine = Engine(ref_model[0], None)
    engine.graphs = RecordingGraphs("shape")
    pre = prefixes(ref_model, guidance_scale=4.0)
    x, y = (engine.admit_local(sp, {b: pre[b].kv * (0.75 if sp.request_id == "y" else 1.0) for b in sp.handles},
                               {b: pre[b].t_offset for b in sp.handles}) for sp in pre_specs)
    engine.add(x)
    engine.add(y)
    done, rounds = {}, 0
    while engine.running:
        for job in list(engine.running):
            for f in engine.step([job])[0]:
                done[f.request_id] = f.x
                f.free()
        rounds += 1
        if rounds == 3:      # both have replayed by now: the one that last bound runs on the graph's buffer
            place = engine.graphs._held.stand_ins[0]
            assert y.kv is place.kv and x.kv is not place.kv and x.kv.data_ptr() != y.kv.data_ptr()
    assert all(torch.equal(done[k], off[k][0]) for k in off)
    assert engine.graphs.replays > 0 and engine.graphs.captures == 1


def test_an_admission_out_of_memory_lets_the_idle_graphs_go_and_is_retried(ref_model, monkeypatch):
    """Keyed by shape, an idle engine holds one composition's graphs and KV buffer: a job of that shape whose KV
    buffer does not fit beside them releases them and is allocated again (a second failure is the job's 503
    engine_oom, as before)."""
    from services.generation.request import JobState
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)
    engine = Engine(ref_model[0], None)
    engine.graphs = RecordingGraphs("shape")
    want = _one_by_one(Engine(ref_model[0], None, cuda_graphs="off"), ref_model, [_spec("b", 1.0, steps=3)], {})
    _one_by_one(engine, ref_model, [_spec("a", 1.0, steps=4)], {})      # b's shape
    assert engine.graphs.holds()
    real, calls = JobState.allocate_kv, []

    def tight(self, *a, **kw):
        calls.append(engine.graphs.holds())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, *a, **kw)
    monkeypatch.setattr(JobState, "allocate_kv", tight)
    got = _one_by_one(engine, ref_model, [_spec("b", 1.0, steps=3)], {})
    assert calls == [True, False]                    # the retry came after the release
    assert torch.equal(got["b"][0], want["b"][0])
    calls.clear()
    monkeypatch.setattr(JobState, "allocate_kv", lambda self, *a, **kw: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory (test)")))
    engine.graphs.release()
    with pytest.raises(torch.OutOfMemoryError):      # nothing held: no retry, the caller's engine_oom
        _one_by_one(engine, ref_model, [_spec("c", 1.0, steps=3)], {})


def test_an_idle_graph_of_another_shape_goes_before_the_jobs_kv_is_allocated(ref_model, monkeypatch):
    """The memory a job of another shape meets is what it meets keyed by job (the memory plan's peak): the idle
    graphs are released before its KV buffer is allocated, not at its first step; a job of the held shape finds
    them kept."""
    from services.generation.request import JobState
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)
    engine = Engine(ref_model[0], None)
    engine.graphs = RecordingGraphs("shape")
    real, held = JobState.allocate_kv, []

    def watched(self, *a, **kw):
        held.append(engine.graphs.holds())
        return real(self, *a, **kw)
    monkeypatch.setattr(JobState, "allocate_kv", watched)
    got = _one_by_one(engine, ref_model, [_spec("a", 4.0, steps=3), _spec("b", 1.0, steps=3),
                                          _spec("c", 1.0, steps=3).model_copy(update={"seed": 9})], {})
    assert held == [False, False, True]         # a: none yet; b: a's shape went first; c: b's shape kept
    assert got["c"][1] == 3 and engine.graphs.holds()
    spec = _spec("d", 1.0, steps=3)
    (branch,) = spec.handles
    job = JobState(spec, [branch], ref_model[0], CPU, torch.float32)
    assert job.graph_shape({branch: 7}, {branch: 3}) != job.graph_shape({branch: 8}, {branch: 3})
    job.allocate_kv({branch: 7}, {branch: 3})
    assert job.graph_shape() == job.graph_shape({branch: 7}, {branch: 3})


def test_keyed_by_shape_a_first_block_cache_decides_as_eagerly_for_each_request(ref_model, monkeypatch):
    """A later request replays from its first step, where its step cache has no residual yet: the [0, 1) segment's
    decision (compute, or the computing rows eagerly) is the request's own, and its image is eager's."""
    cache = {"mode": "first_block", "threshold": 0.3, "warmup_steps": 1}
    specs = [_spec(rid, 4.0, steps=5).model_copy(update={"cache": cache, "seed": seed})
             for rid, seed in (("a", 5), ("b", 9))]
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)
    eager = Engine(ref_model[0], None, cuda_graphs="off")
    want = _one_by_one(eager, ref_model, specs, {"b": 0.75})
    engine = Engine(ref_model[0], None)
    engine.graphs = RecordingGraphs("shape")
    got = _one_by_one(engine, ref_model, specs, {"b": 0.75})
    for rid in want:
        assert torch.equal(got[rid][0], want[rid][0]), rid
    assert got["b"][1] == 5 and engine.graphs.captures >= 2     # b: every step from graphs, a's segments reused
