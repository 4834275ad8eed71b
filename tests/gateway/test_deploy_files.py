"""The deploy/ and docker/ files are consistent with the code (cheap static checks)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*p):
    with open(os.path.join(ROOT, *p)) as f:
        return f.read()


def test_shell_scripts_parse():
    for d in ("deploy", "docker", ".ci"):
        for name in os.listdir(os.path.join(ROOT, d)):
            path = os.path.join(ROOT, d, name)
            if name.endswith(".sh") or name == "run":
                subprocess.run(["bash", "-n", path], check=True)
                assert os.access(path, os.X_OK), f"{path} is not executable"


def test_compose_structure():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(read("docker", "compose.yaml"))
    svc = doc["services"]
    assert set(svc) == {"understanding", "generation", "gateway"}
    assert svc["understanding"]["ipc"] == "shareable" and "shm_size" in svc["understanding"]
    assert svc["generation"]["ipc"] == "service:understanding"
    for name in ("understanding", "generation"):
        assert "healthcheck" in svc[name]
        assert svc[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # the modules and flags the compose commands use exist
    assert "services.understanding.server" in svc["understanding"]["command"]
    assert "services.generation.server" in svc["generation"]["command"]
    assert "services.gateway.server" in svc["gateway"]["command"]
    for env in ("colocate.env", "separate.env"):
        keys = {l.split("=")[0] for l in read("docker", env).splitlines() if "=" in l and not l.startswith("#")}
        assert {"MODEL_DIR", "UND_GPUS", "GEN_GPUS", "INTERNAL_TOKEN_FILE"} <= keys
        assert "U1SERVE_INTERNAL_TOKEN" not in keys and "U1SERVE_API_KEY" not in keys


def test_compose_publishes_only_the_gateway():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(read("docker", "compose.yaml"))
    svc, nets = doc["services"], doc["networks"]
    assert nets["engines"]["internal"] is True and not (nets["public"] or {}).get("internal")
    for name in ("understanding", "generation"):
        assert svc[name]["networks"] == ["engines"] and "ports" not in svc[name]
    assert sorted(svc["gateway"]["networks"]) == ["engines", "public"] and svc["gateway"]["ports"]


def test_compose_secrets_are_files_and_the_gateway_healthcheck_needs_no_key():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(read("docker", "compose.yaml"))
    svc = doc["services"]
    assert set(doc["secrets"]) == {"internal_token", "api_key"}
    for name, s in svc.items():
        env = s["environment"]
        assert "U1SERVE_INTERNAL_TOKEN" not in env and "U1SERVE_API_KEY" not in env, name
        assert env["U1SERVE_INTERNAL_TOKEN_FILE"] == "/run/secrets/internal_token"
        assert "internal_token" in s["secrets"]
        assert "token" not in s["command"] and "api-key" not in s["command"], name
    assert svc["gateway"]["environment"]["U1SERVE_API_KEY_FILE"] == "/run/secrets/api_key"
    # /v1/* needs the API key when one is set; the probe must use an open path
    test = " ".join(svc["gateway"]["healthcheck"]["test"])
    assert "/health" in test and "/v1/" not in test


def test_entrypoint_reads_secret_files_into_the_environment(tmp_path):
    entry = os.path.join(ROOT, "docker", "entrypoint.sh")
    (tmp_path / "tok").write_text("tok-123\n")
    (tmp_path / "key").write_text("")
    env = {"PATH": os.environ["PATH"], "U1SERVE_INTERNAL_TOKEN_FILE": str(tmp_path / "tok"),
           "U1SERVE_API_KEY_FILE": str(tmp_path / "key")}
    r = subprocess.run([entry, "sh", "-c", 'echo "$U1SERVE_INTERNAL_TOKEN|${U1SERVE_API_KEY-unset}|'
                        '${U1SERVE_INTERNAL_TOKEN_FILE-gone}"'], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "tok-123|unset|gone", r.stderr
    (tmp_path / "tok").write_text("change-me-to-a-random-string\n")
    r = subprocess.run([entry, "true"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "internal token" in r.stderr
    r = subprocess.run([entry, "true"], env={**env, "U1SERVE_INTERNAL_TOKEN_FILE": str(tmp_path / "missing")},
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not readable" in r.stderr


def test_dockerfile_basics():
    text = read("docker", "Dockerfile")
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    assert '.[gpu]' in text
    assert "HEALTHCHECK" in text and "ENTRYPOINT [" in text
    for line in text.splitlines():
        if line.startswith(("CMD", "ENTRYPOINT")):
            assert line.split(None, 1)[1].startswith("["), "use JSON form: " + line


def test_gateway_flags_used_by_compose_exist():
    from services.gateway.config import build_arg_parser
    flags = {a for act in build_arg_parser()._actions for a in act.option_strings}
    cmd = read("docker", "compose.yaml")
    block = cmd[cmd.index("services.gateway.server"):]
    block = block[:block.index("depends_on")]
    for flag in re.findall(r"(--[a-z-]+)", block):
        assert flag in flags, flag
