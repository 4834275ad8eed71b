"""The fused colocate process: both engines' servers and engine loops in one process on one device.

    python -m services.fused.server [fused flags] --und UNDERSTANDING FLAGS... --gen GENERATION FLAGS...

(`u1serve up --mode colocate --colocate-engines fused` builds this command: services/fused/launch.py.) Each side's
flags are its server's, with `--engine-unit thread`; each app (its existing create_app) is served by its own uvicorn
server on its own port and event loop thread, so the gateway sees the same two services. Start order: understanding
(its engine loads, creates the KV pool, fits its KV cache to its memory share), then generation once understanding's
engine is ready: the process is ready (generation's /health 200) only with both engines ready.

Faults (docs/architecture.md, "Fused colocate"): the two engine loops share one CUDA context, and a thread cannot be
killed, so an engine is never restarted in place. When either engine's loop dies (an exception it does not handle,
a CUDA error), fails to start, or hangs (a step longer than --hang-s), the process fails every request in flight on
both services (503), gives the servers --exit-grace-s to answer them, and exits with status 3; the launcher restarts
the process within its restart budget, and meanwhile the gateway answers 503. An error the engines handle (a job's
out-of-memory, a non-finite image: 500 for that job) fails only that request, as in the two-process mode.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

from services.base import knobs
from services.kit import flags
from services.kit.config import read_secret
from services.kit.loop_clock import GilProbe, clocks
from services.kit.streaming import guard
from services.kit.supervisor import Supervisor
from shm_transfer.yield_signal import in_process

from .config import FusedConfig
from .launch import GEN_MARK, UND_MARK
from .stats import stats_router

log = logging.getLogger("u1serve.fused")
EXIT_FATAL = 3
_WATCH_S = 0.1
_DOWN = (Supervisor.RESTARTING, Supervisor.FAILED)


def split_argv(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(fused flags, understanding flags, generation flags)."""
    if UND_MARK not in argv or GEN_MARK not in argv or argv.index(UND_MARK) > argv.index(GEN_MARK):
        raise SystemExit(f"usage: python -m services.fused.server [flags] {UND_MARK} FLAGS... {GEN_MARK} FLAGS...")
    i, j = argv.index(UND_MARK), argv.index(GEN_MARK)
    return argv[:i], argv[i + 1:j], argv[j + 1:]


class HttpThread(threading.Thread):
    """One service's uvicorn server on its own event loop thread (no signal handlers: the main thread has them)."""

    def __init__(self, name: str, app, host: str, port: int, log_level: str, **config):
        import uvicorn
        super().__init__(name=f"u1-http-{name}", daemon=True)
        uv_level = "warning" if log_level.lower() == "info" else log_level   # a healthy start: the engines' lines
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=uv_level, access_log=False,
                                                    **config))

    def run(self) -> None:
        self.server.run()

    def stop(self) -> None:
        self.server.should_exit = True


class Fused:
    def __init__(self, cfg: FusedConfig, und_args: argparse.Namespace, gen_args: argparse.Namespace):
        from services.generation import server as gen_server
        from services.generation.config import config_from_args, server_config_from_args
        from services.generation.rank_options import check_rank_flags
        from services.understanding import server as und_server
        self.cfg = cfg
        self.reason: Optional[str] = None           # why the process exits non-zero
        self._fatal = threading.Event()
        self._stop = threading.Event()
        gen_cfg, gen_http = config_from_args(gen_args), server_config_from_args(gen_args)
        check_rank_flags(gen_cfg)
        if und_args.engine_unit != "thread" or gen_cfg.engine_unit != "thread":
            raise SystemExit("the fused process runs both engines as threads: pass --engine-unit thread to both")
        if und_args.yield_signal:    # the yield gate between the two loops: an Event here, not a shm page
            self.signal = in_process(und_args.yield_signal)
            if gen_cfg.yield_to != und_args.yield_signal:
                raise SystemExit("--gen --yield-to must name understanding's --yield-signal")
        else:
            self.signal = None
        token = read_secret(gen_http.internal_token, gen_http.internal_token_file, knobs.INTERNAL_TOKEN)
        und_app = und_server.create_app(und_args)
        self.und = und_app.state.u1
        self.und.request_exit = lambda: self.fail(f"understanding engine failed to start: {self.und.exit_error}")
        gen_app = gen_server.create_app(gen_cfg, gen_http, gen_args, token, on_give_up=self._gen_gave_up)
        self.gen = gen_app.state.generation
        self.streams = {"understanding": und_args.stream_priority, "generation": gen_cfg.stream_priority}
        self.probe = GilProbe(cfg.gil_probe_ms / 1e3) if cfg.gil_probe_ms > 0 else None
        for app in (und_app, gen_app):
            app.include_router(stats_router(self.snapshot))
        self.und_http = HttpThread("und", guard(und_app, und_args), und_args.host, und_args.port, und_args.log_level)
        self.gen_http = HttpThread("gen", guard(gen_app, gen_args), gen_http.host, gen_http.port, gen_cfg.log_level,
                                   timeout_graceful_shutdown=10)

    # -- state -----------------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        if not self._fatal.is_set():
            self.reason = reason
            self._fatal.set()

    def _gen_gave_up(self, why: str) -> None:
        sup = self.gen.engine.sup
        self.fail(f"generation engine died: {sup.last_error or why}" if sup.restarts or sup.last_error
                  else f"generation engine down: {why}")

    def snapshot(self) -> dict:
        return {"engines": "fused", "streams": self.streams,
                "loops": {name: c.stats() for name, c in clocks().items()},
                "gil_probe": self.probe.stats() if self.probe is not None else None,
                "yield_signal": {"name": self.signal.path, "decode_steps": self.signal.steps}
                if self.signal is not None else None,
                "exiting": self.reason}

    def _check(self) -> None:
        """One look for a dead, failed or hung engine (the watch loop)."""
        und, gen = self.und.engine, self.gen.engine
        if und is not None and und.ever_ready and und.supervisor.state in _DOWN:
            self.fail(f"understanding engine died: {und.supervisor.last_error}")
        if gen.sup.state in _DOWN and gen.sup.last_error:
            self.fail(f"generation engine died: {gen.sup.last_error}")
        for name, clock in clocks().items():
            busy = clock.busy_for()
            if self.cfg.hang_s and busy is not None and busy > self.cfg.hang_s:
                self.fail(f"{name} engine hung: its step has run {busy:.1f} s (--hang-s {self.cfg.hang_s:g})")
        for http in (self.und_http, self.gen_http):
            if http.ident is not None and not http.is_alive():
                self.fail(f"{http.name} stopped")

    # -- run ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        if self.probe is not None:
            self.probe.start()
        frac = self.cfg.und_memory_fraction
        if frac:   # understanding fits its KV cache under its own share first (engine._fit_kv_cache)
            os.environ[knobs.GPU_MEMORY_FRACTION.name] = f"{frac:.3f}"
        self.und_http.start()
        log.info("fused: understanding and generation engines as threads of pid %d (streams: %s)", os.getpid(),
                 ", ".join(f"{k} {v}" for k, v in self.streams.items()))
        while not self._done():
            e = self.und.engine
            if e is not None and e.ready:
                break
            self._check()
        if not self._done():
            if frac:   # one process, one allocator cap: both shares
                os.environ[knobs.GPU_MEMORY_FRACTION.name] = f"{frac + (self.cfg.gen_memory_fraction or 0):.3f}"
            self.gen_http.start()
        while not self._done():
            self._check()
        if self._fatal.is_set():
            self._exit_fatal()
        self.gen.engine.end_all()       # as generation's own server does on SIGTERM: streams end, then drain
        for http in (self.gen_http, self.und_http):
            http.stop()
            if http.ident is not None:
                http.join(30)
        if self.und.exit_error:
            return 1
        return 0

    def _done(self) -> bool:
        return self._stop.wait(_WATCH_S) or self._fatal.is_set()

    def _exit_fatal(self) -> None:
        """Fail what is in flight on both services (503), let the servers answer it, exit 3 (module doc)."""
        log.error("fused: %s; failing the requests in flight and exiting with code %d (the launcher restarts the "
                  "process)", self.reason, EXIT_FATAL)
        if self.und.engine is not None:
            self.und.engine.fail_inflight(self.reason)
        self.gen.engine.fail_inflight(self.reason)
        for http in (self.gen_http, self.und_http):
            http.stop()
        deadline = time.monotonic() + self.cfg.exit_grace_s
        for http in (self.gen_http, self.und_http):
            if http.ident is not None:
                http.join(max(0.0, deadline - time.monotonic()))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FATAL)        # a hung engine thread cannot be joined


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("services.fused.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flags(p, FusedConfig)
    return p


def main(argv: Optional[list[str]] = None) -> None:
    from services.generation.server import build_parser as gen_parser
    from services.understanding.server import _configure_logging, parse_args as und_parse
    own, und_argv, gen_argv = split_argv(sys.argv[1:] if argv is None else argv)
    cfg = flags.from_args(FusedConfig, build_parser().parse_args(own))
    und_args = und_parse(und_argv)
    gen_args = gen_parser().parse_args(gen_argv)
    _configure_logging(und_args.log_level)
    code = Fused(cfg, und_args, gen_args).run()
    sys.exit(code)


if __name__ == "__main__":
    main()
