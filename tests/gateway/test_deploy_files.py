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
    assert "ports" in svc["gateway"] and "ports" not in svc["understanding"]
    # the modules and flags the compose commands use exist
    assert "services.understanding.server" in svc["understanding"]["command"]
    assert "services.generation.server" in svc["generation"]["command"]
    assert "services.gateway.server" in svc["gateway"]["command"]
    for env in ("colocate.env", "separate.env"):
        keys = {l.split("=")[0] for l in read("docker", env).splitlines() if "=" in l and not l.startswith("#")}
        assert {"MODEL_DIR", "UND_GPUS", "GEN_GPUS", "U1SERVE_INTERNAL_TOKEN"} <= keys


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
