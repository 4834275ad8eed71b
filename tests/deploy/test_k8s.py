"""deploy/k8s renders (kustomize, as `kubectl apply -k` would) and every object passes the Kubernetes schema
(kubernetes-validate, offline, strict: unknown fields are errors); the wiring the docs promise is there."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"          # the oldest Kubernetes these manifests are checked against
LAYOUTS = ("base", "overlays/paired")


def renderer() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if os.environ.get("CI"):
        pytest.fail("CI needs kubectl (or kustomize) to render deploy/k8s", pytrace=False)
    pytest.skip("neither kubectl nor kustomize is installed")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each layout rendered from a copy of deploy/k8s with throwaway secret files (the real ones are not in git)."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", tree)
    (tree / "base" / "secrets" / "internal-token").write_text("test-token\n")
    (tree / "base" / "secrets" / "api-keys").write_text("test-key\n")
    out = {}
    for layout in LAYOUTS:
        r = subprocess.run(renderer() + [str(tree / layout)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[layout] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def objects(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_object_passes_the_schema(rendered, layout):
    for doc in rendered[layout]:
        kv.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engines_have_gpus_probes_grace_and_a_memory_backed_shm(rendered, layout):
    docs = rendered[layout]
    for dep in objects(docs, "Deployment").values():
        spec = dep["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 30
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            assert c["readinessProbe"]["httpGet"]["path"] in ("/health", "/health/live")
            assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"   # never kills a loading engine
            if c["name"] in ("understanding", "generation"):
                assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
                if c["name"] == "generation":   # jobs in flight finish before SIGTERM (services/generation/drain.py)
                    hook = c["lifecycle"]["preStop"]["exec"]["command"]
                    assert hook[:3] == ["python", "-m", "services.generation.drain"]
                    assert float(hook[hook.index("--timeout-s") + 1]) < spec["terminationGracePeriodSeconds"]
                token = [e for e in c["env"] if e["name"] == "U1SERVE_INTERNAL_TOKEN"][0]
                assert token["valueFrom"]["secretKeyRef"]["name"] == "u1serve-secrets"
    secret = objects(docs, "Secret")["u1serve-secrets"]
    assert set(secret["data"]) == {"internal-token", "api-keys"}
    for name in ("u1-understanding", "u1-generation"):
        assert objects(docs, "Service")[name]["spec"]["clusterIP"] == "None"   # the gateway sees every pod


def test_paired_pods_share_shm_and_the_network_layout_uses_nixl(rendered):
    net = objects(rendered["base"], "Deployment")
    und = net["u1-understanding"]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-transport=nixl" in und["args"] and any(e["name"] == "POD_IP" for e in und["env"])
    assert {h["metadata"]["name"] for h in objects(rendered["base"], "HorizontalPodAutoscaler").values()} == {
        "u1-understanding", "u1-generation"}
    gen_hpa = objects(rendered["base"], "HorizontalPodAutoscaler")["u1-generation"]
    assert gen_hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "u1_gen_queue_depth"

    paired = objects(rendered["overlays/paired"], "Deployment")
    assert "u1-generation" not in paired
    pod = paired["u1-understanding"]["spec"]["template"]["spec"]
    cs = {c["name"]: c for c in pod["containers"]}
    assert set(cs) == {"understanding", "generation"}
    assert "--kv-transport=shm" in cs["understanding"]["args"]
    shm = {c: {m["name"] for m in cs[c]["volumeMounts"] if m["mountPath"] == "/dev/shm"} for c in cs}
    assert shm["understanding"] == shm["generation"]          # one /dev/shm: the pool is shared
    gen_svc = objects(rendered["overlays/paired"], "Service")["u1-generation"]
    assert gen_svc["spec"]["selector"]["app.kubernetes.io/component"] == "understanding"


PARSERS = {"services.understanding.server": ("services.understanding.server", "build_parser"),
           "services.generation.server": ("services.generation.server", "build_parser"),
           "services.gateway.server": ("services.gateway.config", "build_arg_parser")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_container_command_line_parses_with_its_service(rendered, layout):
    """The manifests' flags are the services' flags (a renamed or removed flag fails here, not at deploy time);
    the paired overlay patches args by list index, so this also catches a patch landing on the wrong flag."""
    import importlib
    seen = set()
    for dep in objects(rendered[layout], "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            module = c["command"][c["command"].index("-m") + 1]
            mod, factory = PARSERS[module]
            parser = getattr(importlib.import_module(mod), factory)()
            parser.exit_on_error = False
            try:
                parser.parse_args(c["args"])
            except (SystemExit, Exception) as e:   # argparse exits on unknown flags even with exit_on_error off
                pytest.fail(f"{layout}: {dep['metadata']['name']}/{c['name']}: {c['args']} -> {e!r}")
            seen.add(module)
    assert seen == set(PARSERS) if layout == "base" else seen <= set(PARSERS) and seen


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_gateway_sets_its_host_and_key_explicitly(rendered, layout):
    """A keyless gateway binds loopback only (docs/deployment.md, "Exposing u1serve to the internet"): the
    manifests name the address and the key file, so neither default decides what a cluster exposes."""
    gateways = [c for d in objects(rendered[layout], "Deployment").values()
                for c in d["spec"]["template"]["spec"]["containers"] if "services.gateway.server" in c["command"]]
    for c in gateways:
        assert "--host=0.0.0.0" in c["args"] and any(a.startswith("--api-key-file=") for a in c["args"]), c["args"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_network_policies_let_only_the_gateway_reach_the_engines(rendered, layout):
    """Only the gateway (and the engines' own KV handoff, and Prometheus for the HPAs) reaches an engine pod; only
    the ingress controller (and Prometheus) the gateway; a stranger pod in the namespace reaches neither."""
    from tests.deploy.netpol import reaches
    pols = list(objects(rendered[layout], "NetworkPolicy").values())
    labels = {c: {"app.kubernetes.io/name": "u1serve", "app.kubernetes.io/component": c}
              for c in ("understanding", "generation", "gateway")}
    engines = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
               for d in objects(rendered[layout], "Deployment").values()} - {"gateway"}
    ingress, monitoring = ({"kubernetes.io/metadata.name": n} for n in ("ingress-nginx", "monitoring"))
    stranger = {"app": "something-else"}
    for engine in engines:
        for port in (8100, 8200):
            assert reaches(pols, {}, labels["gateway"], labels[engine], port, same_ns=True)
            assert reaches(pols, monitoring, {}, labels[engine], port)
            assert not reaches(pols, {}, stranger, labels[engine], port, same_ns=True)
            assert not reaches(pols, ingress, {}, labels[engine], port)
        assert reaches(pols, {}, labels["understanding"], labels[engine], 5600, same_ns=True)   # KV handoff
        assert not reaches(pols, {}, labels["gateway"], labels[engine], 5600, same_ns=True)
    assert reaches(pols, ingress, {}, labels["gateway"], 8000)
    assert not reaches(pols, {}, stranger, labels["gateway"], 8000, same_ns=True)
    assert not reaches(pols, {"kubernetes.io/metadata.name": "default"}, stranger, labels["gateway"], 8000)
