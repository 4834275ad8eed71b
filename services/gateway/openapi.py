"""/openapi.json: FastAPI's schema of the routes, made exact for this server.

- pydantic writes the bounds of Optional[Int]/Optional[Float] fields (the contract's form-friendly numbers) as
  raw `ge`/`le`; they become JSON Schema's `minimum`/`maximum` (so Swagger and clients see them);
- the limits an operator tightened (--max-steps, --max-side, ...) replace the contract's;
- FastAPI's 422 entries go: a validation error here is a 400 with the OpenAI error shape.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .config import GatewayConfig

_STANDARD = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _walk(node: Any, visit) -> None:
    if isinstance(node, dict):
        visit(node)
        for value in node.values():
            _walk(value, visit)
    elif isinstance(node, list):
        for value in node:
            _walk(value, visit)


def _standard_bounds(node: dict) -> None:
    if node.get("type") in ("integer", "number"):
        for raw, std in _STANDARD.items():
            if raw in node:
                node[std] = node.pop(raw)


def _tighten(cfg: GatewayConfig):
    upper = {"num_inference_steps": ("maximum", cfg.max_steps), "max_think_tokens": ("maximum", cfg.max_think_tokens),
             "width": ("maximum", cfg.max_side), "height": ("maximum", cfg.max_side),
             "prompt": ("maxLength", cfg.max_prompt_chars)}
    lower = {"width": ("minimum", cfg.min_side), "height": ("minimum", cfg.min_side)}

    def visit(node: dict) -> None:
        for name, prop in (node.get("properties") or {}).items():
            for variant in [prop, *prop.get("anyOf", [])]:
                if name in upper and upper[name][0] in variant:
                    key, limit = upper[name]
                    variant[key] = min(variant[key], limit)
                if name in lower and lower[name][0] in variant:
                    key, limit = lower[name]
                    variant[key] = max(variant[key], limit)
    return visit


def _drop_422(schema: dict) -> None:
    for item in schema.get("paths", {}).values():
        for op in item.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)


def install_openapi(app: FastAPI, cfg: GatewayConfig) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes, tags=app.openapi_tags)
            _walk(schema, _standard_bounds)
            _walk(schema, _tighten(cfg))
            _drop_422(schema)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
