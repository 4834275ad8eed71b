"""NetworkPolicy ingress evaluated as Kubernetes does, for the manifests' tests (deploy/k8s, deploy/ray/kuberay):
may a pod with these labels, in a namespace with these labels, open a TCP connection to that pod and port?
Covers what the manifests use: podSelector / namespaceSelector with matchLabels and `In` matchExpressions,
numbered TCP ports; every pod of a policy's own namespace is `same_ns`."""
from __future__ import annotations


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def reaches(policies: list[dict], src_ns: dict, src_pod: dict, dst_pod: dict, port: int,
            same_ns: bool = False) -> bool:
    """Whether a pod labelled src_pod, in a namespace labelled src_ns (the policies' own when same_ns), may open
    a TCP connection to dst_pod:port."""
    selecting = [p for p in policies if matches(p["spec"]["podSelector"], dst_pod)
                 and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True                                   # no policy selects it: open
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(q.get("protocol", "TCP") == "TCP" and q["port"] == port for q in ports):
                continue
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    ok = matches(peer["namespaceSelector"], src_ns) and matches(peer.get("podSelector", {}), src_pod)
                else:
                    ok = same_ns and matches(peer["podSelector"], src_pod)
                if ok:
                    return True
    return False
