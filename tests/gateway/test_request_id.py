"""x-request-id on every gateway response, also on an unexpected 500 (answered outside the middleware
by Starlette otherwise); the engines get a per-request id that starts with the client's."""
from fastapi import Request
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig


def _app():
    app = create_app(GatewayConfig())
    seen = []

    @app.get("/boom")
    async def boom():
        raise RuntimeError("bug")

    @app.get("/rid")
    async def rid(request: Request):
        seen.append(request.scope["state"]["request_id"])
        return {}

    return app, seen


def test_unexpected_error_keeps_the_request_id_and_openai_shape():
    app, _ = _app()
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:   # loopback Host (keyless)
        r = c.get("/boom", headers={"x-request-id": "trace-500"})
        assert r.status_code == 500
        assert r.headers["x-request-id"] == "trace-500"
        assert r.json()["error"]["code"] == "internal_error"
        r = c.get("/boom")
        assert r.status_code == 500 and r.headers["x-request-id"].startswith("req-")


def test_engine_facing_id_is_unique_per_request():
    app, seen = _app()
    with TestClient(app, base_url="http://127.0.0.1") as c:   # a keyless gateway answers loopback Hosts
        for _ in range(2):
            assert c.get("/rid", headers={"x-request-id": "client-7"}).headers["x-request-id"] \
                == "client-7"
        r = c.get("/rid")
    assert seen[0] != seen[1] and all(s.startswith("client-7.") for s in seen[:2])
    assert seen[2] == r.headers["x-request-id"]
