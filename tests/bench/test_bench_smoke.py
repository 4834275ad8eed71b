"""Every bench script's CPU smoke mode runs (tiny geometry, seconds) and fills every part it ran: each part's
figures are in its JSON (present, no None / NaN, no empty list or table, no failed profile), so neither a refactor
nor a part that fails quietly (caught, logged, an empty section) gets past CI. The GPU numbers come from the same
scripts without the smoke flags (docs/benchmarks/)."""
import fnmatch
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.system.stackproc import ONE_THREAD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Smoke:
    argv: tuple[str, ...]                # after `python -m`; {tmp}: the test's directory
    parts: tuple[str, ...]               # paths ("a/b/c") into the JSON the run must fill
    cpu_gaps: tuple[str, ...] = ()       # paths (fnmatch) empty by design on the CPU, or when nothing went wrong
    out: str = "out.json"                # the JSON it writes, in {tmp}
    timeout: float = 300


STACK = ("--tiny", "--profiles", "cpu-colocate", "--log-dir", "{tmp}", "--json", "{tmp}/out.json")
# the benches that only measure a stack measure the module's one (tests/bench/conftest.py bench_stack; each start
# costs CI ~30 s); bench_qos starts its own (the stack.json it reports, and a bench's own start stays checked)
ON_STACK = STACK + ("--up-url", "{up}")
PROFILE = "results/cpu-colocate/"
GEN = ("bench.bench_generation", "--device", "cpu", "--tiny", "--size", "128", "--json", "{tmp}/out.json")
SMOKES = {
    "generation": Smoke(GEN + ("--steps", "2"), ("cfg_step_s", "single_step_s", "import", "batching"),
                        cpu_gaps=("import/*/memcpy_s",)),                   # the pinned-memcpy reference: CUDA
    "generation-cfg-parallel": Smoke(GEN + ("--steps", "2", "--cfg-parallel", "2", "--skip-batching"),
                                     ("cfgp_step_s", "world")),
    # every speed-option part (bench/genperf_parts.py; bench/gpu_genperf.sh runs each alone on the GPU)
    "generation-parts": Smoke(
        GEN + ("--part", "fp8,fp8-profile,cache,preset,warmstart,graphs,addnorm,fp8-fused,formats", "--sizes", "128",
               "--steps", "1", "--warmup", "1", "--thresholds", "0,0.1", "--job-steps", "128:3"),
        ("fp8/steps", "fp8/velocity_rel_err", "fp8/gemm_shapes", "fp8/checks", "fp8-profile/models", "cache",
         "preset/rows", "warmstart", "graphs/rows", "graphs/two_jobs", "graphs/cancel", "graphs/next_request",
         "addnorm/rows", "addnorm/kernels", "fp8-fused/rows", "formats/rows", "formats/gguf", "formats/int8_checks"),
        # no mismatch, no capture failure; the cache part's first row runs without a cache (no step counts)
        cpu_gaps=("*/first_mismatches", "*/failure", "cache/rows/0/branch_steps"), timeout=600),
    "lora": Smoke(("bench.bench_lora", "--device", "cpu", "--tiny", "--sizes", "64", "--jobs", "2", "--resident", "1,2",
                   "--steps", "1", "--warmup", "1", "--json", "{tmp}/out.json"), ("rows", "targets")),
    "handoff": Smoke(("bench.bench_handoff", "--device", "cpu", "--layers", "2", "--tokens", "17,100", "--iters", "3",
                      "--json", "{tmp}/out.json"), ("rows", "exact", "producer_stats", "consumer_stats")),
    # the prefix export goes through the engine's own transport, as on the GPU (it once broke there only)
    "understanding": Smoke(("bench.bench_understanding", "--tiny", "--device", "cpu", "--dtype", "float32",
                            "--batches", "1,4", "--decode-tokens", "8", "--ttft-len", "64", "--prefix-len", "40",
                            "--ref-tokens", "4", "--iters", "2", "--profile-prefix", "--json", "{tmp}/out.json"),
                           ("decode", "reference", "ttft_ms", "prefix_export_ms", "prefix_copy_ms",
                            "prefix_profile/first_token/top_kernels", "prefix_profile/prefix_export/top_host_ops",
                            "prefill_graphs/prefix_export_eager_ms", "prefill_graphs/steps",
                            "prefill_graphs/mixed/graphs/mixed_ms", "prefill_graphs/mixed/eager/mixed_ms")),
    "understanding-a3b": Smoke(("bench.bench_understanding", "--tiny", "--variant", "a3b", "--device", "cpu",
                                "--dtype", "float32", "--batches", "1,4", "--decode-tokens", "8", "--ttft-len", "64",
                                "--prefix-len", "40", "--ref-tokens", "4", "--iters", "2", "--json", "{tmp}/out.json"),
                               ("decode", "reference", "ttft_ms", "prefix_export_ms", "prefix_copy_ms")),
    # the skinny GEMM and fused-MoE config sweeps, and the engine profile part on the tiny checkpoint (eager steps
    # where the GPU replays graphs; every layout, so a failing layout fails the smoke)
    "decode-kernels": Smoke(("bench.bench_decode_kernels", "--smoke", "--json", "{tmp}/out.json"),
                            ("skinny", "moe", "profile/fused/replay_ms_b1", "profile/separate/replay_ms_b1",
                             "profile/fused_gated/replay_ms_b1")),
    # the Triton interpreter is too slow for the attention tables at any shape: their kernels are checked under
    # it by tests/kernels/interpreted, the tables run on the GPU only (skipped by name, not by failing quietly)
    "kernels": Smoke(("bench.bench_kernels", "--smoke", "--skip", "correct,prefill,denoise,decode", "--out", "{tmp}"),
                     ("copy_tbps", "norm_rope", "kv_copy", "kv_write"), out="kernels_bench.json"),
    "fp8-kernels": Smoke(("bench.bench_fp8_kernels", "--smoke", "--json", "{tmp}/out.json"), ("timings", "checks"),
                         cpu_gaps=("*/first_mismatches",)),
    "quality": Smoke(("bench.bench_quality", "--smoke", "--json", "{tmp}/out.json"),
                     ("summary", "fp8_velocity_rel_err"),
                     cpu_gaps=("summary/exact/psnr", "summary/exact/rows/*/psnr")),   # exact vs itself: inf dB
    "breakdown-engine": Smoke(("bench.bench_breakdown", "--part", "engine", "--device", "cpu", "--sizes", "256",
                               "--repeat", "2", "--json", "{tmp}/out.json"), ("rows",)),
    "breakdown-services": Smoke(("bench.bench_breakdown", "--part", "services", "--model", "tiny", "--device", "cpu",
                                 "--size", "64", "--steps", "4", "--repeat", "2", "--prompts", "vary",
                                 "--json", "{tmp}/out.json"),
                                ("stages", "total_s", "step_s", "non_steps_s", "first_request", "first_total_s",
                                 "first_request/step_s_each")),
    # image steps while the chats run too: the chats start once the load's first step is seen and the load goes on
    # until they end (a fixed load of 40-step images once finished, or had not begun its steps, outside the chats'
    # window: step_s_with_chat null, 2026-12-07); chats of 64 tokens span several 40-step images' steps
    "deployment": Smoke(("bench.bench_deployment", *ON_STACK, "--size", "64x64", "--steps", "40", "--chat-tokens", "64",
                         "--requests", "1", "--load-delay", "0.1"),
                        tuple(PROFILE + p for p in ("image", "chat_alone", "chat_with_images"))),
    # colocate QoS A/B (issue 25; on the GPU: the defaults off, then on): one side here (each stack costs CI ~30 s),
    # its load figures, its QoS in force and the step cache's reused steps
    "qos": Smoke(("bench.bench_qos", "--tiny", "--profiles", "cpu-colocate", "--clients", "6", "--duration", "4",
                  "--log-dir", "{tmp}", "--json", "{tmp}/out.json"),
                 tuple(f"results/cpu-colocate/{k}" for k in ("chat_p50_s", "chat_p99_s", "chat_steady_p50_s", "images_per_min",
                                                             "images_share", "qos", "cache"))),
    # the load peak of int8 from a float checkpoint per branch (bench/gpu_memcap.sh loadpeak; the peaks are CUDA's
    # allocator figures, so on the CPU the load and the plan's peak are what it fills)
    "load-peak": Smoke(("bench.bench_load_peak", "--tiny", "--json", "{tmp}/out.json"),
                       tuple(f"results/{b}/{p}" for b in ("gen", "und")
                             for p in ("plan_load_peak_bytes", "layerwise/load_s", "after_load/load_s"))),
    # resident vs streamed decoder layers (1 slot, 4 layers): the run fails itself where a streamed step differs
    "weight-streaming": Smoke(("bench.bench_weight_streaming", "--smoke", "--json", "{tmp}/out.json"),
                              ("formats/bf16/rows", "formats/bf16/bandwidth", "formats/int8/rows", "formats/int8/streamer"),
                              cpu_gaps=("formats/*/rows/*/*_peak_gib", "formats/*/bandwidth/memcpy_gb_s")),
    "weight-update": Smoke(("bench.bench_weight_update", *ON_STACK, "--repeat", "1"),
                           tuple(PROFILE + p for p in ("runs", "image_before_s", "upload", "final_version"))),
    "interleave": Smoke(("bench.bench_interleave", *ON_STACK, "--size", "64x64", "--steps", "2", "--requests", "1"),
                        tuple(PROFILE + p for p in ("t2i_s", "interleave_per_image_s", "overhead_per_image_s",
                                                    "before_denoise_s", "interleave_answer_s", "answers"))),
}


def holes(value, path: str):
    """The paths below `path` that hold no figure: None, NaN / inf, an empty string, list or dict."""
    if value is None or value == "" or (isinstance(value, float) and not math.isfinite(value)):
        yield path
    elif isinstance(value, (dict, list)):
        if not value:
            yield path
        for key, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from holes(v, f"{path}/{key}")


def assert_every_part_filled(data: dict, smoke: Smoke) -> None:
    for part in smoke.parts:
        value = data
        for key in part.split("/"):
            assert isinstance(value, dict) and key in value, f"part {part!r} missing: {json.dumps(data)[:3000]}"
            value = value[key]
        empty = [p for p in holes(value, part) if not any(fnmatch.fnmatch(p, g) for g in smoke.cpu_gaps)]
        assert not empty, f"part {part!r} ran without figures at {empty}: {json.dumps(value)[:3000]}"


def run_smoke(argv: list[str], tmp_path, timeout: float = 300, up: str = "", **env) -> subprocess.CompletedProcess:
    """`python -m argv` on one CPU thread a process (ONE_THREAD: a smoke's figures are compared with nothing computed
    at another thread count; on busy cores, as beside a parallel test worker, decode-kernels took 8-13 s so and
    43-46 s unpinned, 2026-12-06). {tmp} in argv: the test's directory; {up}: the running stack's URL."""
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{up}", up) for a in argv]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **ONE_THREAD, **env)
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def run_and_check(smoke: Smoke, tmp_path, up: str = "") -> None:
    run_smoke(list(smoke.argv), tmp_path, smoke.timeout, up)
    assert_every_part_filled(json.loads((tmp_path / smoke.out).read_text()), smoke)


@pytest.mark.parametrize("name", sorted(n for n, s in SMOKES.items() if "{up}" not in s.argv))
def test_bench_smoke_fills_every_part(name, tmp_path):
    run_and_check(SMOKES[name], tmp_path)


@pytest.mark.parametrize("name", sorted(n for n, s in SMOKES.items() if "{up}" in s.argv))
def test_bench_smoke_on_the_running_stack_fills_every_part(name, bench_stack, tmp_path):
    run_and_check(SMOKES[name], tmp_path, bench_stack.base)


def test_up_url_is_one_running_stack_never_silently_ignored():
    """--up-url measures the running stack as the one profile named; more profiles, or a bench that starts a stack
    per setting (run_profile: qos, memcap, defaults), refuse it instead of measuring something else."""
    import argparse

    from bench.stack import run_all, run_profile

    async def measure(base, args):
        return {"base": base}
    args = argparse.Namespace(up_url="http://127.0.0.1:1", profiles="cpu-colocate", json=None)
    assert run_all(args, "", measure, lambda r, a: "") == {
        "cpu-colocate": {"base": "http://127.0.0.1:1", "command": "running stack at http://127.0.0.1:1"}}
    with pytest.raises(SystemExit, match="one running stack"):
        run_all(argparse.Namespace(**{**vars(args), "profiles": "a,b"}), "", measure, lambda r, a: "")
    with pytest.raises(SystemExit, match="a stack per setting"):
        run_profile("cpu-colocate", "", args, measure)


def test_holes_finds_what_a_quiet_failure_leaves():
    data = {"a": {"x": 1.0, "rows": []}, "b": [{"v": None}, {"v": float("nan")}], "c": {"error": "boom"}}
    assert list(holes(data, "")) == ["/a/rows", "/b/0/v", "/b/1/v"]
    with pytest.raises(AssertionError, match="missing"):
        assert_every_part_filled(data, Smoke((), ("c/image",)))
    with pytest.raises(AssertionError, match="without figures"):
        assert_every_part_filled(data, Smoke((), ("a",)))
    assert_every_part_filled(data, Smoke((), ("a", "b"), cpu_gaps=("a/rows", "b/*/v")))


def test_bench_rl_smoke_produces_every_figure(bench_stack, tmp_path):
    """bench/bench_rl.py on the tiny checkpoint: rollout vs plain throughput, the group-prefill comparison and the
    weight-update latency all measured (the GPU run fills docs/benchmarks/rl.md from the same script)."""
    out = tmp_path / "out"
    run_smoke(["bench.bench_rl", "--tiny", "--profiles", "cpu-colocate", "--sizes", "32", "--steps", "2",
               "--group-size", "2", "--prompts", "2", "--repeat", "1", "--out", str(out), "--log-dir", "{tmp}",
               "--up-url", "{up}"], tmp_path, up=bench_stack.base)
    data = json.loads((out / "bench_rl.json").read_text())
    assert_every_part_filled(data, Smoke((), tuple(PROFILE + p for p in ("throughput", "prefill", "weights"))))
    r = data["results"]["cpu-colocate"]
    (t,) = r["throughput"]
    assert t["images"] == 4 and t["rollout_img_per_min"] > 0 and t["plain_img_per_min"] > 0
    assert t["rollout_no_trajectory_img_per_min"] > 0
    shared, separate = r["prefill"]
    assert (shared["prefixes"], separate["prefixes"]) == (2, 4)
    assert r["weights"]["tensors"] > 0
    assert "| 32² | 2 | 4 |" in (out / "bench_rl.md").read_text()


def test_calibrate_teacache_smoke_writes_every_bucket(tmp_path):
    """bench/calibrate_teacache.py on the tiny checkpoint: one fitted bucket per size, which the step cache reads."""
    from services.model.step_cache import rescaled_change
    out = tmp_path / "tea.json"
    proc = run_smoke(["bench.calibrate_teacache", "--smoke", "--out", str(out)], tmp_path)
    data = json.loads(out.read_text())
    assert_every_part_filled(data, Smoke((), ("buckets",)))
    assert [b["max_tokens"] for b in data["buckets"]] == [1, 4] and data["random_weights"]
    for b in data["buckets"]:
        assert b["points"] == 8 and len(b["coefficients"]) == 5      # 2 branches x 4 step pairs, degree 4
        assert all(math.isfinite(c) for c in b["coefficients"]) and b["fit_rel_rms_err"] < 1.0
        lo, hi = b["input_change"]
        assert 0 < lo <= hi and rescaled_change((lo + hi) / 2, b["max_tokens"], str(out)) >= 0.0
    assert "| 64² | 4 | 8 |" in proc.stdout
