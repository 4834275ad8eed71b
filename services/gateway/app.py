"""The public OpenAI-compatible API: `create_app` wires the routers (chat, images, ops, the playground page) over
one GatewayState, behind (outermost first) CORS when opened, the kit's request middleware (ids, access log, API
key), the Host / Origin check of a keyless gateway, the shutdown drain, the probation of struck clients
(probation.py), admission and, innermost, the body rules
(bodies.py: size, media type, JSON budget, strict JSON parsed off the event loop)."""
from __future__ import annotations

import contextlib

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from services.kit import errors, live
from services.kit.bodies import BodyMiddleware
from services.kit.middleware import ApiKeyAuth, ServiceMiddleware

from .admission import ADMITTED_PATHS, AdmissionMiddleware
from .bodies import body_rules
from .config import GatewayConfig
from .drain import DrainMiddleware
from .exposure import HostCheckMiddleware, key_paths
from .openapi import install_openapi
from .probation import ProbationMiddleware
from .roles import RoleMiddleware
from .routers import chat, images, lora, ops, playground, responses, rl, rl_weights
from .state import GatewayState

DESCRIPTION = ("OpenAI-compatible chat and image API of u1serve (SenseNova-U1). Errors are "
               "`{\"error\": {message, type, param, code}}`; streams are SSE ending with `data: [DONE]`.")


def create_app(cfg: GatewayConfig) -> FastAPI:
    state = GatewayState.create(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await responses.shutdown(_app)
            await state.close()

    app = FastAPI(title="u1serve gateway", description=DESCRIPTION, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None)
    app.state.gateway = state
    errors.install(app, "gateway")
    for module in (chat, images, ops, rl, live, rl_weights, lora, responses):
        app.include_router(module.router)
    playground.install(app)
    install_openapi(app, cfg)
    # added last = outermost: no body byte is read before the key, the Host check, the drain and admission passed
    app.add_middleware(BodyMiddleware, rules=body_rules(cfg))
    app.add_middleware(AdmissionMiddleware, gate=state.admission)
    if cfg.strike_hold_s > 0:         # a client on probation gets its 429 before it takes an admission slot
        app.add_middleware(ProbationMiddleware, ledger=state.ledger, paths=ADMITTED_PATHS,
                           on_refused=state.metrics.probation_refused.inc)
    app.add_middleware(DrainMiddleware, drain=state.drain)
    if not cfg.api_keys:
        app.add_middleware(HostCheckMiddleware, cfg=cfg)
    app.add_middleware(RoleMiddleware, cfg=cfg)        # tenant / operator routes, opt-in features (roles.py)
    keys = cfg.api_keys + cfg.admin_api_keys
    app.add_middleware(ServiceMiddleware, service="gateway",
                       auth=ApiKeyAuth(keys, key_paths(cfg)) if keys else None, unique_ids=True,
                       hooks=state.metrics)
    if cfg.allowed_origins:       # outside the key check: a preflight carries no credentials
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)
    return app
