"""`u1serve up` refuses what cannot work before it starts anything (issue 30): GPUs asked for that CUDA cannot
reach (this CPU machine has none), timeouts out of order; `--device auto` with no GPU asked for runs on the CPU
and says so. A dry run plans GPU profiles anywhere (tests/launcher/test_dry_run*.py) and checks no device."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.base.netutil import free_port
from tests.system.stackproc import ROOT

NO_GPU = not os.path.exists("/dev/nvidiactl")


def up(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "tiny", "--host", "127.0.0.1",
                           "--port", str(free_port()), *flags], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.skipif(not NO_GPU, reason="checks a machine without usable CUDA (this one has a driver)")
@pytest.mark.parametrize("flags", [["--mode", "colocate", "--und-gpus", "0"],          # the README's command
                                   ["--device", "cuda"],
                                   ["--mode", "separate", "--und-gpus", "0", "--gen-gpus", "1"]])
def test_gpus_asked_for_but_not_usable_fail_at_start(flags, tmp_path):
    r = up(*flags, "--run-dir", str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "the GPUs asked for" in out and "are not usable here" in out and "--device cpu" in out, out
    assert "starting und" not in out and "float32" not in out, out


def test_device_auto_without_gpus_plans_the_cpu_and_says_so():
    r = up("--dry-run")
    assert r.returncode == 0, r.stderr
    assert "--device cpu" in r.stdout and "--dtype float32" in r.stdout
    if NO_GPU:
        assert "device auto: no NVIDIA driver here and no GPU asked for" in r.stderr and "float32" in r.stderr


def test_a_dry_run_plans_named_gpus_without_cuda():
    r = up("--und-gpus", "0", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "CUDA_VISIBLE_DEVICES=0 " in r.stdout and "--device cuda" in r.stdout


@pytest.mark.parametrize("flags,says", [
    (["--gen-args", "--stream-heartbeat-s 400"], "--stream-heartbeat-s 400 must be below"),
    (["--gen-args", "--stream-heartbeat-s 0 --max-queue-wait-s 600"], "without heartbeats"),
    (["--gateway-args", "--request-timeout-s 300"], "--max-queue-wait-s 600 must be below the gateway's "
                                                    "--request-timeout-s 300"),
    (["--und-args", "--max-queue-wait-s 400"], "understanding's --max-queue-wait-s 400"),
    (["--und-args", "--prefix-pages-wait-s 300"], "understanding's --prefix-pages-wait-s 300 must be below"),
    (["--gateway-args=--upstream-idle-timeout-s=5"], "must be below the gateway's --upstream-idle-timeout-s 5"),
])
def test_timeouts_out_of_order_are_refused(flags, says):
    r = up(*flags, "--dry-run")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "timeouts out of order" in r.stderr and says in r.stderr, r.stderr
