"""The public OpenAI-compatible API. Thin: validate, route to the engines, stream back."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import GatewayConfig
from .errors import APIError, bad_request
from .inputs import b64, check_image, data_url, decode_b64_or_data_url
from .metrics import GatewayMetrics
from .middleware import GatewayMiddleware
from .orchestrator import Orchestrator
from .params import ImageJob, Options, build_job, merge_options
from .upstream import (EndpointPool, connection_error, error_from_response, headers, open_stream,
                       sse)

log = logging.getLogger("u1serve.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
IMAGE_OPTION_KEYS = {"size", "width", "height", "aspect_ratio", "n", "num_inference_steps", "steps",
                     "guidance_scale", "cfg_scale", "image_guidance_scale", "img_cfg_scale",
                     "cfg_norm", "timestep_shift", "t_eps", "cfg_interval", "seed",
                     "output_format", "think", "max_think_tokens", "cache"}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


async def run_until_disconnect(request: Request, work: Callable[[], Any]) -> tuple[bool, Any]:
    """Run `work()`; cancel it if the client disconnects. Returns (finished, result)."""
    box: dict[str, Any] = {}

    async with anyio.create_task_group() as tg:
        async def watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    box["gone"] = True
                    tg.cancel_scope.cancel()
                    return

        async def run():
            try:
                box["result"] = await work()
            except Exception as exc:   # re-raised below, outside the task group's ExceptionGroup
                box["error"] = exc
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if "error" in box:
        raise box["error"]
    if box.get("gone") and "result" not in box:
        return False, None
    return True, box.get("result")


def create_app(cfg: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0)) as http:
            state["http"] = http
            state["orch"] = Orchestrator(cfg, http, und_pool, gen_pool, metrics)
            yield

    und_pool = EndpointPool("understanding", cfg.und_urls, cfg.retry_down_after_s)
    gen_pool = EndpointPool("generation", cfg.gen_urls, cfg.retry_down_after_s)
    app = FastAPI(title="u1serve gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = cfg
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail),
                                       code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       code="internal_error"))

    def rid(request: Request) -> str:
        return request.scope.get("state", {}).get("request_id", "-")

    def hdrs(request: Request) -> dict[str, str]:
        return headers(cfg.internal_token, rid(request))

    # ---------------------------------------------------------------- simple routes
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                            "created": 0, "owned_by": "u1serve"}]}

    @app.get("/health")
    async def health():
        http: httpx.AsyncClient = state["http"]

        async def probe(service: str, url: str) -> dict:
            try:
                r = await http.get(url + "/health", timeout=cfg.health_timeout_s,
                                   headers=headers(cfg.internal_token))
                ok = r.status_code == 200
                return {"service": service, "url": url, "status": "ok" if ok else "unavailable",
                        "http_status": r.status_code}
            except httpx.HTTPError as exc:
                return {"service": service, "url": url, "status": "unavailable",
                        "detail": type(exc).__name__}

        probes = [probe("understanding", u) for u in cfg.und_urls] + \
                 [probe("generation", u) for u in cfg.gen_urls]
        results = await asyncio.gather(*probes)
        for pool in (und_pool, gen_pool):
            for ep in pool.endpoints:
                hit = next(r for r in results if r["url"] == ep.url and r["service"] == pool.service)
                ep.mark_up() if hit["status"] == "ok" else pool.down(ep)
        healthy = all(r["status"] == "ok" for r in results)
        body = {"status": "ok" if healthy else "unavailable",
                "understanding": [r for r in results if r["service"] == "understanding"],
                "generation": [r for r in results if r["service"] == "generation"]}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # ---------------------------------------------------------------- chat
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", param="messages",
                              code="invalid_type" if messages is not None else
                              "missing_required_parameter")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a 'role'",
                                  param=f"messages[{i}]")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise bad_request(f"messages[{i}].content must be a string or a list of parts",
                                  param=f"messages[{i}].content", code="invalid_type")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", param="stream", code="invalid_type")
        modalities = body.get("modalities")
        if modalities is not None and (not isinstance(modalities, list)
                                       or not all(isinstance(x, str) for x in modalities)):
            raise bad_request("'modalities' must be a list of strings", param="modalities",
                              code="invalid_type")
        if modalities and "image" in modalities:
            return await chat_image(request, body, messages, stream)
        return await chat_proxy(request, body, stream)

    async def chat_proxy(request: Request, body: dict, stream: bool):
        http: httpx.AsyncClient = state["http"]
        timeout = httpx.Timeout(None, connect=cfg.connect_timeout_s)
        if not stream:
            async def call():
                ep, resp = await open_stream(http, und_pool, "/v1/chat/completions", body,
                                             hdrs(request), timeout)
                box["ep"] = ep
                with und_pool.use(ep):
                    try:
                        await resp.aread()
                        return resp
                    except httpx.TransportError as exc:
                        und_pool.down(ep)
                        raise connection_error("understanding", ep.url, exc) from None
                    finally:
                        with anyio.CancelScope(shield=True):
                            await resp.aclose()
            box: dict[str, Any] = {}
            finished, resp = await run_until_disconnect(request, call)
            if not finished:
                metrics.cancelled.inc()
                if "ep" in box:
                    await _abort_und(box["ep"].url, request)
                return Response(status_code=499)
            if resp.status_code != 200:
                raise await error_from_response(resp, "understanding")
            try:
                return JSONResponse(resp.json(), status_code=200)
            except ValueError:
                raise APIError(502, "understanding service returned a non-JSON body",
                               code="upstream_protocol_error") from None

        ep, resp = await open_stream(http, und_pool, "/v1/chat/completions", body, hdrs(request),
                                     timeout)
        ep.in_flight += 1
        if resp.status_code != 200:
            ep.in_flight -= 1
            try:
                raise await error_from_response(resp, "understanding")
            finally:
                await resp.aclose()

        async def relay() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
                done = True
            except httpx.TransportError as exc:
                und_pool.down(ep)
                err = connection_error("understanding", ep.url, exc)
                yield sse({"error": err.body()["error"]})
                yield sse("[DONE]")
                done = True
            finally:
                ep.in_flight -= 1
                with anyio.CancelScope(shield=True):
                    await resp.aclose()
                    if not done:
                        metrics.cancelled.inc()
                        await _abort_und(ep.url, request)

        return StreamingResponse(relay(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _abort_und(url: str, request: Request):
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await state["http"].post(url + "/internal/abort", json={"request_id": rid(request)},
                                         headers=hdrs(request), timeout=4.0)
            except httpx.HTTPError:
                pass

    async def chat_image(request: Request, body: dict, messages: list, stream: bool):
        prompt, images, first_wh = await _prompt_from_messages(messages)
        opts_src = {k: v for k, v in body.items() if k in IMAGE_OPTION_KEYS}
        if isinstance(body.get("extra_body"), dict):
            opts_src["extra_body"] = {k: v for k, v in body["extra_body"].items()
                                      if k in IMAGE_OPTION_KEYS or k == "image_config"}
            nested_cfg = opts_src["extra_body"].pop("image_config", None)
        else:
            nested_cfg = None
        image_config = body.get("image_config", nested_cfg)
        if image_config is not None and not isinstance(image_config, dict):
            raise bad_request("'image_config' must be an object", param="image_config",
                              code="invalid_type")
        values = merge_options(opts_src)
        for k, v in merge_options(image_config or {}).items():
            values[k] = v
        ctk = body.get("chat_template_kwargs") or {}
        if isinstance(ctk, dict) and "enable_thinking" in ctk and "think" not in values:
            values["think"] = ctk["enable_thinking"]
        values["stream"] = stream
        job = build_job(cfg, Options(values), "edit" if images else "t2i", prompt, images, first_wh)
        model = body.get("model") if isinstance(body.get("model"), str) else cfg.model_name
        cid = "chatcmpl-" + rid(request)
        created = int(time.time())
        if not stream:
            result = await collect_job(request, job)
            if result is None:
                return Response(status_code=499)
            think_text, imgs = result
            parts = [{"type": "image_url", "image_url": {"url": data_url(im["b64"], im["format"])}}
                     for im in imgs]
            message = {"role": "assistant", "content": parts, "images": parts}
            if think_text:
                message["reasoning_content"] = think_text
            return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": 0, "delta": delta,
                                                  "finish_reason": finish}]}

        def to_chunks(ev: dict) -> list[dict]:
            if ev["type"] == "think_delta" and ev["text"]:
                return [chunk({"reasoning_content": ev["text"]})]
            if ev["type"] == "image":
                part = {"type": "image_url",
                        "image_url": {"url": data_url(ev["b64"], ev.get("format", "png"))}}
                return [chunk({"images": [part]})]
            return []

        head = [chunk({"role": "assistant", "content": ""})]
        tail = [chunk({}, "stop")]
        return await stream_job(request, job, to_chunks, head, tail)

    async def _prompt_from_messages(messages: list) -> tuple[str, list[str], tuple | None]:
        """The last user turn: its text is the prompt, its image_url parts the edit inputs."""
        user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
        if user is None:
            raise bad_request("image generation needs a user message", param="messages")
        content = user.get("content")
        if isinstance(content, str) or content is None:
            return content or "", [], None
        texts, images, first_wh = [], [], None
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise bad_request("content parts must be objects", param="messages")
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise bad_request("text parts need a string 'text'", param="messages")
                texts.append(part["text"])
            elif kind == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                raw = decode_b64_or_data_url(url, "image_url")
                wh = await anyio.to_thread.run_sync(check_image, raw, "image_url")
                first_wh = first_wh or wh
                images.append(b64(raw))
            else:
                raise bad_request(f"unsupported content part type {kind!r}", param="messages")
        if len(images) > cfg.max_input_images:
            raise bad_request(f"at most {cfg.max_input_images} input images", param="messages",
                              code="too_many_images")
        return "\n".join(texts), images, first_wh

    # ---------------------------------------------------------------- images
    async def collect_job(request: Request, job: ImageJob):
        """Run a job to the end; None if the client went away (the job is then cancelled)."""
        async def work():
            think_text, imgs = None, []
            async with contextlib.aclosing(state["orch"].run(job, rid(request))) as events:
                async for ev in events:
                    if ev["type"] == "think_done":
                        think_text = ev.get("think_text")
                    elif ev["type"] == "image":
                        imgs.append(ev)
            imgs.sort(key=lambda e: e.get("index", 0))
            return think_text, imgs

        finished, result = await run_until_disconnect(request, work)
        return result if finished else None

    async def stream_job(request: Request, job: ImageJob, convert: Callable[[dict], list[dict]],
                         head: list[dict], tail: list[dict]):
        """SSE of a job. Waits for the first engine event so early failures keep their status."""
        events = state["orch"].run(job, rid(request))
        try:
            first = await events.__anext__()
            # an empty think_done says nothing to the client: wait until generation has accepted
            # the job, so that its rejection (4xx) or absence (503) is still the response status
            while first["type"] == "think_done" and not convert(first):
                first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await events.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                for c in head:
                    yield sse(c)
                if first is not None:
                    for c in convert(first):
                        yield sse(c)
                    async for ev in events:
                        for c in convert(ev):
                            yield sse(c)
                for c in tail:
                    yield sse(c)
            except APIError as err:
                yield sse({"type": "error", "status": err.status, "error": err.body()["error"]})
            except Exception as exc:  # a bug, but the client still gets a well-formed end
                log.exception("image stream failed")
                err = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
                yield sse({"type": "error", "status": 500, "error": err.body()["error"]})
            finally:
                with anyio.CancelScope(shield=True):
                    await events.aclose()
            yield sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    def image_items(job: ImageJob, imgs: list[dict], think_text: str | None) -> list[dict]:
        items = []
        for im in imgs:
            fmt = im.get("format", job.output_format)
            item = {"revised_prompt": think_text, "seed": im.get("seed", job.seed)}
            if im.get("branch_steps"):   # denoising steps each CFG branch computed / reused
                item["branch_steps"] = im["branch_steps"]
            if job.response_format == "url":
                item["url"] = data_url(im["b64"], fmt)
            else:
                item["b64_json"] = im["b64"]
            items.append(item)
        return items

    async def serve_image_job(request: Request, job: ImageJob, event_prefix: str):
        created = int(time.time())
        if not job.stream:
            result = await collect_job(request, job)
            if result is None:
                return Response(status_code=499)
            think_text, imgs = result
            out = {"created": created, "data": image_items(job, imgs, think_text),
                   "output_format": job.output_format, "size": job.size,
                   "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}}
            if think_text:
                out["think_text"] = think_text
            return out

        def convert(ev: dict) -> list[dict]:
            kind = ev["type"]
            if kind == "think_delta" and ev["text"]:
                return [{"type": f"{event_prefix}.think_delta", "text": ev["text"]}]
            if kind == "progress":
                return [{"type": f"{event_prefix}.progress", "step": ev.get("step"),
                         "total": ev.get("total")}]
            if kind == "image":
                out = {"type": f"{event_prefix}.completed", "index": ev.get("index", 0),
                       "created_at": created, "output_format": ev.get("format", job.output_format),
                       "size": f"{ev.get('width', job.width)}x{ev.get('height', job.height)}",
                       "seed": ev.get("seed", job.seed), "background": "opaque", "quality": "auto"}
                if ev.get("branch_steps"):
                    out["branch_steps"] = ev["branch_steps"]
                if job.response_format == "url":
                    out["url"] = data_url(ev["b64"], out["output_format"])
                else:
                    out["b64_json"] = ev["b64"]
                return [out]
            if kind == "think_done" and ev.get("think_text"):
                return [{"type": f"{event_prefix}.think_done", "text": ev["think_text"]}]
            return []

        return await stream_job(request, job, convert, [], [])

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        body = await read_json(request)
        opts = Options(merge_options(body))
        job = build_job(cfg, opts, "t2i", opts.raw("prompt"))
        return await serve_image_job(request, job, "image_generation")

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            body = await read_json(request)
            values = merge_options(body)
            raw_images = values.pop("image", None)
            if raw_images is None:
                raw_images = values.pop("image[]", None)
            if isinstance(raw_images, str):
                raw_images = [raw_images]
            if not isinstance(raw_images, list):
                raise bad_request("'image' is required (1 to "
                                  f"{cfg.max_input_images} images)", param="image",
                                  code="missing_required_parameter")
            blobs = [decode_b64_or_data_url(x, "image") for x in raw_images]
            opts = Options(values)
        elif ctype.startswith("multipart/form-data"):
            try:
                form = await request.form(max_files=cfg.max_input_images + 4,
                                          max_part_size=1024 * 1024)
            except APIError:
                raise
            except Exception as exc:  # the multipart parser's own errors are client errors
                raise bad_request(f"malformed multipart body: {exc}", code="invalid_multipart") \
                    from None
            values: dict[str, Any] = {}
            blobs = []
            for key, value in form.multi_items():
                if key in ("image", "image[]", "url", "url[]"):
                    if isinstance(value, UploadFile):
                        blobs.append(await value.read())
                    else:
                        blobs.append(decode_b64_or_data_url(value, "image"))
                elif isinstance(value, UploadFile):
                    raise bad_request(f"unexpected file field {key!r}", param=key)
                else:
                    values[key] = value
            opts = Options(merge_options(values), form=True)
        else:
            raise bad_request("POST /v1/images/edits takes multipart/form-data (or JSON with "
                              "data-URL images)", code="invalid_content_type")
        if not blobs:
            raise bad_request(f"'image' is required (1 to {cfg.max_input_images} images)",
                              param="image", code="missing_required_parameter")
        if len(blobs) > cfg.max_input_images:
            raise bad_request(f"at most {cfg.max_input_images} input images, got {len(blobs)}",
                              param="image", code="too_many_images")
        sizes = []
        for blob in blobs:
            sizes.append(await anyio.to_thread.run_sync(check_image, blob, "image"))
        job = build_job(cfg, opts, "edit", opts.raw("prompt"), [b64(b) for b in blobs], sizes[0])
        return await serve_image_job(request, job, "image_edit")

    # outermost but inside Starlette's error handling: ids, access log, limits, API key
    app.add_middleware(GatewayMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       metrics=metrics)
    return app
