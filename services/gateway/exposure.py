"""Who may reach the gateway, decided at start from its flags: the bind address (loopback unless --host, when no
API key is set), the paths behind the key (/v1/*, and /metrics, /docs, /openapi.json unless opened with
--public-metrics / --public-docs), CORS (none unless --allowed-origins), and for a gateway without a key a
Host / Origin check: a web page the user opens must not drive a keyless gateway on their machine, directly (a
cross-origin POST) or by DNS rebinding (a name of the attacker's that resolves to 127.0.0.1)."""
from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

from services.kit.errors import APIError

from .config import GatewayConfig
from .routing import is_address

LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/openapi.json")


def bind_host(cfg: GatewayConfig) -> str:
    """--host if given; else every interface with an API key, loopback without one."""
    return cfg.host or (WILDCARD if cfg.api_keys else LOOPBACK)


def exposure_note(cfg: GatewayConfig) -> str:
    """One line for the startup log: what is open to whom, and why."""
    host = bind_host(cfg)
    why = "--host" if cfg.host else ("API key set" if cfg.api_keys else "no API key: loopback only, pass --host to "
                                     "listen elsewhere")
    opened = [what for what, on in (("/metrics", cfg.public_metrics), ("/docs", cfg.public_docs)) if on]
    parts = [f"bound to {host} ({why})"]
    if cfg.api_keys:
        parts.append("key required on /v1/*" + ("" if cfg.public_metrics else ", /metrics")
                     + ("" if cfg.public_docs else ", /docs, /openapi.json"))
        if opened:
            parts.append("public: " + ", ".join(opened))
    else:
        parts.append("Host/Origin checked (loopback names, IP addresses"
                     + (f", {', '.join(cfg.allowed_hosts)}" if cfg.allowed_hosts else "") + ")")
    parts.append(f"CORS origins: {', '.join(cfg.allowed_origins)}" if cfg.allowed_origins else "no CORS")
    return "; ".join(parts)


def key_paths(cfg: GatewayConfig) -> tuple[str, ...]:
    """The paths an API key protects (prefixes end in '/')."""
    return ("/v1/",) + (() if cfg.public_metrics else ("/metrics",)) + (() if cfg.public_docs else DOCS_PATHS)


def _host_name(value: str) -> str:
    """'name:port' / '[::1]:port' -> the lower-case name without the port."""
    return (urlsplit("//" + value).hostname or "").lower()


class HostCheckMiddleware:
    """A keyless gateway answers only requests whose Host is an IP address (a rebinding attack needs a name),
    a loopback name, the bound host or one of --allowed-hosts ('*': any), and whose Origin, when a browser sends
    one, is the gateway's own or one of --allowed-origins. Else 403."""

    def __init__(self, app, *, cfg: GatewayConfig):
        self.app = app
        names = {"localhost", bind_host(cfg).lower()} | {h.lower() for h in cfg.allowed_hosts}
        self.any_host = "*" in names
        self.names = names
        self.origins = set(cfg.allowed_origins)

    def _host_ok(self, host: str) -> bool:
        name = _host_name(host)
        return not host or self.any_host or is_address(name) or name in self.names or name.endswith(".localhost")

    def _origin_ok(self, origin: Optional[str], host: str) -> bool:
        if origin is None or "*" in self.origins or origin in self.origins:
            return True
        return urlsplit(origin).netloc.lower() == host.lower()      # the gateway's own pages (the playground)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self._host_ok(host):
            err = APIError(403, f"Host {host[:100]!r} is not served by this gateway (it has no API key: only "
                                "loopback names and IP addresses, or --allowed-hosts)", code="host_not_allowed")
            return await err.response()(scope, receive, send)
        if not self._origin_ok(headers.get("origin"), host):
            err = APIError(403, "cross-origin requests are not allowed (this gateway has no API key; "
                                "--allowed-origins opens it to named origins)", code="origin_not_allowed")
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)
