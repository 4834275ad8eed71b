"""What a route needs from its request: the app state, the engine-facing request id, the prefix-cache salt."""
from __future__ import annotations

import hashlib
from typing import Optional

from fastapi import Request

from .state import GatewayState


def gateway(request: Request) -> GatewayState:
    """FastAPI dependency: the app's GatewayState."""
    return request.app.state.gateway


def request_id(request: Request) -> str:
    """The id the engines get (unique per request; starts with the client's x-request-id)."""
    return request.scope.get("state", {}).get("request_id", "-")


def cache_salt(request: Request, state: GatewayState, client_salt: Optional[str]) -> Optional[str]:
    """The prefix-cache salt sent to understanding: with --cache-salt-by-api-key a hash of the caller's API key
    (the middleware has checked it), so clients with different keys never share cache entries; else the
    client's own `cache_salt`."""
    if not state.config.cache_salt_by_api_key:
        return client_salt
    _, _, key = request.headers.get("authorization", "").strip().partition(" ")
    return "key-" + hashlib.sha256(b"u1serve-cache-salt\0" + key.strip().encode("latin-1")).hexdigest()[:32]
