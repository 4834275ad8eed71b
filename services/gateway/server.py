"""`python -m services.gateway.server`: run the gateway under uvicorn."""
from __future__ import annotations

import logging
import sys

import uvicorn

from services.kit.middleware import RequestIdFilter
from services.kit.streaming import SlowReaderGuard

from .admission import ADMITTED_PATHS
from .app import create_app
from .drain import Drain
from .config import build_arg_parser, config_from_args
from .exposure import bind_host, exposure_note
from .probation import hold_reporter


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s gateway [%(request_id)s] %(message)s"))
    root = logging.getLogger("u1serve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class GatewayServer(uvicorn.Server):
    """uvicorn, telling the app's Drain when shutdown begins (so what is still running near the end of the grace
    period ends cleanly, drain.py)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin()
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    cfg = config_from_args(args)
    setup_logging(args.log_level)
    host = bind_host(cfg)
    logging.getLogger("u1serve.gateway").info(
        "gateway on %s:%d -> understanding %s, generation %s (API key %s; %s)", host, args.port, cfg.und_urls,
        cfg.gen_urls, f"on, {len(cfg.api_keys)} tenant key(s), {len(cfg.admin_api_keys)} operator key(s)"
        if cfg.api_keys else "off", exposure_note(cfg) + f"; RL routes {'on' if cfg.enable_rl else 'off'}, runtime "
        f"LoRA loading {'on' if cfg.enable_runtime_lora else 'off'}")
    app = create_app(cfg)
    state = app.state.gateway
    strikes = hold_reporter(state.ledger, ADMITTED_PATHS, state.metrics.strikes.inc, logging.getLogger("u1serve.gateway"))
    served = SlowReaderGuard(app, write_timeout_s=cfg.stream_write_timeout_s,
                             send_buffer_bytes=cfg.stream_send_buffer_bytes, on_cut=state.metrics.slow_readers.inc,
                             hold_s=cfg.strike_hold_s, on_hold=strikes)
    # uvicorn's proxy headers: X-Forwarded-For from these peers is the client's address (strikes, logs)
    proxy = {} if cfg.forwarded_allow_ips is None else {"forwarded_allow_ips": cfg.forwarded_allow_ips}
    server = GatewayServer(uvicorn.Config(served, host=host, port=args.port, log_level="warning",
                                          access_log=False, timeout_graceful_shutdown=cfg.graceful_shutdown_s,
                                          **proxy),
                           state.drain)
    server.run()
    if not server.started:
        sys.exit(3)               # as uvicorn.run: the server could not start (e.g. the port is taken)


if __name__ == "__main__":
    main()
