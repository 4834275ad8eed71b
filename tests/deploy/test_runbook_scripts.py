"""The runbook's scripts as docs/deployment.md tells users to run them, on the tiny checkpoint (CPU): a profile's
start script (GPU lists and all, plus `--device cpu`: `u1serve up` refuses GPUs it cannot use), then
deploy/smoke_test.sh against it with the API key, then Ctrl-C (SIGINT): a clean stop that leaves no process, no
pool. Both modes, colocate and separate, are checked here as real stacks end to end (the separate one only here)."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess

import httpx
import pytest
from PIL import Image

from services.base.netutil import free_port
from services.kit.proc import preexec_die_with_parent
from services.launch.stack import default_pool_name
from tests.system.stackproc import ROOT, group_alive, pid_alive, shm_entries
from tests.waiting import wait_ok

# the runbook's profile table (docs/deployment.md, "Hardware profiles"): the script and its environment
PROFILES = {
    "colocate, 1 GPU": ("start_colocate.sh", {"GPUS": "0", "UND_TP": "1", "GEN_CFG": "1"}),
    "separate, 1 + 1": ("start_separate.sh", {"UND_GPUS": "0", "GEN_GPUS": "1", "UND_TP": "1", "GEN_CFG": "1"}),
}


@pytest.mark.parametrize("profile", PROFILES)
def test_start_script_then_smoke_test(profile, tmp_path):
    script, env = PROFILES[profile]
    port, key = free_port(), "sk-runbook-test"
    pool = default_pool_name(port)
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
        assert os.path.exists("/dev/shm/" + pool)            # the KV pool exists while serving
        r = httpx.post(f"http://127.0.0.1:{port}/v1/images/generations", timeout=120,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": "x", "size": "64x96", "num_inference_steps": 2, "n": 2})
        assert r.status_code == 200, r.text
        ims = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
        assert [im.size for im in ims] == [(64, 96)] * 2
        with open(tmp_path / "run" / "stack.json") as f:
            services = [s["pid"] for s in json.load(f)["services"].values()]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)      # Ctrl-C, as a user stops it
        rc = proc.wait(60)
        log.close()
    assert rc == 0, output()
    assert "[u1serve] stopped" in output()
    assert not group_alive(proc.pid), "a service outlived the stack"
    assert not [p for p in services if group_alive(p) or pid_alive(p)], "a service outlived the stack"
    assert not os.path.exists("/dev/shm/" + pool)
    assert not [e for e in shm_entries() - shm_before if e.startswith(pool)]
