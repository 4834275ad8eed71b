"""The runbook's scripts as docs/deployment.md tells users to run them, on the tiny checkpoint (CPU): a profile's
start script (GPU lists and all, plus `--device cpu`: `u1serve up` refuses GPUs it cannot use), then
deploy/smoke_test.sh against it with the API key, then Ctrl-C: a clean stop that leaves no process, no pool."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from services.netutil import free_port
from services.kit.proc import preexec_die_with_parent
from tests.system.stackproc import ROOT, group_alive, shm_entries, wait_ok

# the runbook's profile table (docs/deployment.md, "Hardware profiles"): the script and its environment
PROFILES = {
    "colocate, 1 GPU": ("start_colocate.sh", {"GPUS": "0", "UND_TP": "1", "GEN_CFG": "1"}),
    "separate, 1 + 1": ("start_separate.sh", {"UND_GPUS": "0", "GEN_GPUS": "1", "UND_TP": "1", "GEN_CFG": "1"}),
}


@pytest.mark.parametrize("profile", PROFILES)
def test_start_script_then_smoke_test(profile, tmp_path):
    script, env = PROFILES[profile]
    port, key = free_port(), "sk-runbook-test"
    (tmp_path / "api_key").write_text(key + "\n")
    doc = open(os.path.join(ROOT, "docs", "deployment.md")).read()
    assert f"deploy/{script}" in doc and " ".join(f"{k}={v}" for k, v in env.items()) in doc, \
        "the runbook no longer shows this profile's command"
    env = {**os.environ, "PYTHONPATH": ROOT, "MODEL": "tiny", "PORT": str(port), **env}
    log = open(tmp_path / "stack.log", "w")
    shm_before = shm_entries()
    # extra flags pass through to `u1serve up` (the runbook's "--port 9000 --api-key KEY" example); this machine has
    # no GPU, so the named GPUs are replaced by --device cpu, as the start check tells a user to
    proc = subprocess.Popen([os.path.join(ROOT, "deploy", script), "--device", "cpu", "--host", "127.0.0.1",
                             "--api-key-file", str(tmp_path / "api_key"), "--run-dir", str(tmp_path / "run"),
                             "--default-size", "64x64"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=preexec_die_with_parent)
    output = lambda: (tmp_path / "stack.log").read_text()[-6000:]  # noqa: E731
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", proc, output, 300, script)
        smoke = subprocess.run([os.path.join(ROOT, "deploy", "smoke_test.sh")], cwd=ROOT, capture_output=True,
                               text=True, timeout=300, env={**os.environ, "BASE": f"http://127.0.0.1:{port}",
                                                            "API_KEY": key, "SIZE": "64x64", "STEPS": "2"})
        assert smoke.returncode == 0 and "all endpoints OK" in smoke.stdout, smoke.stdout + smoke.stderr
        assert smoke.stdout.count("  ok   ") == 10, smoke.stdout   # every step of it ran
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)      # Ctrl-C, as a user stops it
        rc = proc.wait(60)
        log.close()
    assert rc == 0, output()
    assert not group_alive(proc.pid), "a service outlived the stack"
    assert not [e for e in shm_entries() - shm_before if e.startswith(f"u1serve-kv-{proc.pid}-")]
