"""Understanding service: FastAPI HTTP process + engine process(es) fed over ZMQ.

    python -m services.understanding.server --model DIR [--port 8100] [--device cpu|cuda] [--tp N] ...

Endpoints: /v1/chat/completions, /generate, /generate_stream, /v1/models, /health, /metrics and the
internal /internal/image_prefix, /internal/release, /internal/abort (docs/architecture.md). Every route but
/health needs the stack's internal token.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from fastapi import FastAPI

from services.base import knobs
from services.kit import errors, live
from services.kit.config import read_secret
from services.kit.middleware import InternalTokenAuth, RequestIdFilter, ServiceMiddleware
from services.kit.streaming import guard

from .config import ServerConfig, add_config_flags, config_from_args
from .routers import chat, internal, native, ops
from .state import AppState



def create_app(args: ServerConfig) -> FastAPI:
    state = AppState(args)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="u1serve understanding", lifespan=lifespan)
    app.state.u1 = state
    errors.install(app, "understanding")
    for r in (ops.router, chat.router, native.router, internal.router, live.router, state.weights.endpoint.router()):
        app.include_router(r)
    app.add_middleware(ServiceMiddleware, service="understanding", max_body_bytes=int(args.max_body_mb * (1 << 20)),
                       auth=InternalTokenAuth(args.internal_token))
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("services.understanding.server",
                                description="u1serve understanding service (chat, VQA, image prefixes)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(p)
    return p


def parse_args(argv=None) -> ServerConfig:
    """The config of the command line (the token read from its file or the environment, the nixl address
    resolved); a value the config refuses is a usage error that names the flag."""
    p = build_parser()
    args = p.parse_args(argv)
    token = read_secret(args.internal_token, args.internal_token_file, knobs.INTERNAL_TOKEN)
    if not token:
        p.error(f"an internal token is required: pass --internal-token-file PATH, set {knobs.INTERNAL_TOKEN.name}, or "
                "--internal-token (u1serve up makes one per stack)")
    advertise = args.kv_advertise_host or (advertise_host(args.host) if args.kv_transport == "nixl" else None)
    try:
        return config_from_args(args, internal_token=token, kv_advertise_host=advertise)
    except ValueError as e:
        p.error(str(e))


def advertise_host(bind_host: str) -> str:
    """The address consumers on other hosts reach this one by: the bind address unless it is a wildcard,
    else POD_IP (Kubernetes downward API), else this host's name resolved."""
    import socket
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def main(argv=None) -> None:
    import uvicorn
    args = parse_args(argv)
    _configure_logging(args.log_level)
    app = create_app(args)
    # the kit middleware writes the access log (sanitised, /health at debug); uvicorn's own stays off
    server = uvicorn.Server(uvicorn.Config(guard(app, args), host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False))
    state: AppState = app.state.u1
    state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.exit_error:
        print(f"understanding: the engine failed to start: {state.exit_error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
