"""One `/internal/generate` body -> a validated `GenerateRequest` (services.contract.image) with the server's
step-caching defaults applied, plus the invariants only this engine can check: every handle parses as a KVHandle
and was produced by the model it serves.

The `GenerateRequest` itself is the job spec that crosses to the rank processes (pickled through the link).
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from services.contract.image import CacheOptions, GenerateRequest, check_cache_for
from services.kit.errors import APIError, bad_request, from_validation


def parse_job(body: Any, cache_defaults: Optional[CacheOptions] = None) -> GenerateRequest:
    """Validate a body (400 naming the field) and fill `cache` from the server's defaults."""
    try:
        job = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None
    defaults = cache_defaults or CacheOptions()
    job.cache = job.cache.over(defaults) if job.cache is not None else defaults
    try:
        check_cache_for(job.mode, job.cfg_interval, job.cache)
    except ValueError as exc:
        raise bad_request(f"cache: {exc}", param="cache") from None
    return job


def check_handles(job: GenerateRequest, fingerprint: Optional[str]) -> None:
    """400 `kv_fingerprint_mismatch` for another model's handles, `kv_malformed_handle` for one that does not
    parse (before the stream starts)."""
    from .kv_source import PrefixSource
    for branch, h in job.handles.items():
        theirs = h.get("model_fingerprint")
        if fingerprint and theirs is not None and theirs != fingerprint:
            raise APIError(400, f"handle '{branch}' was produced by a different model (fingerprint {theirs!r}, "
                           f"this service serves {fingerprint!r})", param=f"handles.{branch}",
                           code="kv_fingerprint_mismatch")
        PrefixSource.parse(h)


def handles_of(body: Any) -> list[dict]:
    """The handle dicts of a body, valid or not (to free them when the request is rejected)."""
    handles = body.get("handles") if isinstance(body, dict) else None
    if not isinstance(handles, dict):
        return []
    return [h for h in handles.values() if isinstance(h, dict)]


def busiest_rank_tokens(job: GenerateRequest, world: int, sp: int = 1) -> int:
    """Image tokens this job adds to every forward on the rank holding most of its branches (`world` CFG
    ranks; with `sp` sequence-parallel ranks each holds at most ceil(N / sp) tokens of a segment)."""
    return -(-job.num_tokens // sp) * job.n * -(-len(job.handles) // world)
