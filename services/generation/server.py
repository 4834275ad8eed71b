"""HTTP front of the generation service (FastAPI + uvicorn); the engine runs in its own process(es).

    U1SERVE_INTERNAL_TOKEN=... python -m services.generation.server --model DIR --host 127.0.0.1 --port 8200 \
        --device cpu --dtype float32 --cfg-parallel 1 --kv-pool-name NAME --max-batch-tokens 16384

Every route but /health needs the stack's internal token (--internal-token-file, U1SERVE_INTERNAL_TOKEN, or
--internal-token, which /proc shows to every local user).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from fastapi import FastAPI

from services.base import knobs
from services.kit import errors, live
from services.kit.config import read_secret
from services.kit.middleware import InternalTokenAuth, RequestIdFilter, ServiceMiddleware
from services.kit.streaming import guard

from .config import GenerationConfig, ServerConfig, add_config_flags, config_from_args, server_config_from_args
from .perf_options import add_perf_flags, cache_defaults
from .rank_options import check_rank_flags
from .routers import abort, generate, health, rl
from .state import GenerationState

log = logging.getLogger("u1serve.generation")
MAX_BODY_BYTES = rl.MAX_UPLOAD_BYTES   # a job body is parameters + a few handles (~1 KB each); RL trajectory uploads


def create_app(cfg: GenerationConfig, server: ServerConfig, args: argparse.Namespace, token: str,
               on_give_up=lambda why: None) -> FastAPI:
    """The app over one GenerationState (its lifespan starts the engine and stops it); `args`: the parsed flags
    of the HTTP side that are not in the configs (step-caching defaults)."""
    state = GenerationState.create(cfg, server, cache_defaults(args), on_give_up)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state.start()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="u1serve generation", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.generation = state
    errors.install(app, "generation")
    app.add_middleware(ServiceMiddleware, service="generation", max_body_bytes=MAX_BODY_BYTES,
                       auth=InternalTokenAuth(token))
    app.include_router(state.weights.router())
    app.include_router(live.router)    # /health/live: liveness, and the shm domain the gateway pairs replicas by
    for module in (health, generate, abort, rl):
        app.include_router(module.router)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="services.generation.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    add_perf_flags(p)
    return p


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for h in logging.getLogger().handlers:
        h.addFilter(RequestIdFilter())


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    cfg, server_cfg = config_from_args(args), server_config_from_args(args)
    check_rank_flags(cfg)
    token = read_secret(server_cfg.internal_token, server_cfg.internal_token_file, knobs.INTERNAL_TOKEN)
    if not token:
        raise SystemExit("the generation service needs the stack's internal token: --internal-token-file PATH "
                         "or U1SERVE_INTERNAL_TOKEN (u1serve up sets one)")
    _setup_logging(cfg.log_level)
    import uvicorn
    failed: list[str] = []

    def on_give_up(why: str) -> None:   # the engine cannot run: exit non-zero so a supervisor sees it
        failed.append(why)
        log.error("the generation engine is down for good; exiting with code 3")
        server.should_exit = True

    app = create_app(cfg, server_cfg, args, token, on_give_up)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):      # SIGTERM/SIGINT: end the streams first, then drain
            app.state.generation.engine.end_all()
            super().handle_exit(sig, frame)

    # uvicorn's own start-up lines only at debug: a healthy start logs one line (engine ready)
    uv_level = "warning" if cfg.log_level.lower() == "info" else cfg.log_level
    server = Server(uvicorn.Config(guard(app, args), host=server_cfg.host, port=server_cfg.port, log_level=uv_level,
                                   access_log=False, timeout_graceful_shutdown=10))
    server.run()
    if failed:
        sys.exit(3)


if __name__ == "__main__":
    main()
