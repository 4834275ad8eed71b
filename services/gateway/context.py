"""What a route needs from its request: the app state, the engine-facing request id, the prefix-cache salt, and
who the caller is (`caller_identity`: the owner of what it stores)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from fastapi import Request

from services.contract.rl import OPEN_OWNER
from services.kit.errors import APIError
from services.kit.middleware import bearer_key

from .roles import OPEN, OPERATOR, TENANT, role_of

from .state import GatewayState


def gateway(request: Request) -> GatewayState:
    """FastAPI dependency: the app's GatewayState."""
    return request.app.state.gateway


def request_id(request: Request) -> str:
    """The id the engines get (unique per request; starts with the client's x-request-id)."""
    return request.scope.get("state", {}).get("request_id", "-")


def cache_salt(request: Request, state: GatewayState, client_salt: Optional[str]) -> Optional[str]:
    """The prefix-cache salt sent to understanding. With API keys (unless --no-cache-salt-by-api-key) a hash of
    the key the middleware accepted (the one Authorization header: several are a 400), with the client's own
    salt inside it, so clients with different keys never share cache entries; else the client's `cache_salt`."""
    key = bearer_key(request.scope)
    if not state.config.cache_salt_by_api_key or key is None:
        return client_salt
    h = hashlib.sha256(b"u1serve-cache-salt\0" + key.encode("latin-1") + b"\0" + (client_salt or "").encode())
    return "key-" + h.hexdigest()[:32]


@dataclass(frozen=True)
class CallerIdentity:
    """Who made a request. `owner` names what the caller stores (trajectories, stored responses) and is what an
    engine is told: a hash of the tenant's key, never the key; "open" on a keyless gateway (one user)."""
    role: str            # roles.TENANT / roles.OPERATOR / roles.OPEN
    owner: str


def caller_identity(request: Request) -> CallerIdentity:
    """The identity a tenant route stores under and checks ownership against. The operator key is refused on
    tenant routes (roles.py) before any route runs; asked here all the same, it is a 403, never an owner."""
    key = bearer_key(request.scope)
    role = request.scope.get("state", {}).get("role") or role_of(request.app.state.gateway.config, key)
    if role == OPEN or key is None:
        return CallerIdentity(OPEN, OPEN_OWNER)
    if role == OPERATOR:
        raise APIError(403, "the operator key owns nothing here; use a tenant key", type="permission_error",
                       code="tenant_key_required")
    h = hashlib.sha256(b"u1serve-owner\0" + key.encode("latin-1")).hexdigest()[:32]
    return CallerIdentity(TENANT, "owner-" + h)
