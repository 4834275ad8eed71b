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


COMPOSE = {"compose.yaml": ("colocate.env", "separate.env"), "compose.cpu.yaml": ("cpu.env",)}


def compose(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(read("docker", name))


def env_keys(name: str) -> set[str]:
    return {l.split("=")[0] for l in read("docker", name).splitlines() if "=" in l and not l.startswith("#")}


@pytest.mark.parametrize("name", COMPOSE)
def test_compose_structure(name):
    doc = compose(name)
    svc = doc["services"]
    assert set(svc) == {"understanding", "generation", "gateway"}
    # the KV pool's /dev/shm is a tmpfs volume both engines mount: it outlives an engine's restart (docker/smoke.sh
    # crashes understanding and generation must re-attach); one container's IPC namespace would not
    for engine in ("understanding", "generation"):
        assert "kv-shm:/dev/shm" in svc[engine]["volumes"] and "ipc" not in svc[engine], engine
        assert "healthcheck" in svc[engine] and svc[engine]["restart"] == "unless-stopped"
        assert "--kv-pool-name u1serve-kv" in svc[engine]["command"]
    opts = doc["volumes"]["kv-shm"]["driver_opts"]
    assert opts["type"] == "tmpfs" and "mode=1777" in opts["o"]
    gpu = name == "compose.yaml"
    for engine in ("understanding", "generation"):
        reserved = svc[engine].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        assert (reserved[0]["capabilities"] == ["gpu"]) if gpu else reserved is None
        assert ("--device cuda" if gpu else "--device cpu") in svc[engine]["command"]
    # the modules and flags the compose commands use exist
    assert "services.understanding.server" in svc["understanding"]["command"]
    assert "services.generation.server" in svc["generation"]["command"]
    assert "services.gateway.server" in svc["gateway"]["command"]
    for env in COMPOSE[name]:
        keys = env_keys(env)
        assert {"INTERNAL_TOKEN_FILE", "API_KEY_FILE", "ADMIN_API_KEY_FILE", "KV_SHM_SIZE"} <= keys
        assert not gpu or {"MODEL_DIR", "UND_GPUS", "GEN_GPUS"} <= keys
        assert "U1SERVE_INTERNAL_TOKEN" not in keys and "U1SERVE_API_KEY" not in keys


def test_cpu_compose_is_the_gpu_one_without_gpus():
    """compose.cpu.yaml is compose.yaml less the GPUs: the same services, networks, volume, secrets, health checks
    and commands but for the device, dtype, parallelism, sizes and the model's path."""
    import re
    gpu, cpu = compose("compose.yaml"), compose("compose.cpu.yaml")
    assert gpu["networks"] == cpu["networks"] and gpu["secrets"] == cpu["secrets"]
    assert gpu["volumes"].keys() == cpu["volumes"].keys()
    drop = re.compile(r"--(device|dtype|tp|cfg-parallel|kv-pool-gb|default-size|model) \S+|\s+")
    for name, g in gpu["services"].items():
        c = cpu["services"][name]
        for key in ("networks", "secrets", "restart", "depends_on", "ports"):
            assert g.get(key) == c.get(key) or key == "ports", (name, key)
        assert g["healthcheck"]["test"] == c["healthcheck"]["test"], name
        assert drop.sub("", g["command"]) == drop.sub("", c["command"]), name
        assert {k for k in g["environment"] if not k.endswith(("_DEVICES", "MEMORY_FRACTION"))} == \
            set(c["environment"]), name


@pytest.mark.parametrize("name", COMPOSE)
def test_compose_publishes_only_the_gateway(name):
    doc = compose(name)
    svc, nets = doc["services"], doc["networks"]
    assert nets["engines"]["internal"] is True and not (nets["public"] or {}).get("internal")
    # no address of the host on the engines' bridge: the host cannot reach them either (docker/smoke.sh checks)
    assert nets["engines"]["driver_opts"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    for engine in ("understanding", "generation"):
        assert svc[engine]["networks"] == ["engines"] and "ports" not in svc[engine]
        assert "--host 0.0.0.0" in svc[engine]["command"]
    assert sorted(svc["gateway"]["networks"]) == ["engines", "public"] and svc["gateway"]["ports"]
    assert "--host 0.0.0.0" in svc["gateway"]["command"]   # explicit: the gateway's default is loopback without a key


@pytest.mark.parametrize("name", COMPOSE)
def test_compose_secrets_are_files_and_the_gateway_healthcheck_needs_no_key(name):
    doc = compose(name)
    svc = doc["services"]
    assert set(doc["secrets"]) == {"internal_token", "api_key", "admin_api_key"}
    # both files are required: no default that leaves the public API open
    assert all(":?" in s["file"] for s in doc["secrets"].values())
    for service, s in svc.items():
        env = s["environment"]
        assert "U1SERVE_INTERNAL_TOKEN" not in env and "U1SERVE_API_KEY" not in env, service
        assert env["U1SERVE_INTERNAL_TOKEN_FILE"] == "/run/secrets/internal_token"
        assert "internal_token" in s["secrets"]
        assert "token" not in s["command"] and "api-key" not in s["command"], service
    # the tenants' and the operators' key files, checked by the entrypoint and handed to the gateway as paths
    gateway = svc["gateway"]
    assert gateway["environment"]["U1SERVE_API_KEY_FILE"] == "/run/secrets/api_key"
    assert gateway["environment"]["U1SERVE_ADMIN_API_KEY_FILE"] == "/run/secrets/admin_api_key"
    assert {"api_key", "admin_api_key"} <= set(gateway["secrets"])
    assert all("api_key" not in s["secrets"] for name, s in svc.items() if name != "gateway")
    # /v1/* needs the API key when one is set; the probe must use an open path
    test = " ".join(svc["gateway"]["healthcheck"]["test"])
    assert "/health" in test and "/v1/" not in test


def test_dockerfile_basics():
    text = read("docker", "Dockerfile")
    # one file, the base a build argument: the CUDA runtime by default, a local Debian base for the CPU build
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+", text, re.M) and re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert '["optional-dependencies"]["gpu"]' in text and "tiny-checkpoint" in text
    assert "HEALTHCHECK" in text and "ENTRYPOINT [" in text and re.search(r"^USER 10001$", text, re.M)
    for line in text.splitlines():
        if line.startswith(("CMD", "ENTRYPOINT")):
            assert line.split(None, 1)[1].startswith("["), "use JSON form: " + line
    # the pip configuration and the local wheels are mounted into the RUNs, never copied into a layer
    assert "--mount=type=secret,id=pip.conf" in text and "--mount=type=bind,source=docker/wheels" in text
    assert not re.search(r"^(COPY|ADD) .*(pip|wheels|secrets)", text, re.M)
    ignore = read(".dockerignore").splitlines()
    assert ignore[1:2] == ["*"] or "*" in ignore, "the build context is an allow-list"


def test_gateway_flags_used_by_compose_exist():
    from services.gateway.config import build_arg_parser
    flags = {a for act in build_arg_parser()._actions for a in act.option_strings}
    cmd = read("docker", "compose.yaml") + read("docker", "compose.cpu.yaml")
    block = cmd[cmd.index("services.gateway.server"):]
    block = block[:block.index("depends_on")]
    for flag in re.findall(r"(--[a-z-]+)", block):
        assert flag in flags, flag
