"""The body rule of each gateway route, in one table: size limit, media types, JSON element budget (enforced
by kit.bodies before the body is parsed, after authentication and admission). A route not listed gets
DEFAULT_BODY. A route with other needs declares its line here (as the RL routes do: a binary upload, a
trajectory sent back as base64). Operators change a route's limit with `--route-body-mb PATH=MB`; `--max-body-mb` caps every route."""
from __future__ import annotations

import dataclasses

from services.contract.rl import MAX_SCORE_BODY_BYTES
from services.kit.bodies import JSON, MULTIPART, BodyRule, BodyRules

from .config import GatewayConfig
from .weights_upload import UPLOAD_MAX_BYTES

MiB = 1024 * 1024
OCTETS = "application/octet-stream"

ROUTE_BODIES: dict[str, BodyRule] = {
    "/v1/chat/completions": BodyRule(32 * MiB),                         # images as data URLs
    "/v1/images/edits": BodyRule(32 * MiB, media_types=(JSON, MULTIPART)),   # up to 4 input images
    "/v1/images/generations": BodyRule(1 * MiB),                        # a prompt and options
    "/v1/responses": BodyRule(32 * MiB),                                # input images as data URLs
    "/v1/responses/*/cancel": BodyRule(1 * MiB, media_types=None, optional=True),   # no body (the SDK sends none)
    "/v1/rl/rollout": BodyRule(256 * MiB),                 # up to 64 prompts, each with its edit input images
    "/v1/rl/score": BodyRule(MAX_SCORE_BODY_BYTES),        # the rollout again, maybe with a trajectory generation
                                                           # takes (base64 of at most MAX_TRAJECTORY_UPLOAD_BYTES)
    "/v1/rl/weights/upload": BodyRule(UPLOAD_MAX_BYTES, media_types=(OCTETS,)),   # a safetensors file
}
DEFAULT_BODY = BodyRule(1 * MiB)


def body_rules(cfg: GatewayConfig) -> BodyRules:
    """The table with the operator's per-route limits and cap applied."""
    def sized(path: str, rule: BodyRule) -> BodyRule:
        limit = cfg.route_body_bytes.get(path, rule.max_bytes)
        if cfg.max_body_bytes is not None:
            limit = min(limit, cfg.max_body_bytes)
        return dataclasses.replace(rule, max_bytes=limit)
    routes = {path: sized(path, rule) for path, rule in ROUTE_BODIES.items()}
    routes.update({path: sized(path, DEFAULT_BODY) for path in cfg.route_body_bytes if path not in routes})
    return BodyRules(sized("", DEFAULT_BODY), routes)
