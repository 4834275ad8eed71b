"""`python -m services.gateway.server`: run the gateway under uvicorn."""
from __future__ import annotations

import logging
import sys

import uvicorn

from services.kit.middleware import RequestIdFilter

from .app import create_app
from .config import build_arg_parser, config_from_args


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s gateway [%(request_id)s] %(message)s"))
    root = logging.getLogger("u1serve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    cfg = config_from_args(args)
    setup_logging(args.log_level)
    logging.getLogger("u1serve.gateway").info(
        "gateway on %s:%d -> understanding %s, generation %s (API key %s)", args.host, args.port, cfg.und_urls,
        cfg.gen_urls, f"on, {len(cfg.api_keys)} key(s)" if cfg.api_keys else "off")
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
