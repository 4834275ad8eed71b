"""HTTP front of the generation service (FastAPI + uvicorn); the engine runs in its own process(es).

    U1SERVE_INTERNAL_TOKEN=... python -m services.generation.server --model DIR --host 127.0.0.1 --port 8200 \
        --device cpu --dtype float32 --cfg-parallel 1 --kv-pool-name NAME --max-batch-tokens 16384

Every route but /health needs the stack's internal token (--internal-token-file, U1SERVE_INTERNAL_TOKEN, or
--internal-token, which /proc shows to every local user).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services import timeouts
from services.kit import errors, live, sse, timeline
from services.kit.config import read_secret
from services.kit.errors import APIError, bad_request
from services.kit.logsafe import safe
from services.kit.middleware import InternalTokenAuth, RequestIdFilter, ServiceMiddleware
from services.kit.streaming import OwnedStream, add_stream_flags, guard
from services.kit.web import json_body

from .encode import encode_image
from .image_limits import checkpoint_max_tokens, size_error
from .leases import HandleKeeper
from .metrics import GenerationMetrics
from .perf_options import EnginePerfMetrics, add_perf_flags, cache_defaults, perf_engine_args
from .previews import preview_format
from .rank_options import add_rank_flags, check_rank_flags, engine_world, rank_engine_args
from .inputs import GenerateRequest, check_handles, handles_of, parse_job
from .routers.rl import MAX_UPLOAD_BYTES, add_rl_flags
from .routers.rl import install as install_rl
from .stream_queue import StreamQueue
from .supervisor import EngineSupervisor
from .weights import weights_endpoint

log = logging.getLogger("u1serve.generation")
MAX_BODY_BYTES = MAX_UPLOAD_BYTES   # a job body is parameters + a few handles (~1 KB each); RL trajectory uploads
MiB = 1 << 20


def _model_fingerprint(model_dir: str) -> str | None:
    try:
        from services.model.loader import model_fingerprint
        return model_fingerprint(model_dir)
    except Exception:  # the engine reports a broken checkpoint itself
        return None


def create_app(args: argparse.Namespace, token: str, on_give_up=lambda why: None) -> FastAPI:
    metrics = GenerationMetrics()
    perf_metrics = EnginePerfMetrics(metrics.registry)
    cache_opts = cache_defaults(args)

    def on_stats(msg: dict) -> None:
        if msg.get("stat") == "weights":          # rank 0's reply to a weights op (weights.py)
            weights.reply(msg)
        elif msg.get("stat") == "restart":
            metrics.engine_restarts.inc()
            weights.engine_restarted()
        else:
            metrics.on_stats(msg)
            perf_metrics.on_stats(msg)

    engine_args = {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "kv_pool_name": args.kv_pool_name, "max_batch_tokens": args.max_batch_tokens,
        "max_running_jobs": args.max_running_jobs, "threads": args.threads, "log_level": args.log_level,
        **perf_engine_args(args), **rank_engine_args(args), "rl_reference": args.rl_reference,
    }
    fingerprint = _model_fingerprint(args.model)
    keeper = HandleKeeper(args.kv_pool_name, fingerprint)
    max_tokens = checkpoint_max_tokens(args.model)     # the trained size limit (image_limits.py)
    engine = EngineSupervisor(engine_args, engine_world(args), keeper, on_stats=on_stats, on_give_up=on_give_up,
                              max_queued=args.max_queued_requests, max_queue_wait_s=args.max_queue_wait_s)
    weights = weights_endpoint(engine)
    encoder = ThreadPoolExecutor(max_workers=args.encode_threads, thread_name_prefix="u1-encode")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)
            encoder.shutdown(wait=False)

    app = FastAPI(title="u1serve generation", docs_url=None, redoc_url=None, lifespan=lifespan)
    errors.install(app, "generation")
    app.add_middleware(ServiceMiddleware, service="generation", max_body_bytes=MAX_BODY_BYTES,
                       auth=InternalTokenAuth(token))
    app.state.engine = engine
    app.include_router(weights.router())
    app.include_router(live.router)    # /health/live: liveness, and the shm domain the gateway pairs replicas by

    def reject(err: APIError, rid, handles: list[dict]) -> APIError:
        """A request refused before its stream: log it under its id; its KV pages are freed (except on a
        duplicate id, whose handles may be the running job's)."""
        if handles and err.code != "duplicate":
            keeper.release(handles)
        metrics.requests.labels(outcome=str(err.code)).inc()
        log.info("request %s rejected: %d %s", safe(rid), err.status, err.code)
        return err

    install_rl(app, engine=engine, keeper=keeper, args=args, fingerprint=fingerprint, max_tokens=max_tokens,
               encoder=encoder, reject=reject)

    @app.get("/health")
    async def health():
        body = {**engine.status(), "cfg_parallel": args.cfg_parallel, "sp": args.sp, "sp_mode": args.sp_mode,
                "max_image_tokens": max_tokens, "warmup": perf_metrics.warmup, "weights_version": weights.version,
                "rl_trajectories": app.state.trajectories.stats()}
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        queued, _ = engine.table.counts()
        metrics.queue_depth.set(queued)
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    @app.post("/internal/cancel")
    async def cancel(request: Request):
        body = await json_body(request)
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise bad_request("body must be {\"request_id\": str}", param="request_id")
        return {"request_id": rid, "cancelled": engine.cancel(rid)}

    @app.post("/internal/generate")
    async def generate(request: Request):
        timeline.mark("gen", "request")
        body = await json_body(request)
        rid = body.get("request_id") if isinstance(body.get("request_id"), str) else \
            request.headers.get("x-request-id", "-")
        try:
            job = parse_job(body, cache_opts)
            too_big = size_error(job.width, job.height, max_tokens)
            if too_big:
                raise bad_request(too_big, param="size", code="invalid_size")
            check_handles(job, fingerprint)
        except APIError as err:
            raise reject(err, rid, handles_of(body)) from None
        loop = asyncio.get_running_loop()
        rid = job.request_id

        def overflow(nbytes: int) -> None:       # the stream's reader fell behind: end the job (stream_queue.py)
            metrics.streams_behind.inc()
            engine.cancel(rid, f"the stream fell {nbytes / MiB:.0f} MiB behind its reader "
                               f"(--max-stream-backlog-mb {args.max_stream_backlog_mb:g}); cut")

        events = StreamQueue(loop, int(args.max_stream_backlog_mb * MiB), overflow, keeper.release)
        try:
            engine.submit(job, events.deliver)
        except APIError as err:
            raise reject(err, rid, list(job.handles.values())) from None
        st = {"outcome": "disconnected", "delivered": False, "exported": [], "started": time.monotonic()}
        body = _stream(job, events, loop, st)

        async def finish() -> None:
            """However the response ended (done, failed, cut, or the client gone before its first byte)."""
            await body.aclose()
            if st["outcome"] == "disconnected":      # the client went away: stop the job at the next step (what
                engine.cancel(rid, "client disconnected")   # the engine sends after: supervisor)
            exported = st["exported"] + [e["image_handle"] for e in events.close() if e.get("image_handle")]
            if exported and not st["delivered"]:     # nobody will read the float image back: free it now
                keeper.release(exported)
            metrics.requests.labels(outcome=st["outcome"]).inc()
            log.info("request %s %s in %.2fs", safe(rid), st["outcome"], time.monotonic() - st["started"])

        return OwnedStream(body, on_close=finish)

    async def _stream(job: GenerateRequest, events: StreamQueue, loop, st: dict):
        """The job's SSE body; a heartbeat comment whenever nothing happened for --stream-heartbeat-s (a queued
        job), so no idle timeout on the way fires before the queue's own (a 429 queue_timeout)."""
        yield sse.encode({"type": "queued"})
        while True:
            ev = await events.get(args.stream_heartbeat_s or None)
            if ev is None:
                yield sse.HEARTBEAT
                continue
            kind = ev.get("type")
            if kind == "end":
                break
            if kind == "progress":
                yield sse.encode({"type": "progress", "step": ev["step"], "total": ev["total"]})
            elif kind == "preview":
                fmt = preview_format(job.output_format)
                b64 = await loop.run_in_executor(encoder, encode_image, ev["pixels"], fmt)
                yield sse.encode({"type": "partial_image", "index": ev["index"],
                                  "partial_image_index": ev["partial_image_index"], "step": ev["step"],
                                  "b64": b64, "format": fmt, "width": ev["pixels"].shape[1],
                                  "height": ev["pixels"].shape[0]})
            elif kind == "image":
                timeline.mark("gen", "image_event")
                b64 = await loop.run_in_executor(encoder, encode_image, ev["pixels"], job.output_format)
                timeline.mark("gen", "encoded")
                event = {"type": "image", "index": ev["index"], "b64": b64, "format": job.output_format,
                         "width": job.width, "height": job.height, "seed": job.seed,
                         "branch_steps": ev.get("branch_steps"), "weights_version": ev.get("weights_version")}
                if ev.get("image_handle"):
                    st["exported"].append(ev["image_handle"])
                    event["image_handle"] = ev["image_handle"]
                data = sse.encode(event)
                timeline.mark("gen", "sse_event")
                yield data
            elif kind == "error":
                st["outcome"] = str(ev.get("error", {}).get("code") or "error")
                yield sse.encode(ev)
        if st["outcome"] == "disconnected":
            st["outcome"] = "ok"
        yield sse.encode(sse.DONE)
        st["delivered"] = True

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="services.generation.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cfg-parallel", type=int, default=1,
                   help="engine ranks; CFG branches are spread over them")
    p.add_argument("--kv-pool-name", default="u1serve-kv", help="shm_transfer pool to attach")
    p.add_argument("--internal-token", default=None,
                   help="the stack's internal token (visible in /proc: prefer the file or the environment)")
    p.add_argument("--internal-token-file", default=None, help="file whose first line is the internal token")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="image tokens per forward (per rank); a larger single job runs alone")
    p.add_argument("--max-running-jobs", type=int, default=16)
    p.add_argument("--max-queued-requests", type=int, default=0,
                   help="jobs waiting for the engine before 429 (0: sized from free memory, see capacity.py)")
    p.add_argument("--max-queue-wait-s", type=float, default=timeouts.GEN_MAX_QUEUE_WAIT_S,
                   help="a job that waited this long for the engine fails with 429 queue_timeout")
    p.add_argument("--stream-heartbeat-s", type=float, default=timeouts.GEN_HEARTBEAT_S,
                   help="a stream with nothing to say for this long (a queued job) sends an SSE comment, so idle "
                        "timeouts on the way (the gateway's --upstream-idle-timeout-s) wait for the queue's own "
                        "429; 0 = never")
    p.add_argument("--max-stream-backlog-mb", type=float, default=256.0,
                   help="pixels of one stream waiting for its reader beyond this: the job is cancelled and the "
                        "stream cut (a single larger image still passes)")
    add_stream_flags(p)
    p.add_argument("--encode-threads", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per engine rank (0: default)")
    p.add_argument("--log-level", default="info")
    add_perf_flags(p)
    add_rank_flags(p)
    add_rl_flags(p)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.cfg_parallel < 1:
        raise SystemExit("--cfg-parallel must be >= 1")
    check_rank_flags(args)
    token = read_secret(args.internal_token, args.internal_token_file, "U1SERVE_INTERNAL_TOKEN")
    if not token:
        raise SystemExit("the generation service needs the stack's internal token: --internal-token-file PATH "
                         "or U1SERVE_INTERNAL_TOKEN (u1serve up sets one)")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for h in logging.getLogger().handlers:
        h.addFilter(RequestIdFilter())
    import uvicorn
    failed: list[str] = []

    def on_give_up(why: str) -> None:   # the engine cannot run: exit non-zero so a supervisor sees it
        failed.append(why)
        log.error("the generation engine is down for good; exiting with code 3")
        server.should_exit = True

    app = create_app(args, token, on_give_up)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):      # SIGTERM/SIGINT: end the streams first, then drain
            app.state.engine.end_all()
            super().handle_exit(sig, frame)

    # uvicorn's own start-up lines only at debug: a healthy start logs one line (engine ready)
    uv_level = "warning" if args.log_level.lower() == "info" else args.log_level
    server = Server(uvicorn.Config(guard(app, args), host=args.host, port=args.port, log_level=uv_level, access_log=False,
                                   timeout_graceful_shutdown=10))
    server.run()
    if failed:
        sys.exit(3)


if __name__ == "__main__":
    main()
