"""`u1serve up --gpu-sharing mps`: flag checks, the --dry-run plan, and the MPS control daemon's lifecycle.

The real MPS cannot run here (no NVIDIA driver), so the lifecycle tests put a STAND-IN `nvidia-cuda-mps-control`
first on PATH (tests/launcher/mps_standin.py: a daemonised sleeper with a pid file, stopped by `quit`, recording
the environment it saw) and run the real launcher with real services on CPU (tiny checkpoint;
U1SERVE_MPS_ON_CPU=1 lets mps run without CUDA, for these tests only)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import httpx
import pytest

from services.base.netutil import free_port
from tests.launcher.dryrun import cli, dry_run as in_process_dry_run
from tests.launcher.test_up import _free, _ok, _Output, _tree, _up
from tests.step_cache_probe import assert_cache_took_effect
from tests.system.stackproc import ROOT, group_alive, pid_alive
from tests.waiting import wait_until

STANDIN = os.path.join(ROOT, "tests", "launcher", "mps_standin.py")


@pytest.fixture(scope="module")
def config_model(tmp_path_factory):
    """The 8B config without weights: enough to plan (and to fail before any service starts)."""
    d = tmp_path_factory.mktemp("u1-8b")
    assert cli("tiny-checkpoint", str(d), "--variant", "u1-8b").returncode == 0
    return str(d)


@pytest.fixture()
def run_dir():
    """A short run dir (the MPS pipe dir inside it holds Unix sockets: their paths are short)."""
    d = tempfile.mkdtemp(prefix="u1mps-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def standin_bin(tmp_path, smi_output: str | None = None) -> str:
    """A bin dir with the stand-in `nvidia-cuda-mps-control` (and a stand-in `nvidia-smi` printing smi_output)."""
    bin_dir = tmp_path / "standin-bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-cuda-mps-control"
    tool.write_text(f"#!/bin/sh\n# STAND-IN for tests: not NVIDIA's MPS\nexec {sys.executable} {STANDIN} \"$@\"\n")
    tool.chmod(0o755)
    if smi_output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\n# STAND-IN for tests\ncat <<'EOF'\n{smi_output}EOF\n")
        smi.chmod(0o755)
    return str(bin_dir)


def standin_env(bin_dir: str, **extra: str) -> dict:
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "U1SERVE_MPS_ON_CPU": "1", **extra}


def calls(run: str) -> list[dict]:
    path = os.path.join(run, "mps", "log", "standin-calls.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return dict(items)


def with_pipe_env(pipe_dir: str) -> list[int]:
    """Live processes whose environment names the pipe dir (the daemon and its clients)."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if want in f.read().split(b"\0") and pid_alive(int(entry)):
                        out.append(int(entry))
            except OSError:
                pass
    return out


def cpu_stack(model: str, run: str, *extra: str) -> list[str]:
    # --default-size: a tiny checkpoint's directory would otherwise warm a 2048x2048 image at every generation start
    return ["--model", model, "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()),
            "--run-dir", run, "--kv-pool-gb", "0.05", "--grace", "5", "--default-size", "64x64", "--gpu-sharing", "mps",
            *extra]


def dry_run(model: str, *flags: str, env=None) -> subprocess.CompletedProcess:
    return in_process_dry_run(model, "--port", "9000", "--run-dir", "/tmp/u1mps-plan", *flags, env=env)


# ------------------------------------------------------------------------------------------- flags, plan
@pytest.mark.parametrize("flags,env,says", [
    (["--mode", "separate", "--und-gpus", "0", "--gen-gpus", "1", "--gpu-sharing", "mps"], {},
     "--gpu-sharing mps is for --mode colocate"),
    (["--device", "cpu", "--gpu-sharing", "mps"], {}, "--gpu-sharing mps needs CUDA GPUs"),
    (["--gen-sm-percent", "50"], {}, "it needs --gpu-sharing mps"),
    (["--gpu-sharing", "mps", "--gen-sm-percent", "0"], {}, "must be an integer from 1 to 100"),
    (["--gpu-sharing", "mps", "--gen-sm-percent", "101"], {}, "must be an integer from 1 to 100"),
    (["--gpu-sharing", "mps"], {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, "would apply to understanding too"),
    (["--gen-priority", "low"], {}, "it needs --gpu-sharing mps"),
    (["--gpu-sharing", "mps", "--gen-priority", "high"], {}, "invalid choice"),
    (["--gpu-sharing", "mps"], {"CUDA_MPS_CLIENT_PRIORITY": "1"}, "would apply to understanding too"),
])
def test_refused_flags_are_usage_errors_that_say_why(config_model, flags, env, says):
    r = dry_run(config_model, *flags, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr and r.stdout == "", r.stderr


def _lines(stdout: str) -> dict[str, str]:
    return {ln.split(":", 1)[0]: ln for ln in stdout.splitlines()}


@pytest.mark.parametrize("flags,daemon_gpus,service_gpus", [
    (["--und-gpus", "0"], "0", "0"),
    (["--und-gpus", "0,1", "--und-tp", "2", "--gen-cfg-parallel", "2"], "0,1", "0,1"),
    # MPS renumbers the daemon's GPUs from 0 for its clients
    (["--und-gpus", "2,3", "--und-tp", "2", "--gen-cfg-parallel", "2"], "2,3", "0,1"),
])
def test_dry_run_shows_the_daemon_and_each_services_mps_environment(config_model, flags, daemon_gpus, service_gpus):
    r = dry_run(config_model, "--mode", "colocate", "--gpu-sharing", "mps", "--gen-sm-percent", "70", *flags)
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stdout)
    assert list(lines) == ["mps", "und", "gen", "gateway"], r.stdout        # the daemon first
    pipe, logs = "/tmp/u1mps-plan/mps/pipe", "/tmp/u1mps-plan/mps/log"
    assert lines["mps"] == (f"mps: CUDA_MPS_LOG_DIRECTORY={logs} CUDA_MPS_PIPE_DIRECTORY={pipe} "
                            f"CUDA_VISIBLE_DEVICES={daemon_gpus} nvidia-cuda-mps-control -d")
    for name in ("und", "gen"):
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe} " in lines[name]
        assert f"CUDA_VISIBLE_DEVICES={service_gpus} " in lines[name]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70 " in lines["gen"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in lines["und"]
    assert "CUDA_MPS" not in lines["gateway"]
    # time slicing: no daemon, no MPS variable
    r = dry_run(config_model, "--mode", "colocate", "--gpu-sharing", "time-slice", *flags)
    assert r.returncode == 0 and "CUDA_MPS" not in r.stdout and list(_lines(r.stdout)) == ["und", "gen", "gateway"]
    assert f"CUDA_VISIBLE_DEVICES={daemon_gpus} " in _lines(r.stdout)["und"]


def test_default_is_50_percent_of_the_sms_at_low_priority_for_generation_only(config_model):
    r = dry_run(config_model, "--gpu-sharing", "mps", "--und-gpus", "0")
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stdout)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 " in lines["gen"]
    assert "CUDA_MPS_CLIENT_PRIORITY=1 " in lines["gen"]
    assert "CUDA_MPS_CLIENT_PRIORITY" not in lines["und"] + lines["gateway"]


def test_normal_gen_priority_sets_no_priority(config_model):
    r = dry_run(config_model, "--gpu-sharing", "mps", "--und-gpus", "0", "--gen-priority", "normal")
    assert r.returncode == 0, r.stderr
    assert "CUDA_MPS_CLIENT_PRIORITY" not in r.stdout


def test_exclusive_process_is_fine_prohibited_is_not(tmp_path, monkeypatch):
    from services.launch.mps import MpsError, check_compute_modes
    monkeypatch.setenv("PATH", standin_env(standin_bin(tmp_path, "0, Exclusive_Process\n1, Prohibited\n2, Default\n"))
                       ["PATH"])
    check_compute_modes(["0", "2"])
    with pytest.raises(MpsError, match="GPU 1 is in compute mode Prohibited"):
        check_compute_modes(["0", "1"])


# ------------------------------------------------------------------------------------------- lifecycle
@pytest.fixture()
def port_next_to_a_taken_one():
    """(port, busy): a gateway port whose derived understanding port (port + 100) is taken (something listens on
    `busy`) while the derived generation port (port + 200) is free."""
    for _ in range(100):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        port = busy - 100
        if port >= 1024 and _free(port) and _free(port + 200):
            break
        s.close()
    else:
        raise AssertionError("no port pair found")
    yield port, busy
    s.close()


def test_stack_ports_secrets_restart_and_the_mps_daemon_lifecycle(tiny_checkpoint, tmp_path, run_dir,
                                                                  port_next_to_a_taken_one):
    """One real `u1serve up` (CPU, the MPS stand-in on PATH) for what a running stack must do:
    - ports: an engine port derived from --port that is taken is replaced by a free one;
    - secrets (--api-key-file, U1SERVE_INTERNAL_TOKEN) reach the services through the environment only;
    - a killed service is restarted by the launcher, and serves again;
    - --gpu-sharing mps: the daemon runs before and stops after the services, a restarted generation service keeps
      its MPS environment, and the step cache of a request takes effect under it (issue 25: it was reported
      ignored under MPS)."""
    port, busy = port_next_to_a_taken_one
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-from-a-file\n")
    auth = {"Authorization": "Bearer sk-from-a-file"}
    pipe = os.path.join(run_dir, "mps", "pipe")
    base = f"http://127.0.0.1:{port}"
    p = _up("--model", tiny_checkpoint("u1"), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--api-key-file", str(key_file), "--run-dir", run_dir, "--kv-pool-gb", "0.05", "--grace", "5",
            "--default-size", "64x64", "--gen-sm-percent", "70", "--gpu-sharing", "mps",
            env={**standin_env(standin_bin(tmp_path)), "U1SERVE_INTERNAL_TOKEN": "tok-from-env"})
    output = _Output(p)
    state_now = lambda: json.loads(open(os.path.join(run_dir, "stack.json")).read())  # noqa: E731
    try:
        # the launcher's start-up is over (not only the gateway answering): a service killed before that ends
        # the start-up instead of being restarted
        assert wait_until(lambda: output.has("[u1serve] ready:") or p.poll() is not None, 240), output.text()
        assert _ok(base + "/health"), output.text()
        state = state_now()
        services = state["services"]
        assert f":{busy}/" not in services["und"]["health_url"]             # a free port instead of the taken one
        assert services["gen"]["health_url"] == f"http://127.0.0.1:{port + 200}/health"
        # secrets: on no command line of the stack, but in the services' environment
        pids = [q for s in services.values() for q in _tree(s["pid"])]
        for q in pids + [p.pid]:
            with open(f"/proc/{q}/cmdline", "rb") as f:
                cmd = f.read()
            assert b"sk-from-a-file" not in cmd and b"tok-from-env" not in cmd
        with open(f"/proc/{services['gateway']['pid']}/environ", "rb") as f:
            assert b"U1SERVE_INTERNAL_TOKEN=tok-from-env" in f.read().split(b"\0")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60, headers=auth)
        assert r.status_code == 200, r.text
        # the MPS daemon and its clients
        assert output.has("GPU sharing mps, generation at 70 % of the SMs, priority low"), output.text()
        qos = state["qos"]
        assert qos["gpu_sharing"] == "mps" and qos["gpu_sharing_asked"] == "mps", qos
        assert_cache_took_effect(base, headers=auth)
        start = calls(run_dir)[0]
        assert start["argv"] == ["-d"]
        assert start["env"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert start["env"]["CUDA_MPS_LOG_DIRECTORY"] == os.path.join(run_dir, "mps", "log")
        daemon = state["mps"]["pid"]
        assert state["mps"]["pipe_dir"] == pipe and state["mps"]["gen_sm_percent"] == 70 and pid_alive(daemon)
        und, gen = environ(services["und"]["pid"]), environ(services["gen"]["pid"])
        assert und["CUDA_MPS_PIPE_DIRECTORY"] == gen["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert gen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in und
        # a killed service is restarted by the launcher; a restarted generation service is a client of the same
        # daemon, capped as before
        os.killpg(services["gen"]["pid"], signal.SIGKILL)
        assert wait_until(lambda: state_now()["services"]["gen"]["pid"] != services["gen"]["pid"], 60)
        assert wait_until(lambda: output.has("gen ready again (restart 1)"), 180), output.text()
        assert wait_until(lambda: _ok(base + "/health"), 180)
        again = environ(state_now()["services"]["gen"]["pid"])
        assert again["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70" and again["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert state_now()["mps"]["pid"] == daemon
        r = httpx.post(base + "/v1/images/generations", timeout=120, headers=auth,
                       json={"prompt": "x", "size": "64x64", "num_inference_steps": 1})
        assert r.status_code == 200, r.text
        groups = [s["pid"] for s in state_now()["services"].values()]
    finally:
        p.send_signal(signal.SIGINT)          # Ctrl-C: the normal stop
        p.wait(timeout=120)
    out = output.text()
    assert p.returncode == 0, out
    assert "gen died (killed by SIGKILL); restarting in" in out and "gen ready again (restart 1)" in out, out
    assert out.rstrip().endswith("[u1serve] stopped"), out[-2000:]
    assert not any(group_alive(g) or pid_alive(g) for g in groups)
    logs = "".join(open(os.path.join(run_dir, "logs", f)).read() for f in os.listdir(os.path.join(run_dir, "logs")))
    assert "terminated by a signal" not in logs and "Traceback" not in logs
    # the daemon: started before the first service, stopped after the last one, nothing left
    assert out.index("MPS control daemon running") < out.index("[u1serve] starting und"), out
    assert f"MPS control daemon (pid {daemon}) stopped" in out, out
    quit_ = [c for c in calls(run_dir) if c.get("command") == "quit"]
    assert len(quit_) == 1 and quit_[0]["clients_at_quit"] == [], quit_    # every service was gone by then
    assert quit_[0]["env"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert not pid_alive(daemon) and with_pipe_env(pipe) == [] and not os.path.exists(pipe)


def test_sigterm_during_start_up_stops_the_daemon_and_a_leftover_one_is_stopped_first(tiny_checkpoint, tmp_path,
                                                                                       run_dir):
    """A launcher killed outright leaves its daemon: the next `u1serve up` in that run dir stops it first."""
    bin_dir = standin_bin(tmp_path)
    pipe, logs = os.path.join(run_dir, "mps", "pipe"), os.path.join(run_dir, "mps", "log")
    os.makedirs(pipe)
    subprocess.run([os.path.join(bin_dir, "nvidia-cuda-mps-control"), "-d"], check=True,
                   env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs})
    leftover = int(wait_until(lambda: _read(os.path.join(pipe, "nvidia-cuda-mps-control.pid")), 10))
    p = _up(*cpu_stack(tiny_checkpoint("u1"), run_dir), env=standin_env(bin_dir))
    output = _Output(p)
    try:
        assert wait_until(lambda: output.has("[u1serve] starting und") or p.poll() is not None, 120), output.text()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    out = output.text()
    assert f"stopping the MPS control daemon (pid {leftover}) left in {pipe}" in out, out
    assert not pid_alive(leftover)
    daemon = [c for c in calls(run_dir) if c["argv"] == ["-d"]]
    assert len(daemon) == 2, daemon                     # the leftover's and this run's
    ours = int(out.split("MPS control daemon running (pid ", 1)[1].split(";", 1)[0])
    assert out.index("received SIGTERM") < out.index(f"MPS control daemon (pid {ours}) stopped"), out
    assert not pid_alive(ours)
    assert out.rstrip().endswith("[u1serve] stopped"), out[-2000:]
    assert with_pipe_env(pipe) == [] and not os.path.exists(pipe)


def test_failing_start_stops_the_daemon_killing_one_that_ignores_quit(tiny_checkpoint, tmp_path, run_dir):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("u1"), broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            (broken / name).write_bytes(b"\0" * 16)
    pipe = os.path.join(run_dir, "mps", "pipe")
    p = _up(*cpu_stack(str(broken), run_dir), env=standin_env(standin_bin(tmp_path), MPS_STANDIN_IGNORE_QUIT="1"))
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 1, out
    failed = re.search(r"start-up failed: (und|gen) failed", out)   # the engines start together: either fails first
    assert failed, out
    daemon = int(out.split("MPS control daemon running (pid ", 1)[1].split(";", 1)[0])
    assert f"the MPS control daemon (pid {daemon}) did not quit within 10 s: killed it and its servers" in out, out
    assert out.index(f"{failed.group(1)} failed") < out.index("did not quit") < out.index("[u1serve] stopped"), out
    assert [c["clients_at_quit"] for c in calls(run_dir) if c.get("command") == "quit"] == [[]]
    assert not pid_alive(daemon) and with_pipe_env(pipe) == []


def test_a_daemon_that_does_not_start_shows_its_log_and_starts_no_service(config_model, tmp_path, run_dir):
    p = _up("--model", config_model, "--device", "cuda", "--und-gpus", "0", "--port", str(free_port()),
            "--run-dir", run_dir, "--gpu-sharing", "mps", env=standin_env(standin_bin(tmp_path), MPS_STANDIN_FAIL="1"))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert "start-up failed: the MPS control daemon did not start (nvidia-cuda-mps-control -d exited 1" in out, out
    assert "control.log" in out and "the stand-in was told to fail" in out, out      # the tail of its log
    assert "starting und" not in out and calls(run_dir)[0]["env"]["CUDA_VISIBLE_DEVICES"] == "0"


def test_no_mps_control_on_path_is_a_clear_error(config_model, tmp_path, run_dir):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    p = _up("--model", config_model, "--device", "cuda", "--und-gpus", "0", "--port", str(free_port()),
            "--run-dir", run_dir, "--gpu-sharing", "mps", env={"PATH": str(empty), "U1SERVE_MPS_ON_CPU": "1"})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert "--gpu-sharing mps needs nvidia-cuda-mps-control on PATH" in out and "driver" in out, out
    assert "starting und" not in out


def test_prohibited_gpu_is_refused_before_the_daemon_starts(config_model, tmp_path, run_dir):
    p = _up("--model", config_model, "--device", "cuda", "--und-gpus", "0", "--port", str(free_port()),
            "--run-dir", run_dir, "--gpu-sharing", "mps", env=standin_env(standin_bin(tmp_path, "0, Prohibited\n")))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert "GPU 0 is in compute mode Prohibited" in out and "starting und" not in out, out
    assert calls(run_dir) == []


def _port(p: subprocess.Popen) -> int:
    """The gateway port of a `u1serve up` started by _up (its --port)."""
    argv = p.args
    return int(argv[argv.index("--port") + 1])


@pytest.mark.parametrize("flags,env,says", [
    ([], {}, "GPU sharing time-slice (auto: MPS is opt-in"),         # even with the control binary on PATH
    (["--mode", "separate", "--gen-gpus", "1"], {}, ""),           # nothing shared: no QoS line, no daemon
    (["--und-replicas", "2", "--und-gpus", "0,1"], {}, "GPU sharing time-slice (auto: MPS is opt-in"),
    (["--gpu-sharing", "mps"], {}, "GPU sharing mps, generation at 50 % of the SMs, priority low; yield gate"),
    (["--gpu-sharing", "time-slice", "--qos-yield-share", "0"], {}, "GPU sharing time-slice; no yield gate"),
])
def test_auto_sharing_plans(config_model, tmp_path, flags, env, says):
    """What the dry run's colocate QoS line plans: --gpu-sharing auto time-slices (MPS is opt-in: its images came
    out NaN at the default SM cap on an H200) and says why; explicit flags choose."""
    r = dry_run(config_model, "--und-gpus", "0", *flags,
                env={**standin_env(standin_bin(tmp_path)), **env})
    assert r.returncode == 0, r.stderr
    assert says in r.stderr if says else "colocate QoS" not in r.stderr, r.stderr
    assert ("nvidia-cuda-mps-control -d" in r.stdout) == ("GPU sharing mps" in says), r.stdout
    gate = not {"--qos-yield-share", "separate", "--und-replicas"} & set(flags)      # the default gate's cases
    assert ("--yield-to" in r.stdout) == gate, r.stdout


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def test_gpu_smoke_and_bench_mps_profiles_plan_an_mps_stack(config_model):
    """deploy/gpu_smoke.py's and bench/stack.py's mps profiles dry-run to a daemon + capped generation;
    gpu_smoke runs them only when named (--profiles)."""
    from bench.stack import PROFILES as BENCH
    from bench import profile_stack
    mps = [n for n in profile_stack.ON_REQUEST if "-mps" in n]
    assert set(mps) == {"colocate-1-mps", "colocate-1-mps-normal", "colocate-tp2-cfg2-mps"}
    assert not set(profile_stack.profiles_for(8)) & set(profile_stack.ON_REQUEST)
    bench = [n for n in BENCH if "-mps" in n]
    assert "colocate-tp2-cfg2-mps-normal" in bench
    for name, flags in [(n, profile_stack.PROFILES[n][1]) for n in mps] + \
            [(n, BENCH[n].split()) for n in bench]:
        r = dry_run(config_model, *flags)
        assert r.returncode == 0, (flags, r.stderr)
        lines = _lines(r.stdout)
        assert "nvidia-cuda-mps-control -d" in lines["mps"] and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 " in lines["gen"]
        assert ("CUDA_MPS_CLIENT_PRIORITY=1 " in lines["gen"]) != name.endswith("-normal"), (name, lines["gen"])
