"""Who can reach a gateway, against real gateway processes (no engines needed): loopback unless --host when no
API key is set (and the startup line says so), every interface with a key; /metrics, /docs and /openapi.json behind
the key unless opened; no CORS unless --allowed-origins; a keyless gateway answers only its own Host names and
origins (DNS rebinding, a web page posting to localhost)."""
import socket

import httpx
import pytest

from services.base.netutil import free_port

from tests.system.stackproc import GatewayProc

from .conftest import API_KEY

GEN = "/v1/images/generations"


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def reachable(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """Three gateways: keyless on its default host; keyed on its default host with one CORS origin; keyed with
    /metrics and the docs opened."""
    d = tmp_path_factory.mktemp("exposure")
    keys = d / "keys"
    keys.write_text(API_KEY + "\n")
    started = {
        "keyless": GatewayProc(dead_url(), dead_url(), "--allowed-hosts", "gpu-box.lan", log_dir=str(d), host=None),
        "keyed": GatewayProc(dead_url(), dead_url(), "--api-key-file", str(keys), "--allowed-origins",
                             "https://app.example.com", log_dir=str(d), host=None),
        "public": GatewayProc(dead_url(), dead_url(), "--api-key-file", str(keys), "--public-metrics",
                              "--public-docs", log_dir=str(d))}
    for g in started.values():
        g.wait_up()
    yield started
    for g in started.values():
        assert "Traceback" not in g.stop()


def test_without_a_key_it_binds_loopback_and_says_so(procs):
    g = procs["keyless"]
    assert "bound to 127.0.0.1 (no API key: loopback only" in g.output()
    ip = other_address()
    if ip is not None:        # a machine with only loopback cannot show the difference; the log line still does
        assert not reachable(ip, g.port)


def test_with_a_key_it_binds_every_interface_and_protects_metrics_and_docs(procs):
    g = procs["keyed"]
    assert "bound to 0.0.0.0 (API key set)" in g.output()
    ip = other_address()
    if ip is not None:
        assert reachable(ip, g.port)
    key = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/metrics", "/docs", "/openapi.json"):
        r = httpx.get(g.base + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(g.base + path, headers=key, timeout=10).status_code == 200, path
    for path in ("/health/live", "/health"):          # probes stay open (503: no engines)
        assert httpx.get(g.base + path, timeout=10).status_code in (200, 503)


def test_public_metrics_and_docs_flags_open_them(procs):
    g = procs["public"]
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert httpx.get(g.base + path, timeout=10).status_code == 200, path
    assert httpx.get(g.base + "/v1/models", timeout=10).status_code == 401


def test_keyless_gateway_answers_only_its_own_host_names(procs):
    g = procs["keyless"]
    ok_hosts = [f"127.0.0.1:{g.port}", f"localhost:{g.port}", "localhost", f"[::1]:{g.port}", "10.1.2.3:80",
                f"app.localhost:{g.port}", "gpu-box.lan:8000"]
    for host in ok_hosts:
        assert httpx.get(g.base + "/v1/models", headers={"host": host}, timeout=10).status_code == 200, host
    # DNS rebinding: the attacker's name resolves to 127.0.0.1, the browser sends that name
    for host in ("evil.example.com", f"rebind.attacker.net:{g.port}", "localhost.evil.com", "other.lan"):
        r = httpx.get(g.base + "/v1/models", headers={"host": host}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host


def test_keyless_gateway_refuses_other_origins_and_has_no_cors(procs):
    g = procs["keyless"]
    body = {"prompt": "x", "size": "64x64"}
    r = httpx.post(g.base + GEN, json=body, headers={"origin": "https://evil.example.com"}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    # its own pages (the playground) post with their own origin: served (503: no engines behind it)
    r = httpx.post(g.base + GEN, json=body, headers={"origin": f"http://127.0.0.1:{g.port}"}, timeout=10)
    assert r.status_code == 503, r.text
    pre = httpx.options(g.base + GEN, headers={"origin": "https://evil.example.com",
                                               "access-control-request-method": "POST"}, timeout=10)
    assert "access-control-allow-origin" not in pre.headers


def test_allowed_origins_open_cors_to_those_origins_only(procs):
    g = procs["keyed"]
    pre = httpx.options(g.base + GEN, headers={"origin": "https://app.example.com",
                                               "access-control-request-method": "POST",
                                               "access-control-request-headers": "authorization, content-type"},
                        timeout=10)
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.get(g.base + "/v1/models", headers={"origin": "https://app.example.com",
                                                  "Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    r = httpx.get(g.base + "/v1/models", headers={"origin": "https://app.example.com"}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    other = httpx.options(g.base + GEN, headers={"origin": "https://evil.example.com",
                                                 "access-control-request-method": "POST"}, timeout=10)
    assert other.headers.get("access-control-allow-origin") != "https://evil.example.com"
