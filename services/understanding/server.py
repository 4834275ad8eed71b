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

from services.contract import limits as CL
from services.kit import errors, live
from services import knobs
from services.kit.config import read_secret
from services.kit.middleware import InternalTokenAuth, RequestIdFilter, ServiceMiddleware
from services.kit.streaming import add_stream_flags, guard
from services.model import images as IM

from .config import add_engine_flags
from .image_inputs import ImageBudget
from .routers import chat, internal, native, ops
from .state import AppState



def create_app(args) -> FastAPI:
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
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    add_engine_flags(p)
    p.add_argument("--kv-pool-owner", default=knobs.STACK_ID.get(),
                   help="the stack id recorded in the pool segment as its owner: only that stack's launcher removes "
                        f"it (shm_transfer/segment.py; env {knobs.STACK_ID.name}, set by u1serve up)")
    p.add_argument("--kv-pool-gb", type=float, default=4.0, help="size of the shared-memory KV pool")
    p.add_argument("--kv-transport", choices=["shm", "nixl", "device"], default="shm",
                   help="how generation reads the prefixes: shm (same host) or nixl (over the network with NIXL; "
                        "a consumer that shares this host's /dev/shm still uses shared memory) or device (the pages "
                        "on --device, for a generation engine in this same process: fused colocate)")
    p.add_argument("--kv-listen-port", type=int, default=0,
                   help="nixl: port of the transport's metadata listener (0: a free one)")
    p.add_argument("--kv-advertise-host", default=None,
                   help="nixl: the address generation services reach this host by (default: --host unless it "
                        "is a wildcard, else this host's name resolved; env POD_IP in Kubernetes)")
    p.add_argument("--kv-page-tokens", type=int, default=64, help="tokens per shared-memory pool page")
    p.add_argument("--kv-lease-s", type=float, default=300.0,
                   help="lease of exported prefix pages (reclaimed after it if nobody releases them)")
    p.add_argument("--max-prefix-pool-share", type=float, default=0.5,
                   help="largest share of the KV pool one image-prefix request may reserve (larger: 400)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests that may wait beyond the running ones; more get 429 (default: "
                        "max(16, KV cache tokens / 256))")
    p.add_argument("--engine-max-failures", type=int, default=5,
                   help="engine deaths within --engine-failure-window-s after which it is not restarted")
    p.add_argument("--engine-failure-window-s", type=float, default=600.0)
    p.add_argument("--internal-token", default=None,
                   help=f"the token every route but /health requires (or --internal-token-file, or env {knobs.INTERNAL_TOKEN.name})")
    p.add_argument("--internal-token-file", default=None, help="file whose first line is the internal token")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--image-min-pixels", type=int, default=IM.VQA_MIN_PIXELS, help="chat images are resized to >= this")
    p.add_argument("--image-max-pixels", type=int, default=IM.VQA_MAX_PIXELS, help="chat images are resized to <= this")
    b = ImageBudget()
    p.add_argument("--max-image-bytes", type=int, default=b.max_image_bytes, help="encoded size of one image")
    p.add_argument("--max-images-per-request", type=int, default=b.max_images)
    p.add_argument("--max-source-pixels-per-image", type=int, default=b.max_pixels_per_image,
                   help="largest input image (width x height, read from its header before decoding)")
    p.add_argument("--max-source-pixels-per-request", type=int, default=b.max_pixels_per_request,
                   help="all input images of one request together (header sizes)")
    p.add_argument("--image-decode-threads", type=int, default=2,
                   help="images decoded (and prompts built) at once, over all requests")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="request bodies above this get 413")
    p.add_argument("--max-think-tokens", type=int, default=CL.MAX_THINK_TOKENS, help="upper bound for max_think_tokens")
    add_stream_flags(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.engine_unit == "thread" and args.tp != 1:
        p.error("--engine-unit thread runs one engine rank: it needs --tp 1")
    if not 0 < args.max_prefix_pool_share <= 1:
        p.error("--max-prefix-pool-share must be in (0, 1]")
    args.internal_token = read_secret(args.internal_token, args.internal_token_file, knobs.INTERNAL_TOKEN)
    if not args.internal_token:
        p.error(f"an internal token is required: pass --internal-token-file PATH, set {knobs.INTERNAL_TOKEN.name}, or "
                "--internal-token (u1serve up makes one per stack)")
    args.max_model_len = min(args.max_model_len, args.kv_cache_tokens)
    if args.kv_transport == "nixl":
        if not args.kv_pool_name:
            p.error("--kv-transport nixl needs --kv-pool-name (the pool it serves)")
        args.kv_advertise_host = args.kv_advertise_host or advertise_host(args.host)
    return args


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
