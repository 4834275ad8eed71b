"""deploy/ray/kuberay renders (kustomize, as `kubectl apply -k` would); its RayService's serveConfigV2 is exactly
what `u1serve ray config` prints for the flags its comment names, and builds a valid application; the pod templates
pass the Kubernetes schema (kubernetes-validate, offline, strict) as Pods."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def rayservice(tmp_path_factory) -> dict:
    if not shutil.which("kubectl"):
        pytest.fail("kubectl is needed to render deploy/ray/kuberay (as for deploy/k8s)", pytrace=False)
    tree = tmp_path_factory.mktemp("kuberay") / "kuberay"
    shutil.copytree(ROOT / "deploy" / "ray" / "kuberay", tree)
    (tree / "secrets" / "internal-token").write_text("test-token\n")
    r = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert {d["kind"] for d in docs} == {"RayService", "Secret"}
    for d in docs:
        if d["kind"] == "Secret":
            kv.validate(d, K8S_VERSION, strict=True)
    return next(d for d in docs if d["kind"] == "RayService")


def documented_command() -> list[str]:
    """The `u1serve ray config ...` command in rayservice.yaml's comment."""
    text = (ROOT / "deploy" / "ray" / "kuberay" / "rayservice.yaml").read_text()
    block = re.search(r"#\s+(u1serve ray config .*?)\n# \(", text, re.S).group(1)
    return shlex.split(re.sub(r"\\\n#\s*", " ", block))


def test_serve_config_is_what_u1serve_ray_config_prints(rayservice):
    argv = documented_command()
    assert argv[:3] == ["u1serve", "ray", "config"]
    r = subprocess.run([sys.executable, "-m", "services.cli", *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == yaml.safe_load(r.stdout)


def test_the_application_args_are_valid_settings(rayservice):
    from services.ray_serve.settings import RayAppSettings
    app = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "services.ray_serve.app:app_builder"
    settings = RayAppSettings.from_dict(app["args"])
    assert settings.kv_transport == "nixl" and "U1SERVE_INTERNAL_TOKEN" not in settings.env   # from the Secret
    assert settings.gpus("und") == 1 and settings.gpus("gen") == 2      # whole groups, each on one node


def test_pods_pass_the_schema_and_carry_gpus_shm_and_the_token(rayservice):
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = cluster["workerGroupSpecs"]
    assert "u1serve_control" in head["rayStartParams"]["resources"]       # the gateway and registry go there
    for template in [head["template"]] + [g["template"] for g in groups]:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "u1serve-ray"}, "spec": template["spec"]}
        kv.validate(pod, K8S_VERSION, strict=True)
        for c in template["spec"]["containers"]:
            token = [e for e in c["env"] if e["name"] == "U1SERVE_INTERNAL_TOKEN"][0]
            assert token["valueFrom"]["secretKeyRef"]["name"] == "u1serve-ray-secrets"
    for g in groups:
        spec = g["template"]["spec"]
        c = spec["containers"][0]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(g["rayStartParams"]["num-gpus"])
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
