"""The application's settings and its autoscaling rule, without a cluster: what `u1serve ray config` prints, what
the settings refuse, and how many replicas the engines' load signals ask for."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.ray_serve.autoscale import EngineLoadPolicy, load_signals
from services.ray_serve.settings import RayAppSettings, Scaling

ROOT = Path(__file__).resolve().parents[2]


def config(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launch.cli", "ray", "config", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_config_is_a_serve_config_of_the_same_stack_flags():
    r = config("--gen-replicas", "1:4", "--", "--model", "tiny", "--device", "cpu", "--host", "127.0.0.1")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    app = cfg["applications"][0]
    assert app["import_path"] == "services.ray_serve.app:app_builder" and app["route_prefix"] == "/"
    s = RayAppSettings.from_dict(app["args"])
    assert s.stack_args == ["--model", "tiny", "--device", "cpu", "--host", "127.0.0.1"]
    assert (s.gen.min_replicas, s.gen.max_replicas) == (1, 4) and s.gpus("gen") == 0
    assert "U1SERVE_INTERNAL_TOKEN" not in s.env         # a config file never carries a generated secret


@pytest.mark.parametrize("argv, message", [
    (["--", "--model", "tiny", "--und-replicas", "2"], "replica counts are the deployments'"),
    (["--", "--model", "tiny", "--bogus"], "unrecognized arguments"),
    (["--gen-replicas", "3:1", "--", "--model", "tiny"], "MIN:MAX"),
    (["--", "--model", "tiny", "--device", "cuda", "--und-tp", "2"], "--mode colocate on Ray"),
])
def test_bad_settings_are_refused_before_anything_is_deployed(argv, message):
    r = config(*argv)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_gpu_groups_stay_whole():
    s = RayAppSettings(stack_args=["--model", "tiny", "--device", "cuda", "--mode", "separate", "--und-tp", "2",
                                   "--gen-cfg-parallel", "2", "--gen-sp", "2"])
    assert (s.gpus("und"), s.gpus("gen")) == (2, 4)
    one = RayAppSettings(stack_args=["--model", "tiny", "--device", "cuda"])     # colocate on one GPU
    assert (one.gpus("und"), one.gpus("gen")) == (0.5, 0.5)


def test_load_signals_from_engine_health_bodies():
    und = {"status": "ok", "running": 3, "waiting": 5, "kv_in_use": 10, "kv_total": 100, "shm_pages_used": 45,
           "shm_pages_total": 50}
    assert load_signals(und) == {"load": 8.0, "kv_use": 0.9}
    assert load_signals({"status": "ok", "queued": 2, "running": 1}) == {"load": 3.0, "kv_use": 0.0}
    assert load_signals({}) == {"load": 0.0, "kv_use": 0.0} == load_signals(None)


def test_policy_asks_for_the_target_load_per_replica_and_more_when_kv_is_full():
    p = EngineLoadPolicy(target_load=2.0, kv_high=0.8)
    assert p.desired(load=0, kv_use=0.1, current=3) == 1          # idle: down to one (Serve's min and delay apply)
    assert p.desired(load=7, kv_use=0.1, current=1) == 4          # ceil(7 / 2)
    assert p.desired(load=1, kv_use=0.85, current=2) == 3         # a nearly full KV pool asks for one more
    assert p.desired(load=0, kv_use=0.0, current=0) == 0


def test_scaling_bounds_are_checked():
    with pytest.raises(ValueError):
        Scaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        RayAppSettings(stack_args=["--model", "tiny"], kv_transport="tcp")
    with pytest.raises(ValueError, match="unknown setting"):
        RayAppSettings.from_dict({"stack_args": ["--model", "tiny"], "replicas": 3})


@pytest.mark.parametrize("argv, env, message", [
    (["--", "--model", "tiny", "--api-key", "sk-secret-in-config"], {}, "--api-key would put a secret"),
    (["--", "--model", "tiny", "--internal-token=tok"], {}, "--internal-token would put a secret"),
    (["--env", "U1SERVE_INTERNAL_TOKEN=tok", "--", "--model", "tiny"], {}, "runtime_env"),
    (["--env", "U1SERVE_API_KEY=sk-x", "--", "--model", "tiny"], {}, "runtime_env"),
    (["--", "--model", "tiny"], {"U1SERVE_API_KEY": "sk-from-the-shell"}, "U1SERVE_API_KEY is set"),
    (["--http-host", "0.0.0.0", "--", "--model", "tiny"], {}, "pass --api-key-file"),
])
def test_no_secret_goes_into_a_serve_config(argv, env, message):
    """`ray config` used to print U1SERVE_API_KEY into the config's env; a secret flag or --env would too."""
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", "ray", "config", *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env})
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert "sk-" not in r.stdout and "tok" not in r.stdout


def test_a_public_config_names_the_key_file_not_a_key():
    r = config("--http-host", "0.0.0.0", "--", "--model", "tiny", "--api-key-file", "/etc/u1serve/api-keys",
               "--internal-token-file", "/etc/u1serve/internal-token")
    assert r.returncode == 0, r.stderr
    s = RayAppSettings.from_dict(yaml.safe_load(r.stdout)["applications"][0]["args"])
    assert s.stack_args[-4:] == ["--api-key-file", "/etc/u1serve/api-keys",
                                 "--internal-token-file", "/etc/u1serve/internal-token"]
    assert s.env == {}


def test_ray_up_hands_the_token_over_as_a_private_file(tmp_path, monkeypatch):
    """What `ray up` deploys: the token in a 0600 file whose path is in the stack flags; the replicas'
    runtime_env (shown by the dashboard, logged by Ray) holds no secret."""
    import argparse

    from services.ray_serve.app import replica_options
    from services.ray_serve.command import add_arguments, settings_from_args
    monkeypatch.setenv("U1SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("U1SERVE_INTERNAL_TOKEN", "tok-from-the-shell")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["up", "--env", "UCX_TLS=tcp", "--", "--model", "tiny", "--device", "cpu"])
    s = settings_from_args(args)
    path = s.stack_args[s.stack_args.index("--internal-token-file") + 1]
    assert open(path).read().strip() == "tok-from-the-shell" and os.stat(path).st_mode & 0o077 == 0
    for kind in ("und", "gen"):
        env = replica_options(s, kind)["ray_actor_options"]["runtime_env"]
        assert env == {"env_vars": {"UCX_TLS": "tcp"}}
    assert "tok-from-the-shell" not in repr(s.to_dict())
    # a token file given by the operator (a Secret's mount) is used as it is
    args = p.parse_args(["up", "--", "--model", "tiny", "--internal-token-file", "/run/secrets/tok"])
    assert settings_from_args(args).stack_args.count("--internal-token-file") == 1
