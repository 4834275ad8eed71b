"""Tenants and the operator (issue 37; docs/deployment.md "Tenants and the operator").

A keyed gateway knows two kinds of key: tenant keys (--api-key / --api-key-file), which use the model, and
operator keys (--admin-api-key / --admin-api-key-file), which change what every tenant gets (a weight update,
an adapter load or unload). Each key works only on its own routes: a tenant key on an operator route is a
403 `operator_key_required`, an operator key on a tenant route a 403 `tenant_key_required` (as OpenAI's admin
keys: so the operator key is never a tenant's identity in a cache salt, a log or a stored object's owner). Read-
only routes (the model list, the weights version, /metrics, /docs) take either. A keyless gateway (loopback,
one user) has no roles.

Features that change what every tenant gets are off unless the operator turns them on: the RL routes
(--enable-rl) and runtime adapter loading (--enable-runtime-lora); a route that is off is a 404 that says which
flag turns it on. All of this is decided here, from the method, the path and the key, before any body byte is
read.
"""
from __future__ import annotations

import hmac
from typing import Optional

from services.kit.errors import APIError
from services.kit.middleware import bearer_key

from .config import GatewayConfig

OPERATOR = "operator"
TENANT = "tenant"
OPEN = "open"                         # a keyless gateway: one user, no roles

WEIGHT_ROUTES = frozenset({"/v1/rl/weights", "/v1/rl/weights/upload"})
LORA_ADMIN_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
OPERATOR_ROUTES = WEIGHT_ROUTES | LORA_ADMIN_ROUTES        # POSTs; a GET of /v1/rl/weights only reads
SHARED_PATHS = ("/v1/models", "/v1/rl/weights")            # read by either key (GET)
RL_PREFIX = "/v1/rl/"


def role_of(cfg: GatewayConfig, key: Optional[str]) -> str:
    """The role of an accepted key (compared with every operator key: the time does not tell which matched)."""
    if not cfg.api_keys:
        return OPEN
    given = (key or "").encode("latin-1")
    hits = sum(hmac.compare_digest(given, k.encode("utf-8")) for k in cfg.admin_api_keys)
    return OPERATOR if hits else TENANT


def refusal(cfg: GatewayConfig, method: str, path: str, role: str) -> Optional[APIError]:
    """Why `role` may not call `method path` (None: it may)."""
    if path.startswith(RL_PREFIX) and not cfg.enable_rl:
        return APIError(404, "the RL routes are off on this gateway (the operator starts it with --enable-rl)",
                        code="rl_disabled")
    if path in LORA_ADMIN_ROUTES and not cfg.enable_runtime_lora:
        return APIError(404, "runtime adapter loading is off on this gateway (the operator starts it with "
                        "--enable-runtime-lora)", code="runtime_lora_disabled")
    if role == OPEN or not path.startswith("/v1/"):
        return None
    operator_route = method == "POST" and path in OPERATOR_ROUTES
    if operator_route and role != OPERATOR:
        return APIError(403, "this route changes what every tenant gets: it needs the operator key "
                        "(--admin-api-key-file)", type="permission_error", code="operator_key_required")
    if not operator_route and role == OPERATOR and not (method == "GET" and path.startswith(SHARED_PATHS)):
        return APIError(403, "the operator key is for the admin routes (weights, adapters); use a tenant key "
                        "here", type="permission_error", code="tenant_key_required")
    return None


class RoleMiddleware:
    """Sets scope['state']['role'] and refuses what the role may not call (after the key check, before the body)."""

    def __init__(self, app, *, cfg: GatewayConfig):
        self.app = app
        self.cfg = cfg

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        role = role_of(self.cfg, bearer_key(scope))
        scope.setdefault("state", {})["role"] = role
        err = refusal(self.cfg, scope.get("method", "GET"), scope.get("path", ""), role)
        if err is not None:
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)
