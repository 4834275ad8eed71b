"""deploy/ray/kuberay renders (kustomize, as `kubectl apply -k` would); its RayService's serveConfigV2 is exactly
what `u1serve ray config` prints for the flags its comment names, and builds a valid application; the pod templates
pass the Kubernetes schema (kubernetes-validate, offline, strict) as Pods; the secrets are files of a Secret (the
Serve config names paths, no pod has a secret in its environment), Ray's token auth is on, and the NetworkPolicies,
evaluated here as Kubernetes does, let only the ingress reach the API, only the operator the dashboard, and only
the application's own Ray pods the engines."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.netpol import reaches

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"
SECRET_FILES = ("internal-token", "api-keys", "admin-api-keys")


@pytest.fixture(scope="module")
def rayservice(tmp_path_factory) -> dict:
    if not shutil.which("kubectl"):
        pytest.fail("kubectl is needed to render deploy/ray/kuberay (as for deploy/k8s)", pytrace=False)
    tree = tmp_path_factory.mktemp("kuberay") / "kuberay"
    shutil.copytree(ROOT / "deploy" / "ray" / "kuberay", tree)
    for name in SECRET_FILES:
        (tree / "secrets" / name).write_text(f"test-{name}\n")
    r = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert {d["kind"] for d in docs} == {"RayService", "Secret", "NetworkPolicy"}
    for d in docs:
        if d["kind"] in ("Secret", "NetworkPolicy"):
            kv.validate(d, K8S_VERSION, strict=True)
    return {"service": next(d for d in docs if d["kind"] == "RayService"),
            "secret": next(d for d in docs if d["kind"] == "Secret"),
            "policies": [d for d in docs if d["kind"] == "NetworkPolicy"]}


def documented_command() -> list[str]:
    """The `u1serve ray config ...` command in rayservice.yaml's comment."""
    text = (ROOT / "deploy" / "ray" / "kuberay" / "rayservice.yaml").read_text()
    block = re.search(r"#\s+(u1serve ray config .*?)\n# \(", text, re.S).group(1)
    return shlex.split(re.sub(r"\\\n#\s*", " ", block))


def test_serve_config_is_what_u1serve_ray_config_prints(rayservice):
    argv = documented_command()
    assert argv[:3] == ["u1serve", "ray", "config"]
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(rayservice["service"]["spec"]["serveConfigV2"]) == yaml.safe_load(r.stdout)


def test_the_application_args_are_valid_settings(rayservice):
    from services.ray_serve.settings import RayAppSettings
    app = yaml.safe_load(rayservice["service"]["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "services.ray_serve.app:app_builder"
    settings = RayAppSettings.from_dict(app["args"])
    assert settings.kv_transport == "nixl" and "U1SERVE_INTERNAL_TOKEN" not in settings.env   # from the Secret
    assert settings.gpus("und") == 1 and settings.gpus("gen") == 2      # whole groups, each on one node


def test_pods_pass_the_schema_and_carry_gpus_shm_and_the_token(rayservice):
    cluster = rayservice["service"]["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = cluster["workerGroupSpecs"]
    assert "u1serve_control" in head["rayStartParams"]["resources"]       # the gateway and registry go there
    for template in [head["template"]] + [g["template"] for g in groups]:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "u1serve-ray"}, "spec": template["spec"]}
        kv.validate(pod, K8S_VERSION, strict=True)
    for g in groups:
        spec = g["template"]["spec"]
        c = spec["containers"][0]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(g["rayStartParams"]["num-gpus"])
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def pod_templates(rayservice) -> list[dict]:
    cluster = rayservice["service"]["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_secrets_are_mounted_files_named_by_the_config_and_in_no_environment(rayservice):
    assert set(rayservice["secret"]["data"]) == set(SECRET_FILES)
    for template in pod_templates(rayservice):
        spec = template["spec"]
        secret_vols = {v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") ==
                       "u1serve-ray-secrets"}
        for c in spec["containers"]:
            assert not [e for e in c.get("env", []) if "secretKeyRef" in str(e) or e["name"].startswith("U1SERVE_")]
            mounts = [m for m in c["volumeMounts"] if m["name"] in secret_vols]
            assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [("/etc/u1serve", True)]
    app = yaml.safe_load(rayservice["service"]["spec"]["serveConfigV2"])["applications"][0]
    args = app["args"]["stack_args"]
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert flag["--api-key-file"] == "/etc/u1serve/api-keys"                       # a keyed public API
    assert flag["--internal-token-file"] == "/etc/u1serve/internal-token"
    assert flag["--admin-api-key-file"] == "/etc/u1serve/admin-api-keys"          # the operators' (issue 37)
    assert app["args"]["env"] == {}


def test_ray_token_auth_is_on_and_the_dashboard_is_only_the_operators(rayservice):
    cluster = rayservice["service"]["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")[:2]) >= (2, 52)     # token auth's first Ray
    params = cluster["headGroupSpec"]["rayStartParams"]
    if params.get("include-dashboard") != "false" and params.get("dashboard-host") != "127.0.0.1":
        head = {"app.kubernetes.io/name": "u1serve", "app.kubernetes.io/component": "ray-head"}
        assert reaches(rayservice["policies"], {"kubernetes.io/metadata.name": "kuberay-system"}, {}, head, 8265)
        for ns in ("ingress-nginx", "default", "other"):
            assert not reaches(rayservice["policies"], {"kubernetes.io/metadata.name": ns}, {"app": "x"}, head, 8265)


def test_network_policies_isolate_the_engines_and_the_api(rayservice):
    pols = rayservice["policies"]
    head = {"app.kubernetes.io/name": "u1serve", "app.kubernetes.io/component": "ray-head"}
    worker = {"app.kubernetes.io/name": "u1serve", "app.kubernetes.io/component": "ray-gpu-worker"}
    assert {tuple(sorted(t["metadata"]["labels"].items())) for t in pod_templates(rayservice)} == \
        {tuple(sorted(head.items())), tuple(sorted(worker.items()))}
    ingress = {"kubernetes.io/metadata.name": "ingress-nginx"}
    stranger = {"app": "something-else"}
    engine_port = 43123                                # engines bind on a port their node picks
    # the public API: the ingress controller, nobody else from outside the Ray cluster
    assert reaches(pols, ingress, {}, head, 8000)
    assert not reaches(pols, {"kubernetes.io/metadata.name": "default"}, stranger, head, 8000)
    assert not reaches(pols, {}, stranger, head, 8000, same_ns=True)
    # the engines (GPU workers): the gateway on the head and the other Ray pods (Ray, NIXL), nobody else
    assert reaches(pols, {}, head, worker, engine_port, same_ns=True)
    assert reaches(pols, {}, worker, worker, engine_port, same_ns=True)
    for src_ns, src, same in ((ingress, {}, False), ({}, stranger, True),
                              ({"kubernetes.io/metadata.name": "kuberay-system"}, {}, False)):
        assert not reaches(pols, src_ns, src, worker, engine_port, same_ns=same)
        assert not reaches(pols, src_ns, src, head, 6379, same_ns=same)          # the GCS
