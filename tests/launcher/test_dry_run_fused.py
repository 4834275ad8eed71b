"""`u1serve up --colocate-engines fused --dry-run`: one fused service on the one GPU, each engine's flags parsed by
its own server's parser with the thread units and stream priorities, the memory shares as the fused server's flags;
the combinations the fused mode cannot run are refused (exit 2) before anything starts."""
import pytest

from services.fused.launch import GEN_FLAGS, UND_FLAGS
from services.fused.server import build_parser, split_argv

from .test_dry_run_sp import configs, dry_run, plan  # noqa: F401  (configs: the module's fixture)


def test_fused_plan_on_one_gpu(configs):
    r = dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0 --colocate-engines fused --fused-args '--hang-s 60'")
    assert r.returncode == 0, r.stderr
    assert "colocate engines: fused (asked for)" in r.stderr
    p = plan(r.stdout)
    assert set(p) == {"fused", "gateway"}
    gpus, argv = p["fused"]
    assert gpus == "0" and argv[:2] == ["-m", "services.fused.server"]
    own, und, gen = split_argv(argv[2:])
    fused = build_parser().parse_args(own)
    assert (fused.und_memory_fraction, fused.gen_memory_fraction, fused.hang_s) == (0.35, 0.55, 60.0)
    from services.generation.server import build_parser as gen_parser
    from services.understanding.server import build_parser as und_parser
    u, g = und_parser().parse_args(und), gen_parser().parse_args(gen)
    assert (u.engine_unit, u.stream_priority, g.engine_unit, g.stream_priority) == ("thread", "high", "thread", "low")
    assert und[-len(UND_FLAGS):] == list(UND_FLAGS) and gen[-len(GEN_FLAGS):] == list(GEN_FLAGS)
    assert u.yield_signal and g.yield_to == u.yield_signal and g.yield_share == 0.05     # the gate, in-process
    assert "U1SERVE_GPU_MEMORY_FRACTION" not in r.stdout      # one process: the shares are the fused flags
    assert u.kv_transport == "device" and g.green_sm_percent == 0   # prefix KV stays on the GPU; whole GPU each


def test_gen_sm_percent_is_generation_green_context_share(configs):
    r = dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0 --colocate-engines fused --gen-sm-percent 75")
    assert r.returncode == 0, r.stderr
    _, und, gen = split_argv(plan(r.stdout)["fused"][1][2:])
    from services.generation.server import build_parser as gen_parser
    assert gen_parser().parse_args(gen).green_sm_percent == 75
    r = dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0 --gen-sm-percent 75")      # two processes: MPS's
    assert r.returncode == 2 and "needs --gpu-sharing mps" in r.stderr


def test_default_is_processes(configs):
    r = dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0")
    assert r.returncode == 0 and "colocate engines: processes (the default" in r.stderr
    assert set(plan(r.stdout)) == {"und", "gen", "gateway"}


@pytest.mark.parametrize("flags,why", [
    ("--mode separate --und-gpus 0 --gen-gpus 1", "is for --mode colocate"),
    ("--mode colocate --und-gpus 0,1 --und-tp 2", "one rank of each engine"),
    ("--mode colocate --und-gpus 0 --gen-replicas 2", "one understanding and one generation replica"),
    ("--mode colocate --und-gpus 0 --gpu-sharing mps", "the fused engines are one process"),
])
def test_what_cannot_run_fused_is_refused(configs, flags, why):
    r = dry_run(configs["u1-8b"], flags + " --colocate-engines fused")
    assert r.returncode == 2 and why in r.stderr, r.stderr


def test_ray_places_engines_itself_no_fused_there():
    import argparse

    from services.launch import stack
    p = argparse.ArgumentParser()
    stack.add_stack_flags(p, model_default=None)
    args = p.parse_args(["--model", "/m", "--colocate-engines", "fused"])
    assert stack.colocate_engines(args) == {"engines": "fused", "why": "asked for"}
    with pytest.raises(SystemExit) as e:
        stack.colocate_engines(args, placed_elsewhere=True)
    assert e.value.code == 2
