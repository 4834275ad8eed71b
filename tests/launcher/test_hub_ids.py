"""`--model <org>/<name>[@<revision>]` and `--lora-modules NAME=<org>/<name>`, offline: a huggingface_hub cache
prepared in the hub's own layout (models--org--name/snapshots/<sha>/..., refs/main), HF_HUB_OFFLINE=1. The
launcher's commands (`up --dry-run`), what stack.json records (the stack's info), /v1/models of a gateway told
the revision, and the errors for what is neither a directory nor resolvable."""
import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.system.stackproc import GatewayProc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHA = "0123456789abcdef0123456789abcdef01234567"
OLD_SHA = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def hub_cache(tiny_dir, tmp_path_factory):
    """HF_HUB_CACHE with org/tiny at two commits (main: SHA) and an adapter org/adapter."""
    cache = tmp_path_factory.mktemp("hf-hub")
    repo = cache / "models--org--tiny"
    for sha in (SHA, OLD_SHA):
        shutil.copytree(tiny_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    adapter = cache / "models--org--adapter"
    (adapter / "snapshots" / SHA).mkdir(parents=True)
    (adapter / "snapshots" / SHA / "adapter_model.safetensors").write_bytes(b"")
    (adapter / "refs").mkdir()
    (adapter / "refs" / "main").write_text(SHA)
    return str(cache)


def run(hub_cache: str, *argv: str, offline: bool = True, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_CACHE": hub_cache, "HF_HUB_DISABLE_TELEMETRY": "1", **extra_env}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def dry_run(hub_cache: str, model: str, *flags: str) -> subprocess.CompletedProcess:
    return run(hub_cache, "-m", "services.launch.cli", "up", "--model", model, "--device", "cpu", "--port", "9000",
               *flags, "--dry-run")


def lines(r: subprocess.CompletedProcess) -> dict[str, str]:
    assert r.returncode == 0, r.stderr
    return {ln.split(":", 1)[0]: ln for ln in r.stdout.splitlines() if ":" in ln}


@pytest.mark.parametrize("ref, sha", [("org/tiny", SHA), ("org/tiny@main", SHA), (f"org/tiny@{OLD_SHA}", OLD_SHA)])
def test_hub_id_resolves_from_the_cache(hub_cache, ref, sha):
    got = lines(dry_run(hub_cache, ref))
    snapshot = os.path.join(hub_cache, "models--org--tiny", "snapshots", sha)
    assert f"--model {snapshot}" in got["und"] and f"--model {snapshot}" in got["gen"]
    assert f"--model-hub-id org/tiny --model-revision {sha}" in got["gateway"]


@pytest.mark.parametrize("ref, sha", [("org/tiny", SHA), (f"org/tiny@{OLD_SHA}", OLD_SHA)])
def test_an_unreachable_hub_falls_back_on_the_cache(hub_cache, ref, sha):
    """Online, but the hub refuses connections (a closed port): the cached snapshot is used."""
    r = run(hub_cache, "-m", "services.launch.cli", "up", "--model", ref, "--device", "cpu", "--port", "9000", "--dry-run",
            offline=False, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    snapshot = os.path.join(hub_cache, "models--org--tiny", "snapshots", sha)
    assert f"--model {snapshot}" in lines(r)["und"]


def test_lora_module_by_hub_id(hub_cache):
    r = dry_run(hub_cache, "org/tiny", "--lora-modules", "style=org/adapter:0.5")
    snapshot = os.path.join(hub_cache, "models--org--adapter", "snapshots", SHA)
    assert f"style={snapshot}:0.5" in r.stdout, r.stdout + r.stderr


def test_stack_records_where_the_weights_came_from(hub_cache):
    code = ("import argparse, json, sys; from services.launch.cli import add_up; from services.launch.stack import build_stack; "
            "p = argparse.ArgumentParser(); add_up(p.add_subparsers()); "
            "args = p.parse_args(sys.argv[1:]); s = build_stack(args, dry_run=True); "
            "print(json.dumps({k: s.info[k] for k in ('model', 'lora_modules')}))")
    r = run(hub_cache, "-c", code, "up", "--model", "org/tiny", "--device", "cpu", "--port", "9000",
            "--lora-modules", "style=org/adapter")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["model"] == {"given": "org/tiny", "hub_id": "org/tiny", "revision": SHA,
                             "path": os.path.join(hub_cache, "models--org--tiny", "snapshots", SHA)}
    assert info["lora_modules"]["style"]["revision"] == SHA


@pytest.mark.parametrize("ref, words", [
    ("no-such-dir", "neither an existing directory nor a hub id"),
    ("org/missing", "HF_HUB_OFFLINE is set and the cache"),
    ("org/tiny@v9", "no snapshot of it at 'v9'"),
])
def test_unresolvable_ids_are_clear_errors(hub_cache, ref, words):
    r = dry_run(hub_cache, ref)
    assert r.returncode != 0 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_local_directory_wins(hub_cache, tmp_path, tiny_dir):
    """A directory spelled like a hub id (relative path org/tiny) is used as it is."""
    local = tmp_path / "org" / "tiny"
    shutil.copytree(tiny_dir, local)
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_CACHE": hub_cache, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "org/tiny", "--device", "cpu",
                        "--port", "9000", "--dry-run"], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    got = lines(r)
    assert f"--model {local}" in got["und"] and "--model-hub-id" not in got["gateway"]


def test_models_shows_the_revision(tmp_path):
    dead = "http://127.0.0.1:9"
    g = GatewayProc(dead, dead, "--model-hub-id", "org/tiny", "--model-revision", SHA, log_dir=str(tmp_path))
    try:
        g.wait_up()
        card = httpx.get(g.base + "/v1/models", timeout=10).json()["data"][0]
        assert card["root"] == "org/tiny" and card["revision"] == SHA
    finally:
        g.stop()
