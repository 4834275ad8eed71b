"""The serving defaults of issue 25 that a CPU can check:

- graphed steps in segments (step_graph.py): the data flow of captured segments — static inputs, each segment
  reading the previous one's output buffer, a first-block step cache deciding between [0, 1) and the rest, the
  yield gate running between segments — through a CPU stand-in for CUDA capture (genhelp's
  `RecordingGraphs`: "capture" keeps the segment's closure and output buffer, "replay" recomputes into that
  buffer). The images must be those of the eager engine bit for bit. Whether real capture and replay match on
  CUDA: bench/gpu_defaults.sh;
- fp8 from 1024 rows only where graphs run (GemmPolicy.for_device(graphed=True));
- the batching rule (scheduler.py): jobs batch within BATCH_TOKENS rows a forward, the others wait their turn;
- the size-table warm-up: one step per branch count for each table size not configured, its time per size.
"""
from __future__ import annotations

import torch

from services.contract.image import GenerateRequest, SamplerParams
from services.contract.limits import SIZE_TABLE
from services.generation.config import GenerationConfig
from services.generation import engine as engine_mod
from services.generation.engine import Engine
from services.generation.qos import YieldGate
from services.generation.config import BATCH_TOKENS
from services.generation.scheduler import Scheduler
from services.generation.step_graph import REPLAY
from services.generation.warmup import run_warmup, warmup_plan
from services.model.quant import CUDA_MIN_TOKENS, GRAPHED_MIN_TOKENS, GemmPolicy

from .genhelp import RecordingGraphs, run_jobs


class _CountingGate(YieldGate):
    """The real gate on a signal page nobody raises (it never waits); counts where it was consulted."""

    def __init__(self):
        super().__init__("u1serve-test-no-such-page", torch.device("cpu"))
        self.calls = 0

    def boundary(self):
        self.calls += 1
        super().boundary()


def _spec(rid: str, guidance: float, steps: int, cache: dict | None = None) -> GenerateRequest:
    branches = SamplerParams(guidance_scale=guidance).branches()
    return GenerateRequest(request_id=rid, handles={b: {} for b in branches}, mode="t2i", width=64, height=64, n=1,
                           num_inference_steps=steps, guidance_scale=guidance, seed=5, cache=cache)


def _run(engine: Engine, ref_model, specs) -> dict:
    return {rid: (j.x, j.branch_steps, j.graph_steps) for rid, j in run_jobs(engine, ref_model, specs).items()}


CACHE = {"mode": "first_block", "threshold": 0.3, "warmup_steps": 1}


def test_graphed_segments_give_the_eager_images_with_cache_and_gate(ref_model, monkeypatch):
    model = ref_model[0]
    monkeypatch.setattr(engine_mod, "graphable", lambda device, lora_rows: not lora_rows)   # CUDA's rule, here
    specs = [_spec("cfg", 4.0, 4), _spec("one", 1.0, 3)]
    cached = [_spec("cfg-cached", 4.0, 5, CACHE), _spec("one-cached", 1.0, 5, CACHE)]
    eager_plain = _run(Engine(model, None), ref_model, specs)
    eager_cached = _run(Engine(model, None), ref_model, cached)
    assert sum(b["reused"] for b in eager_cached["cfg-cached"][1].values()) > 0   # the cache does reuse here

    # no gate, no cache: one segment, the whole stack; captured on the 2nd step of a composition, replayed after
    engine = Engine(model, None)
    engine.graphs = RecordingGraphs()
    got = _run(engine, ref_model, specs)
    for rid, (x, _, graph_steps) in got.items():
        assert torch.equal(x, eager_plain[rid][0]), rid
        assert graph_steps > 0
    assert engine.graphs.captures >= 1 and engine.graphs.replays >= 1

    # a first-block cache: [0, 1) then the rest; reused steps run the computing rows eagerly, same decisions
    engine = Engine(model, None)
    engine.graphs = RecordingGraphs()
    got = _run(engine, ref_model, cached)
    for rid, (x, steps, graph_steps) in got.items():
        assert torch.equal(x, eager_cached[rid][0]) and steps == eager_cached[rid][1], rid
        assert graph_steps > 0

    # the yield gate: consulted between segments of `graph_segment_layers` layers on graphed steps
    gate = _CountingGate()
    engine = Engine(model, None, yield_gate=gate, graph_segment_layers=1)
    engine.graphs = RecordingGraphs()
    got = _run(engine, ref_model, [_spec("cfg", 4.0, 4)])
    assert torch.equal(got["cfg"][0], eager_plain["cfg"][0])
    layers = model.num_layers
    # step 1 eager: before every layer's attention; steps 2-4 graphed: between the `layers` one-layer segments
    assert gate.calls == layers + 3 * (layers - 1)
    assert engine.graphs.last == REPLAY


def test_fp8_threshold_is_lower_only_where_graphs_run(monkeypatch):
    monkeypatch.delenv("U1SERVE_FP8_MIN_TOKENS", raising=False)
    cuda = torch.device("cuda")
    assert GemmPolicy.for_device(cuda).min_tokens == CUDA_MIN_TOKENS == 2048
    assert GemmPolicy.for_device(cuda, graphed=True).min_tokens == GRAPHED_MIN_TOKENS == 1024
    assert GemmPolicy.for_device("cpu", graphed=True).min_tokens == 0
    monkeypatch.setenv("U1SERVE_FP8_MIN_TOKENS", "4096")             # the operator's value wins
    assert GemmPolicy.for_device(cuda, graphed=True).min_tokens == 4096


def _sched_spec(rid: str, side: int, guidance: float = 4.0) -> GenerateRequest:
    return GenerateRequest(request_id=rid, handles={b: {} for b in SamplerParams(guidance_scale=guidance).branches()},
                           mode="t2i", width=side, height=side, n=1, num_inference_steps=50,
                           guidance_scale=guidance, seed=1)


def test_scheduler_batches_only_within_the_default_budget():
    budget = GenerationConfig(model="m").max_batch_tokens
    assert budget == BATCH_TOKENS == 8192
    s = Scheduler(budget, 16, world=1)
    # two 2048² CFG jobs (8,192 rows each): measured 0.87x of sequential when batched -> they run in turns
    s.pending.extend([_sched_spec("a", 2048), _sched_spec("b", 2048)])
    assert [j.request_id for j in s.pick(0, 0)] == ["a"]
    assert [j.request_id for j in s.pick(s.tokens(_sched_spec("a", 2048)), 1)] == []     # b waits for a
    assert [j.request_id for j in s.pick(0, 0)] == ["b"]                                 # a finished: b runs
    # 1024² CFG jobs (2,048 rows each) batch well: four in one forward, the fifth waits
    s.pending.extend([_sched_spec(f"s{i}", 1024) for i in range(5)])
    assert [j.request_id for j in s.pick(0, 0)] == ["s0", "s1", "s2", "s3"]
    # two 2048² guidance-1 jobs (4,096 rows each) fit one forward, as one CFG job does
    s = Scheduler(budget, 16, world=1)
    s.pending.extend([_sched_spec("g1", 2048, 1.0), _sched_spec("g2", 2048, 1.0)])
    assert len(s.pick(0, 0)) == 2


def test_warmup_plan_covers_the_size_table_with_one_step(tiny_checkpoint):
    assert (2048, 2048) in SIZE_TABLE and (1024, 1024) in SIZE_TABLE
    plan = warmup_plan([(2048, 2048)], 2, list(SIZE_TABLE))
    assert plan[0] == ((2048, 2048), 2) and {s for s, _ in plan} == set(SIZE_TABLE)
    assert all(n == 1 for s, n in plan[1:])
    assert warmup_plan([(64, 64)], 0, list(SIZE_TABLE)) == []          # --warmup-steps 0: no warm-up at all
    from services.model.loader import load_model
    engine = Engine(load_model(tiny_checkpoint("u1"), "gen"), None)
    warm = run_warmup(engine, [(64, 64)], 2, table=[(96, 64), (64, 64)])
    assert warm["sizes"] == ["64x64", "96x64"] and set(warm["per_size"]) == {"64x64", "96x64"}
    assert all(v > 0 for v in warm["per_size"].values()) and not engine.running


def test_warmup_table_is_on_for_cuda_and_off_for_cpu():
    import argparse

    from services.generation.config import add_config_flags, config_from_args
    p = argparse.ArgumentParser()
    add_config_flags(p)
    cpu = config_from_args(p.parse_args(["--model", "m", "--device", "cpu"]))
    cuda = config_from_args(p.parse_args(["--model", "m", "--device", "cuda"]))
    assert (cpu.warmup_table, cuda.warmup_table) == ("off", "on")
    assert cpu.cuda_graphs == cuda.cuda_graphs == "auto"
    forced = config_from_args(p.parse_args(["--model", "m", "--device", "cpu", "--warmup-table", "on"]))
    assert forced.warmup_table == "on"
