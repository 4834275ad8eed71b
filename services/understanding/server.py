"""Understanding service: FastAPI HTTP process + engine process(es) fed over ZMQ.

    python -m services.understanding.server --model DIR [--port 8100] [--device cpu|cuda] [--tp N] ...

Endpoints: /v1/chat/completions, /generate, /generate_stream, /v1/models, /health, /metrics and the
internal /internal/image_prefix, /internal/release, /internal/abort (docs/architecture.md).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from services.model import images as IM
from services.model import prompts as PR
from services.model.config import load_config
from services.model.loader import model_fingerprint
from services.model.tokenizer import NeoTokenizer

from .api_errors import APIError, bad_request, unavailable
from .detokenizer import OutputText
from .engine import EngineConfig
from .engine_client import EngineClient, EngineDead
from .http_util import until_disconnect as _until_disconnect
from .image_prefix import ImagePrefixService
from .metrics import Metrics
from .protocol import SubmitRequest
from .request_parsing import (Limits, decode_image_ref, enable_thinking, finalize_max_tokens, parse_messages,
                              sampling_from_native, sampling_from_openai)

log = logging.getLogger("u1serve.understanding")


def sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


class Service:
    def __init__(self, args):
        self.args = args
        self.tok = NeoTokenizer.from_dir(args.model)
        self.cfg = load_config(args.model)
        self.model_name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        self.limits = Limits(max_model_len=args.max_model_len, max_image_bytes=args.max_image_bytes,
                             min_pixels=args.image_min_pixels, max_pixels=args.image_max_pixels)
        self.metrics = Metrics()
        self.pool = None
        self.client: Optional[EngineClient] = None
        self.prefix: Optional[ImagePrefixService] = None
        self.started = time.time()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self):
        a = self.args
        if a.kv_pool_name:
            from shm_transfer import KVLayout, ShmKVPool
            llm = self.cfg.llm
            layout = KVLayout(num_layers=llm.num_hidden_layers, num_kv_heads=llm.num_key_value_heads,
                              head_dim=llm.head_dim, dtype=a.dtype, page_tokens=a.kv_page_tokens)
            # the HTTP process only allocates/releases pages; the engines (which copy) pin the mapping
            self.pool = ShmKVPool.create(a.kv_pool_name, layout, int(a.kv_pool_gb * (1 << 30)),
                                         model_fingerprint(a.model, self.cfg), pin=False)
        ecfg = EngineConfig(model_dir=a.model, device=a.device, dtype=a.dtype, tp=a.tp,
                            kv_cache_tokens=a.kv_cache_tokens, max_running=a.max_running_requests,
                            max_model_len=a.max_model_len, chunked_prefill_size=a.chunked_prefill_size,
                            enable_prefix_cache=not a.no_prefix_cache, kv_pool_name=a.kv_pool_name,
                            cuda_graph_max_bs=a.cuda_graph_max_bs)
        self.prefix = ImagePrefixService(self)
        # a dead engine is replaced by a fresh one; the shm pool (ours) keeps its name and generation
        self.client = EngineClient(ecfg, on_engine_dead=self._engine_dead)
        self.client.start()

    def _engine_dead(self, reason: str) -> None:
        if self.pool is not None and self.prefix is not None:
            n = self.prefix.engine_dead()
            if n:
                log.warning("engine died: released %d shm pages of unfinished image prefixes", n)

    async def stop(self):
        if self.client is not None:
            await self.client.shutdown()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.unlink()
            with contextlib.suppress(Exception):
                self.pool.close()

    def check_internal(self, request: Request) -> None:
        token = self.args.internal_token
        if token and request.headers.get("x-u1-internal-token") != token:
            raise APIError(401, "missing or wrong X-U1-Internal-Token", None, "unauthorized",
                           "authentication_error")

    def require_engine(self) -> EngineClient:
        c = self.client
        if c is None or not c.ready or not c.alive:
            raise unavailable(c.fatal if c is not None and c.fatal else "the engine is not ready")
        # the engine may have shrunk its KV cache to fit GPU memory: the context limit follows it
        self.limits.max_model_len = min(self.args.max_model_len, c.max_model_len)
        return c

    def stop_ids(self, params) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids.append(self.tok.im_end_id)
        return ids

    # ---- text generation core --------------------------------------------------------------------
    async def generate(self, rid: str, inp: PR.PromptInput, params, think: Optional[bool]):
        """Async iterator of dicts: {"reasoning", "content", "ids", "finish_reason"?, "usage"?}."""
        client = self.require_engine()
        stop_ids = self.stop_ids(params)
        msg = SubmitRequest(rid, list(inp.input_ids), list(inp.images), params, "text", stop_token_ids=stop_ids)
        out = OutputText(self.tok, think, params.stop, set(stop_ids))
        t0 = time.monotonic()
        last = None
        finished = False
        try:
            try:
                q = client.submit(msg)
            except EngineDead as e:
                raise unavailable(str(e)) from None
            n_out = cached = 0
            while True:
                o = await q.get()
                now = time.monotonic()
                if o.new_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.itl.observe((now - last) / len(o.new_ids))
                    last = now
                n_out += len(o.new_ids)
                cached = o.cached_tokens
                r_delta, c_delta = out.push(o.new_ids)
                reason = o.finish_reason
                if out.stopped and reason is None:
                    client.abort(rid)      # a stop string ended it; free the KV at the next iteration
                    reason = "stop"
                if reason is not None:
                    finished = True
                    if reason == "error":
                        if o.error_code == "engine_dead":
                            raise unavailable(o.error or "engine died", "engine_dead")
                        raise APIError(500 if o.error_code != "kv_cache_too_small" else 400,
                                       o.error or "engine error", None, o.error_code)
                    r2, c2 = out.finish()
                    usage = {"prompt_tokens": len(inp.input_ids), "completion_tokens": n_out,
                             "total_tokens": len(inp.input_ids) + n_out,
                             "prompt_tokens_details": {"cached_tokens": cached}}
                    self.metrics.e2e.observe(now - t0)
                    yield {"reasoning": r_delta + r2, "content": c_delta + c2, "ids": o.new_ids,
                           "finish_reason": "stop" if out.stopped else reason, "usage": usage}
                    return
                if r_delta or c_delta or o.new_ids:
                    yield {"reasoning": r_delta, "content": c_delta, "ids": o.new_ids}
        finally:
            if not finished and self.client is not None:
                self.client.abort(rid)
            if self.client is not None:
                self.client.done(rid)


# ---------------------------------------------------------------------------------------------------
async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except Exception:
        raise bad_request("request body must be valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


async def _prepare(svc: Service, fn, *a):
    """CPU-heavy prompt building (image decode/resize, tokenisation) off the event loop."""
    try:
        return await asyncio.to_thread(fn, *a)
    except APIError:
        raise
    except (ValueError, IM.ImageError) as e:
        raise bad_request(str(e)) from None


def create_app(args) -> FastAPI:
    svc = Service(args)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="u1serve understanding", lifespan=lifespan)
    app.state.svc = svc

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc):
        return bad_request(f"invalid request: {exc.errors()}").response()

    # ---- ops -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        c = svc.client
        s = c.stats if c else None
        pool = svc.pool.stats() if svc.pool is not None else None
        ok = c is not None and c.ready and c.alive
        status = "ok" if ok else ("restarting" if c and c.restarting else ("error" if c and c.fatal else "loading"))
        body = {"status": status, "engine_ready": bool(ok), "error": c.fatal if c else None,
                "model": svc.model_name, "restarts": c.restarts if c else 0,
                "engine_pids": c.pids if c else [], "last_engine_error": c.last_error if c else None}
        if s is not None:
            body.update(running=s.running, waiting=s.waiting, kv_total=s.kv_total, kv_free=s.kv_free,
                        kv_in_use=s.kv_in_use, kv_cached=s.kv_cached, inflight=len(c.queues),
                        preemptions=s.preemptions)
        if pool is not None:
            body.update(shm_pages_used=pool["pages_used"], shm_pages_total=pool["pages_total"],
                        shm_handles_live=pool["handles_live"], shm_pool_generation=pool["generation"])
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        c = svc.client
        pool = svc.pool.stats() if svc.pool is not None else None
        return Response(svc.metrics.render(c.stats, pool, c.restarts), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": int(svc.started),
                                             "owned_by": "u1serve", "max_model_len": svc.limits.max_model_len}]}

    # ---- OpenAI chat -------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json_body(request)
        svc.require_engine()
        think = enable_thinking(body)
        params, given = sampling_from_openai(body)
        msgs = await _prepare(svc, parse_messages, body.get("messages"), svc.limits)
        inp = await _prepare(svc, PR.chat_input, svc.tok, msgs, think, svc.limits.min_pixels,
                             svc.limits.max_pixels)
        finalize_max_tokens(params, given, len(inp.input_ids), svc.limits)
        rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = svc.model_name
        stream = bool(body.get("stream", False))
        want_ids = bool(body.get("return_token_ids", False))   # extension: output token ids per choice
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        log.info("request %s: chat, %d prompt tokens, stream=%s", rid, len(inp.input_ids), stream)

        if stream:
            gen = svc.generate(rid, inp, params, think)
            # Run up to the first event so an immediate error is still a plain 4xx/5xx response.
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                first = None

            def chunk(delta, finish=None):
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

            async def events():
                usage = None
                try:
                    yield sse(chunk({"role": "assistant", "content": ""}))
                    ev = first
                    while ev is not None:
                        delta = {}
                        if ev["reasoning"]:
                            delta["reasoning_content"] = ev["reasoning"]
                        if ev["content"]:
                            delta["content"] = ev["content"]
                        if delta or (want_ids and ev["ids"]):
                            c = chunk(delta)
                            if want_ids:
                                c["choices"][0]["token_ids"] = ev["ids"]
                            yield sse(c)
                        if "finish_reason" in ev:
                            usage = ev["usage"]
                            svc.metrics.requests.labels("chat", ev["finish_reason"]).inc()
                            yield sse(chunk({}, ev["finish_reason"]))
                            break
                        ev = await gen.__anext__()
                    if include_usage and usage:
                        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": [], "usage": usage})
                except APIError as e:
                    yield sse(e.body())
                finally:
                    await gen.aclose()
                yield sse("[DONE]")

            # aclose also runs when the client left before the body started (frees the engine request)
            return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(gen.aclose))

        async def collect():
            reasoning, content, ids, final = [], [], [], None
            async for ev in svc.generate(rid, inp, params, think):
                reasoning.append(ev["reasoning"])
                content.append(ev["content"])
                ids.extend(ev["ids"])
                if "finish_reason" in ev:
                    final = ev
            return "".join(reasoning), "".join(content), ids, final

        res = await _until_disconnect(request, collect())
        if res is None:
            return Response(status_code=499)
        reasoning, content, ids, final = res
        svc.metrics.requests.labels("chat", final["finish_reason"]).inc()
        message = {"role": "assistant", "content": content}
        if think is not False:
            message["reasoning_content"] = reasoning or None
        choice = {"index": 0, "message": message, "finish_reason": final["finish_reason"], "logprobs": None}
        if want_ids:
            stop_ids = set(svc.stop_ids(params))
            choice["token_ids"] = [t for t in ids if t not in stop_ids]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": final["usage"]}

    # ---- LightLLM-style native API ----------------------------------------------------------------
    async def native_inputs(body: dict):
        text = body.get("inputs")
        if not isinstance(text, str) or not text:
            raise bad_request("inputs must be a non-empty string", "inputs")
        params, given = sampling_from_native(body.get("parameters") or {})
        mm = body.get("multimodal_params") or {}
        imgs = mm.get("images") or [] if isinstance(mm, dict) else None
        if not isinstance(imgs, list):
            raise bad_request("multimodal_params.images must be a list", "multimodal_params")

        def build():
            pils = []
            for i, im in enumerate(imgs):
                ref = im.get("data") if isinstance(im, dict) else im
                pils.append(decode_image_ref(ref, svc.limits, f"multimodal_params.images[{i}]"))
            tensors = [IM.preprocess(p, svc.limits.min_pixels, svc.limits.max_pixels) for p in pils]
            missing = len(tensors) - text.count(PR.IMAGE_PLACEHOLDER)
            return PR.expand_images(svc.tok, (PR.IMAGE_PLACEHOLDER + "\n") * max(0, missing) + text, tensors)

        inp = await _prepare(svc, build)
        finalize_max_tokens(params, given, len(inp.input_ids), svc.limits)
        return inp, params

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        svc.require_engine()
        inp, params = await native_inputs(body)
        rid = request.headers.get("x-request-id") or f"gen-{uuid.uuid4().hex}"

        async def collect():
            text, ids, final = [], [], None
            async for ev in svc.generate(rid, inp, params, False):
                text.append(ev["content"])
                ids.extend(ev["ids"])
                if "finish_reason" in ev:
                    final = ev
            return "".join(text), ids, final

        res = await _until_disconnect(request, collect())
        if res is None:
            return Response(status_code=499)
        text, ids, final = res
        svc.metrics.requests.labels("generate", final["finish_reason"]).inc()
        stop_ids = set(svc.stop_ids(params))
        return {"generated_text": [text], "count_output_tokens": len(ids), "finish_reason": final["finish_reason"],
                "prompt_tokens": len(inp.input_ids), "token_ids": [t for t in ids if t not in stop_ids],
                "cached_tokens": final["usage"]["prompt_tokens_details"]["cached_tokens"]}

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        body = await _json_body(request)
        svc.require_engine()
        inp, params = await native_inputs(body)
        rid = request.headers.get("x-request-id") or f"gen-{uuid.uuid4().hex}"
        gen = svc.generate(rid, inp, params, False)

        async def events():
            count = 0
            try:
                async for ev in gen:
                    count += len(ev["ids"])
                    done = "finish_reason" in ev
                    yield sse({"token": {"id": ev["ids"][-1] if ev["ids"] else None, "text": ev["content"],
                                         "logprob": None, "special": False, "count_output_tokens": count,
                                         "prompt_tokens": len(inp.input_ids)},
                               "generated_text": None, "finished": done,
                               "finish_reason": ev.get("finish_reason"), "details": None})
                    if done:
                        svc.metrics.requests.labels("generate_stream", ev["finish_reason"]).inc()
            except APIError as e:
                yield sse(e.body())
            finally:
                await gen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- internal -----------------------------------------------------------------------------------
    @app.post("/internal/image_prefix")
    async def image_prefix(request: Request):
        svc.check_internal(request)
        body = await _json_body(request)
        log.info("request %s: image prefix (%s)", body.get("request_id"), body.get("kind"))
        return await svc.prefix.handle(request, body)

    @app.post("/internal/release")
    async def release(request: Request):
        svc.check_internal(request)
        body = await _json_body(request)
        return svc.prefix.release(body)

    @app.post("/internal/abort")
    async def abort(request: Request):
        svc.check_internal(request)
        body = await _json_body(request)
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise bad_request("request_id must be a non-empty string", "request_id")
        n = svc.prefix.abort(rid)
        if svc.client is not None and rid in svc.client.queues:
            svc.client.abort(rid)
            n += 1
        return {"request_id": rid, "aborted": n}

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("services.understanding.server",
                                description="u1serve understanding service (chat, VQA, image prefixes)")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel engine processes")
    p.add_argument("--kv-pool-name", default=None, help="shared-memory KV pool to create for image prefixes")
    p.add_argument("--kv-pool-gb", type=float, default=4.0, help="size of the shared-memory KV pool")
    p.add_argument("--kv-page-tokens", type=int, default=64, help="tokens per shared-memory pool page")
    p.add_argument("--kv-lease-s", type=float, default=300.0,
                   help="lease of exported prefix pages (reclaimed after it if nobody releases them)")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="token slots of the paged KV cache")
    p.add_argument("--max-model-len", type=int, default=32768, help="context limit (prompt + output)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=4096,
                   help="prefill tokens per iteration (0 = no chunking); image spans are never split")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    p.add_argument("--cuda-graph-max-bs", type=int, default=128,
                   help="largest decode batch replayed from a CUDA graph (0 = eager; CUDA, dense models only)")
    p.add_argument("--internal-token", default=os.environ.get("U1SERVE_INTERNAL_TOKEN"),
                   help="required X-U1-Internal-Token for /internal/* (env U1SERVE_INTERNAL_TOKEN)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--image-min-pixels", type=int, default=IM.VQA_MIN_PIXELS)
    p.add_argument("--image-max-pixels", type=int, default=IM.VQA_MAX_PIXELS)
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--max-think-tokens", type=int, default=4096, help="upper bound for max_think_tokens")
    p.add_argument("--log-level", default="info")
    return p


def main(argv=None) -> None:
    import uvicorn
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        raise SystemExit("--tp must be >= 1")
    args.max_model_len = min(args.max_model_len, args.kv_cache_tokens)
    logging.basicConfig(level=args.log_level.upper())
    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
