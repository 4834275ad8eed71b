"""`u1serve up --dry-run` shows the placement of every documented profile (README, docs/deployment.md,
deploy/*.sh) without starting anything; bad placements are refused with the reason."""
import os
import shlex
import subprocess
import sys

import pytest

from .dryrun import cli, dry_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("u1-8b")
    assert cli("tiny-checkpoint", str(d), "--variant", "u1-8b").returncode == 0
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    return str(d)


# (flags of the documented command, und GPUs, gen GPUs, und TP, gen CFG ranks, memory fractions?)
PROFILES = {
    "1 GPU colocate": ("--mode colocate --und-gpus 0", "0", "0", 1, 1, True),
    "2 GPUs colocate TP2 + CFG2": ("--mode colocate --und-gpus 0,1 --und-tp 2 --gen-cfg-parallel 2",
                                   "0,1", "0,1", 2, 2, True),
    "2 GPUs separate 1 + 1": ("--mode separate --und-gpus 0 --gen-gpus 1 --und-tp 1 --gen-cfg-parallel 1",
                              "0", "1", 1, 1, False),
    "4 GPUs separate TP2 + CFG2": ("--mode separate --und-gpus 0,1 --gen-gpus 2,3 --und-tp 2 --gen-cfg-parallel 2",
                                   "0,1", "2,3", 2, 2, False),
}


@pytest.mark.parametrize("name", list(PROFILES))
def test_documented_profile(model, name):
    flags, und_gpus, gen_gpus, tp, cfg, fractions = PROFILES[name]
    r = dry_run(model, *shlex.split(flags), "--port", "9000", "--api-key", "sk-secret",
                env={"U1SERVE_INTERNAL_TOKEN": "tok-secret"})
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":", 1)[0]: ln for ln in r.stdout.splitlines()}
    assert set(lines) == {"und", "gen", "gateway"}
    assert f"CUDA_VISIBLE_DEVICES={und_gpus} " in lines["und"] and f"--tp {tp}" in lines["und"]
    assert f"CUDA_VISIBLE_DEVICES={gen_gpus} " in lines["gen"] and f"--cfg-parallel {cfg}" in lines["gen"]
    assert ("U1SERVE_GPU_MEMORY_FRACTION" in r.stdout) == fractions
    # engine ports follow --port; secrets never appear (they travel in the environment)
    assert "--port 9100" in lines["und"] and "--port 9200" in lines["gen"]
    assert "http://127.0.0.1:9100" in lines["gateway"] and "http://127.0.0.1:9200" in lines["gateway"]
    assert "secret" not in r.stdout


def _plan(stdout: str) -> tuple:
    """(und GPUs, gen GPUs, und TP, gen CFG ranks, memory fractions?) of a dry-run's output."""
    import re
    lines = {ln.split(":", 1)[0]: ln for ln in stdout.splitlines()}
    def grab(pattern, line):
        return re.search(pattern, lines[line]).group(1)
    return (grab(r"CUDA_VISIBLE_DEVICES=(\S+)", "und"), grab(r"CUDA_VISIBLE_DEVICES=(\S+)", "gen"),
            int(grab(r"--tp (\d+)", "und")), int(grab(r"--cfg-parallel (\d+)", "gen")),
            "U1SERVE_GPU_MEMORY_FRACTION" in stdout)


def test_every_documented_command_is_a_valid_profile(model):
    """Each `u1serve up` command in README.md and docs/deployment.md dry-runs to one of PROFILES."""
    import re
    text = "".join(open(os.path.join(ROOT, p)).read() for p in ("README.md", "docs/deployment.md"))
    commands = re.findall(r"^u1serve up --model \S+ ((?:[^\n]*\\\n)*[^\n]*)$", text, re.M)
    assert len(commands) >= 3, commands
    want = {v[1:] for v in PROFILES.values()}
    for cmd in commands:
        r = dry_run(model, *shlex.split(cmd.replace("\\\n", " ")))
        assert r.returncode == 0, (cmd, r.stderr)
        assert _plan(r.stdout) in want, (cmd, r.stdout)


def test_every_documented_deploy_script_profile(model, tmp_path):
    """The runbook's profile table runs deploy/start_*.sh with env settings; each is one of PROFILES."""
    import re
    shim = tmp_path / "bin" / "u1serve"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m services.launch.cli \"$@\" --device cuda --dry-run\n")
    shim.chmod(0o755)
    table = open(os.path.join(ROOT, "docs", "deployment.md")).read()
    rows = re.findall(r"`((?:[A-Z_]+=\S+ )*)MODEL=\.\.\. (deploy/start_\w+\.sh)`", table)
    assert len(rows) >= 4, rows
    want = {v[1:] for v in PROFILES.values()}
    for assignments, script in rows:
        env = dict(a.split("=", 1) for a in assignments.split())
        r = subprocess.run([os.path.join(ROOT, script)], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT, "MODEL": model,
                                "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", **env})
        assert r.returncode == 0, (script, env, r.stderr)
        assert _plan(r.stdout) in want, (script, env, r.stdout)


def test_the_launcher_plans_without_torch(model, tmp_path):
    """`u1serve up` (and its --dry-run) plans a stack without importing torch: the engines import it, the
    launcher need not pay its ~1 s (only --gen-sp, which checks the head split, does), --lora included."""
    lora = str(tmp_path / "adapter.safetensors")
    open(lora, "wb").close()
    code = ("import runpy, sys\n"
            "sys.argv = ['u1serve', 'up', '--model', sys.argv[1], '--device', 'cuda', '--und-gpus', '0,1', "
            "'--und-tp', '2', '--gen-cfg-parallel', '2', '--lora', sys.argv[2] + ':0.5', '--dry-run']\n"
            "try:\n    runpy.run_module('services.launch.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'the launcher imported torch'\n")
    r = subprocess.run([sys.executable, "-c", code, model, lora], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert f"--lora {lora}:0.5" in r.stdout


def test_bad_placements_are_refused(model):
    r = dry_run(model, "--mode", "separate", "--und-gpus", "0,1", "--gen-gpus", "1,2")
    assert r.returncode != 0 and "disjoint" in r.stderr + r.stdout
    r = dry_run(model, "--und-gpus", "0", "--und-tp", "2")
    assert r.returncode != 0 and "--und-tp 2 needs 2 GPUs" in r.stderr + r.stdout
    r = dry_run(model, "--gen-args", "--internal-token x")
    assert r.returncode != 0 and "--internal-token-file" in r.stderr + r.stdout


def test_the_gateway_gets_a_host_only_when_one_is_given(model):
    """No --host: the gateway decides (loopback without an API key); a given --host reaches it as given."""
    def gateway_argv(*flags):
        r = dry_run(model, "--mode", "colocate", "--und-gpus", "0", *flags)
        assert r.returncode == 0, r.stderr
        return shlex.split(next(line for line in r.stdout.splitlines() if line.startswith("gateway:")))
    assert "--host" not in gateway_argv()
    argv = gateway_argv("--host", "0.0.0.0")
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
