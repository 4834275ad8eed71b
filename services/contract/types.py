"""Field types with the coercions an HTTP API wants: numbers from JSON or form strings, never from booleans."""
from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BeforeValidator, ConfigDict, Field

from . import limits as L


def _no_bool(kind: str):
    def check(v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"must be {kind}, not a boolean")
        if isinstance(v, str):
            v = v.strip()
        return v
    return check


Int = Annotated[int, BeforeValidator(_no_bool("an integer"))]
Float = Annotated[float, BeforeValidator(_no_bool("a number"))]

# A prefix-cache isolation domain, public and internal alike: only requests with the same salt share cached
# prefixes (None: the shared default domain).
CacheSalt = Annotated[Optional[str], Field(min_length=1, max_length=L.MAX_CACHE_SALT_CHARS,
                                           description="prefix-cache isolation: only requests with the same salt "
                                                       "share")]

# Public request models ignore unknown fields (clients send OpenAI fields we do not use); internal bodies forbid
# them. Neither accepts NaN or infinities.
PUBLIC = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
INTERNAL = ConfigDict(extra="forbid", allow_inf_nan=False)

__all__ = ["Int", "Float", "CacheSalt", "PUBLIC", "INTERNAL"]
