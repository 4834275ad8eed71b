"""HTTP front of the generation service (FastAPI + uvicorn); the engine runs in its own process(es).

    python -m services.generation.server --model DIR --host 127.0.0.1 --port 8200 --device cpu \
        --dtype float32 --cfg-parallel 1 --kv-pool-name NAME --internal-token TOKEN \
        --max-batch-tokens 16384
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .encode import encode_image
from .previews import preview_format
from .metrics import GenerationMetrics
from .request import ApiError, GenerateJob, parse_generate
from .supervisor import EngineSupervisor

log = logging.getLogger("u1serve.generation")


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _model_fingerprint(model_dir: str) -> str | None:
    try:
        from services.model.loader import model_fingerprint
        return model_fingerprint(model_dir)
    except Exception:  # the engine reports a broken checkpoint itself
        return None


def _check_branches(job: GenerateJob) -> None:
    """The handles must be exactly the CFG branches the sampling parameters need."""
    from .sampling import branches_for, sampler_params
    try:
        sampler_params(job)
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_value") from e
    need = branches_for(job)
    if set(need) != set(job.handles):
        raise ApiError(400, f"these sampling parameters need handles {sorted(need)}, "
                       f"got {sorted(job.handles)}", param="handles", code="branch_mismatch")


def _check_handles(job: GenerateJob) -> None:
    """Parse every handle now so a malformed one is a 400 before the stream starts."""
    from .kv_source import PrefixSource
    for h in job.handles.values():
        PrefixSource.parse(h)


def _handle_releaser(pool_name: str, fingerprint: str | None):
    """Frees KV handles from this (HTTP) process: used when the engine died holding queued jobs."""
    import torch

    from .kv_source import PrefixSource
    source = PrefixSource(pool_name, fingerprint or "", torch.device("cpu"))
    lock = __import__("threading").Lock()

    def release(handles: list[dict]) -> None:
        if handles:
            with lock:
                source.release(handles)
    return release


def create_app(args: argparse.Namespace) -> FastAPI:
    metrics = GenerationMetrics()
    from .perf_options import EnginePerfMetrics, cache_defaults, perf_engine_args
    perf_metrics = EnginePerfMetrics(metrics.registry)
    cache_opts = cache_defaults(args)

    def on_stats(msg: dict) -> None:
        if msg.get("stat") == "restart":
            metrics.engine_restarts.inc()
        else:
            metrics.on_stats(msg)
            perf_metrics.on_stats(msg)

    engine_args = {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "kv_pool_name": args.kv_pool_name, "max_batch_tokens": args.max_batch_tokens,
        "max_running_jobs": args.max_running_jobs, "threads": args.threads,
        **perf_engine_args(args),
    }
    fingerprint = _model_fingerprint(args.model)
    releaser = _handle_releaser(args.kv_pool_name, fingerprint)
    supervisor = EngineSupervisor(engine_args, world=args.cfg_parallel, on_stats=on_stats, release=releaser)
    token = args.internal_token or os.environ.get("U1SERVE_INTERNAL_TOKEN") or None
    encoder = ThreadPoolExecutor(max_workers=args.encode_threads, thread_name_prefix="u1-encode")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        supervisor.start()
        try:
            yield
        finally:
            supervisor.stop()
            encoder.shutdown(wait=False)

    app = FastAPI(title="u1serve generation", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.supervisor = supervisor
    app.state.metrics = metrics

    def _auth(request: Request) -> ApiError | None:
        if token and request.headers.get("x-u1-internal-token") != token:
            return ApiError(401, "missing or wrong X-U1-Internal-Token", type="authentication_error",
                            code="unauthorized")
        return None

    @app.get("/health")
    async def health():
        body = {"status": "ok" if supervisor.ready else "starting",
                "running": supervisor.in_flight(), "restarts": supervisor.restarts,
                "cfg_parallel": args.cfg_parallel, "engine_pids": supervisor.pids,
                "warmup": perf_metrics.warmup}
        return JSONResponse(body, status_code=200 if supervisor.ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    @app.post("/internal/cancel")
    async def cancel(request: Request):
        if (err := _auth(request)) is not None:
            return _error_response(err)
        try:
            body = await request.json()
            rid = body["request_id"]
            assert isinstance(rid, str)
        except Exception:
            return _error_response(ApiError(400, "body must be {\"request_id\": str}",
                                            param="request_id"))
        return {"request_id": rid, "cancelled": supervisor.cancel(rid)}

    @app.post("/internal/generate")
    async def generate(request: Request):
        body = None

        def reject(err: ApiError) -> JSONResponse:
            # rejected before a job exists: still log it under the caller's request id
            rid = body.get("request_id") if isinstance(body, dict) else None
            log.info("request %s rejected: %d %s", rid if isinstance(rid, str) else
                     request.headers.get("x-request-id", "-"), err.status, err.code)
            return _error_response(err)

        if (err := _auth(request)) is not None:
            return reject(err)
        try:
            body = await request.json()
        except Exception:
            return reject(ApiError(400, "body is not valid JSON", code="invalid_json"))
        try:
            job = parse_generate(body, fingerprint, cache_opts)
            _check_branches(job)
            _check_handles(job)
        except ApiError as e:
            return reject(e)
        if not supervisor.ready:
            return reject(ApiError(503, "generation engine is not ready",
                                   type="server_error", code="engine_unavailable"))
        if supervisor.is_active(job.request_id):
            return reject(ApiError(409, f"request_id {job.request_id!r} is already "
                                   "running", param="request_id", code="duplicate"))

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(msg: dict) -> None:  # called from the supervisor's reader thread
            loop.call_soon_threadsafe(events.put_nowait, msg)

        try:
            supervisor.submit(job, sink)
        except RuntimeError as e:
            return reject(ApiError(503, str(e), type="server_error", code="engine_unavailable"))
        started = time.monotonic()

        async def stream():
            outcome = "error"
            finished = delivered = False
            exported = []            # float images (export_image) handed to this stream
            try:
                yield _sse({"type": "queued"})
                while True:
                    msg = await events.get()
                    kind = msg.get("type")
                    if kind == "done":
                        finished = True
                        outcome = msg.get("outcome", "ok")
                        break
                    if kind == "progress":
                        yield _sse({"type": "progress", "step": msg["step"],
                                    "total": msg["total"]})
                    elif kind == "preview":
                        fmt = preview_format(job.output_format)
                        b64 = await loop.run_in_executor(encoder, encode_image, msg["pixels"], fmt)
                        yield _sse({"type": "partial_image", "index": msg["index"],
                                    "partial_image_index": msg["partial_image_index"], "step": msg["step"],
                                    "b64": b64, "format": fmt, "width": msg["pixels"].shape[1],
                                    "height": msg["pixels"].shape[0]})
                    elif kind == "image":
                        b64 = await loop.run_in_executor(encoder, encode_image, msg["pixels"],
                                                         job.output_format)
                        event = {"type": "image", "index": msg["index"], "b64": b64,
                                 "format": job.output_format, "width": job.width,
                                 "height": job.height, "seed": job.seed,
                                 "branch_steps": msg.get("branch_steps")}
                        if msg.get("image_handle"):
                            exported.append(msg["image_handle"])
                            event["image_handle"] = msg["image_handle"]
                        yield _sse(event)
                    elif kind == "error":
                        yield _sse({k: v for k, v in msg.items() if k != "request_id"})
                yield _sse("[DONE]")
                delivered = True
            finally:
                if exported and not delivered:   # nobody will read the float image back: free it now
                    await loop.run_in_executor(None, releaser, exported)
                if not finished:  # the client went away: stop the job at the next step
                    supervisor.cancel(job.request_id)
                    outcome = "disconnected"
                metrics.requests.labels(outcome=outcome).inc()
                log.info("request %s %s in %.2fs", job.request_id, outcome,
                         time.monotonic() - started)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

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
    p.add_argument("--internal-token", default=None)
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="image tokens per forward (per rank); a larger single job runs alone")
    p.add_argument("--max-running-jobs", type=int, default=16)
    p.add_argument("--encode-threads", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per engine rank (0: default)")
    p.add_argument("--log-level", default="info")
    from .perf_options import add_perf_flags
    add_perf_flags(p)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.cfg_parallel < 1:
        raise SystemExit("--cfg-parallel must be >= 1")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn
    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)


if __name__ == "__main__":
    main()
