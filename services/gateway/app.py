"""The public OpenAI-compatible API: `create_app` wires the routers (chat, images, ops, the playground page) over
one GatewayState, behind the kit's request middleware (ids, access log, body limit, strict JSON, API key) and
admission."""
from __future__ import annotations

import contextlib

from fastapi import FastAPI

from services.kit import errors, live
from services.kit.middleware import ApiKeyAuth, ServiceMiddleware

from .admission import AdmissionMiddleware
from .config import GatewayConfig
from .drain import DrainMiddleware
from .openapi import install_openapi
from .routers import chat, images, ops, playground, rl, rl_weights
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
            await state.close()

    app = FastAPI(title="u1serve gateway", description=DESCRIPTION, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None)
    app.state.gateway = state
    errors.install(app, "gateway")
    for module in (chat, images, ops, rl, live, rl_weights):
        app.include_router(module.router)
    playground.install(app)
    install_openapi(app, cfg)
    # added last = outermost: ids, access log, limits and the API key first, then the shutdown drain, admission
    app.add_middleware(AdmissionMiddleware, gate=state.admission)
    app.add_middleware(DrainMiddleware, drain=state.drain)
    app.add_middleware(ServiceMiddleware, service="gateway", max_body_bytes=cfg.max_body_bytes,
                       auth=ApiKeyAuth(cfg.api_keys) if cfg.api_keys else None, unique_ids=True,
                       hooks=state.metrics)
    return app
