"""What a route needs from its request: the app state, the engine-facing request id, the prefix-cache salt."""
from __future__ import annotations

import hashlib
from typing import Optional

from fastapi import Request

from services.kit.middleware import bearer_key

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
