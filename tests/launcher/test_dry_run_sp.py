"""`u1serve up --dry-run` for the profiles of issue 13 (sequence parallelism, colocate QoS, the trained size
limit): the placement and command lines of profiles that need more GPUs than CI has, and the refusals."""
import re
import shlex
import subprocess

import pytest

from .dryrun import cli, dry_run as in_process_dry_run


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Full-size configs (no weights): {variant: dir}."""
    out = {}
    for variant in ("u1-8b", "u1.5-8b"):
        d = tmp_path_factory.mktemp(variant)
        assert cli("tiny-checkpoint", str(d), "--variant", variant).returncode == 0
        out[variant] = str(d)
    return out


def dry_run(model: str, flags: str) -> subprocess.CompletedProcess:
    return in_process_dry_run(model, "--kv-pool-name", "pool-x", *shlex.split(flags))


def plan(stdout: str) -> dict:
    """{service: (CUDA_VISIBLE_DEVICES, argv after the interpreter)}."""
    out = {}
    for line in stdout.splitlines():
        name, rest = line.split(":", 1)
        gpus = re.search(r"CUDA_VISIBLE_DEVICES=(\S*)", rest)
        argv = shlex.split(rest[rest.index(" -m ") + 1:])
        out[name] = (gpus.group(1) if gpus else None, argv)
    return out


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# (flags, und GPUs, gen GPUs, gen --cfg-parallel, gen --sp[, gen --sp-mode])
PROFILES = {
    "2 GPUs colocate TP2 + SP2 (guidance 1)": (
        "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-sp 2", "0,1", "0,1", 1, 2),
    "2 GPUs colocate TP2 + SP2 by K/V all-gather": (
        "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-sp 2 --gen-sp-mode kv-gather", "0,1", "0,1", 1, 2,
        "kv-gather"),
    "4 GPUs colocate TP2 + CFG2 x SP2 by K/V all-gather": (
        "--mode colocate --und-gpus 0,1,2,3 --und-tp 2 --gen-cfg-parallel 2 --gen-sp 2 --gen-sp-mode kv-gather",
        "0,1,2,3", "0,1,2,3", 2, 2, "kv-gather"),
    "3 GPUs: kv-gather takes an sp that does not divide the 8 KV heads": (
        "--mode colocate --und-gpus 0,1,2 --gen-sp 3 --gen-sp-mode kv-gather", "0,1,2", "0,1,2", 1, 3,
        "kv-gather"),
    "1 GPU: kv-gather without SP is allowed and changes nothing": (
        "--mode colocate --und-gpus 0 --gen-sp-mode kv-gather", "0", "0", 1, 1, "kv-gather"),
    "4 GPUs colocate TP2 + CFG2 x SP2": (
        "--mode colocate --und-gpus 0,1,2,3 --und-tp 2 --gen-cfg-parallel 2 --gen-sp 2", "0,1,2,3", "0,1,2,3", 2, 2),
    "4 GPUs separate TP2 + CFG2": (
        "--mode separate --und-gpus 0,1 --gen-gpus 2,3 --und-tp 2 --gen-cfg-parallel 2", "0,1", "2,3", 2, 1),
    "separate, default generation GPUs after understanding's: CFG2 x SP2": (
        "--mode separate --und-gpus 0 --gen-cfg-parallel 2 --gen-sp 2", "0", "1,2,3,4", 2, 2),
    "6 GPUs separate TP2 + CFG2 x SP2": (
        "--mode separate --und-gpus 0,1 --gen-gpus 2,3,4,5 --und-tp 2 --gen-cfg-parallel 2 --gen-sp 2",
        "0,1", "2,3,4,5", 2, 2),
}


@pytest.mark.parametrize("name", list(PROFILES))
def test_sp_placement(configs, name):
    flags, und_gpus, gen_gpus, cfg, sp, *mode = PROFILES[name]
    r = dry_run(configs["u1-8b"], flags)
    assert r.returncode == 0, r.stderr
    p = plan(r.stdout)
    assert set(p) == {"und", "gen", "gateway"}
    assert p["und"][0] == und_gpus and p["gen"][0] == gen_gpus
    gen = p["gen"][1]
    assert (int(flag(gen, "--cfg-parallel")), int(flag(gen, "--sp"))) == (cfg, sp)
    assert flag(gen, "--sp-mode") == (mode or ["ulysses"])[0]
    assert len(gen_gpus.split(",")) >= cfg * sp                    # one GPU per generation rank
    # the generation server accepts the command line it is given (flags and their combination)
    from services.generation.config import config_from_args
    from services.generation.rank_options import check_rank_flags
    from services.generation.server import build_parser
    check_rank_flags(config_from_args(build_parser().parse_args(gen[2:])))


def test_qos_wires_both_engines_to_one_page(configs):
    r = dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2 "
                                  "--qos-yield-share 0.5")
    assert r.returncode == 0, r.stderr
    p = plan(r.stdout)
    und, gen = p["und"][1], p["gen"][1]
    assert flag(und, "--yield-signal") == "pool-x-yield"
    assert flag(gen, "--yield-to") == "pool-x-yield" and float(flag(gen, "--yield-share")) == 0.5
    assert "--yield-to" not in p["gateway"][1] and "--yield-signal" not in gen
    from services.generation.server import build_parser as gen_parser
    from services.understanding.server import build_parser as und_parser
    assert und_parser().parse_args(und[2:]).yield_signal == "pool-x-yield"
    assert gen_parser().parse_args(gen[2:]).yield_to == "pool-x-yield"
    # without the flag: the default gate (services/launch/colocate_qos.py); with 0: neither engine yields
    p = plan(dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0,1 --und-tp 2").stdout)
    assert flag(p["und"][1], "--yield-signal") == flag(p["gen"][1], "--yield-to") == "pool-x-yield"
    assert float(flag(p["gen"][1], "--yield-share")) == 0.05
    p = plan(dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0,1 --und-tp 2 --qos-yield-share 0").stdout)
    assert "--yield-signal" not in p["und"][1] and "--yield-to" not in p["gen"][1]


def test_gateway_gets_the_trained_size_limit(configs):
    """U1 is trained up to 2048² (4,096 tokens), U1.5 up to 4096² (16,384): the gateway's --max-pixels."""
    for variant, pixels in (("u1-8b", 2048 * 2048), ("u1.5-8b", 4096 * 4096)):
        r = dry_run(configs[variant], "--mode colocate --und-gpus 0")
        assert r.returncode == 0, r.stderr
        assert int(flag(plan(r.stdout)["gateway"][1], "--max-pixels")) == pixels, variant
    # an operator's tighter --gateway-args value comes later on the command line, so it wins
    r = dry_run(configs["u1-8b"], "--mode colocate --und-gpus 0 --gateway-args '--max-pixels 1048576'")
    from services.gateway.config import build_arg_parser
    assert build_arg_parser().parse_args(plan(r.stdout)["gateway"][1][2:]).max_pixels == 1048576


@pytest.mark.parametrize("flags, message", [
    ("--gen-sp 3 --und-gpus 0,1,2", "32 attention heads and 8 KV heads (sizes this model takes: 1, 2, 4, 8)"),
    ("--gen-sp 0", "--gen-cfg-parallel and --gen-sp must be >= 1"),
    ("--gen-sp 2 --und-gpus 0,1 --gen-sp-mode ring", "--gen-sp-mode: invalid choice"),
    ("--mode separate --und-gpus 0,1 --gen-gpus 2,3 --und-tp 2 --gen-cfg-parallel 2 --gen-sp 2",
     "--gen-cfg-parallel 2 x --gen-sp 2 needs 4 GPUs"),
    ("--mode colocate --und-gpus 0 --gen-sp 2", "--gen-cfg-parallel 1 x --gen-sp 2 needs 2 GPUs"),
    ("--mode separate --und-gpus 0 --gen-gpus 1 --qos-yield-share 0.5", "--qos-yield-share is for --mode colocate"),
    ("--mode colocate --und-gpus 0 --qos-yield-share -0.1", "--qos-yield-share must be in [0, 1]"),
    ("--mode colocate --und-gpus 0 --qos-yield-share 1.5", "--qos-yield-share must be in [0, 1]"),
    ("--mode colocate --und-gpus 0,1 --und-replicas 2 --qos-yield-share 0.5", "one understanding and one generation"),
])
def test_bad_combinations_are_refused(configs, flags, message):
    r = dry_run(configs["u1-8b"], flags)
    assert r.returncode != 0 and message in r.stderr + r.stdout, (r.stdout, r.stderr)


def test_gen_sp_mode_choices_are_the_engines():
    """u1serve up lists the modes without importing torch; they are generation config.SP_MODES."""
    import argparse

    from services.launch.stack import add_stack_flags
    from services.generation.config import SP_MODES as MODES
    p = argparse.ArgumentParser()
    add_stack_flags(p, "tiny")
    assert tuple(next(a for a in p._actions if a.dest == "gen_sp_mode").choices) == MODES


def test_every_bench_deployment_profile_dry_runs(configs):
    """bench/stack.py's profiles (colocate-tp2-cfg2-yield included) are valid `u1serve up` flags."""
    from bench.stack import PROFILES as BENCH
    for name, flags in BENCH.items():
        r = dry_run(configs["u1-8b"], flags.replace("--device cpu", ""))
        assert r.returncode == 0, (name, r.stderr)
        words = flags.split()
        p = plan("\n".join(ln for ln in r.stdout.splitlines() if not ln.startswith("mps:")))   # the services
        if "fused" in p:     # both engines' flags inside the one fused command (services/fused/launch.py)
            from services.fused.server import split_argv
            _, und, gen = split_argv(p["fused"][1][2:])
            p["und"], p["gen"] = (None, und), (None, gen)
        off = "--qos-yield-share" in words and float(words[words.index("--qos-yield-share") + 1]) == 0
        if "colocate" in words and not off:     # the default gate, or an explicit share
            assert flag(p["gen"][1], "--yield-to") == flag(p["und"][1], "--yield-signal") == "pool-x-yield", name
        else:
            assert "--yield-to" not in p["gen"][1] and "--yield-signal" not in p["und"][1], name


def test_gpu_smoke_sp_profiles_dry_run(configs, tmp_path):
    """deploy/gpu_smoke.py's SP profiles plan generation over both GPUs, colocate-tp2-sp2-kv in kv-gather
    mode (run on request only)."""
    from bench import profile_stack
    assert "colocate-tp2-sp2-kv" in profile_stack.ON_REQUEST and "colocate-tp2-sp2-kv" not in profile_stack.profiles_for(8)
    assert "colocate-tp2-sp2-kv-graphs" in profile_stack.ON_REQUEST
    for name, mode in (("colocate-tp2-sp2", "ulysses"), ("colocate-tp2-sp2-kv", "kv-gather"),
                       ("colocate-tp2-sp2-kv-graphs", "kv-gather")):
        r = dry_run(configs["u1-8b"], shlex.join(profile_stack.PROFILES[name][1]))
        assert r.returncode == 0, (name, r.stderr)
        gpus, gen = plan(r.stdout)["gen"]
        assert gpus == "0,1" and (flag(gen, "--sp"), flag(gen, "--sp-mode")) == ("2", mode), name
        assert flag(gen, "--cuda-graphs") == ("on" if name.endswith("-graphs") else None), name
        assert profile_stack.Stack(name, str(tmp_path / name)).graphs_expected(), name   # on by default on GPUs
