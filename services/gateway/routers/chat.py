"""POST /v1/chat/completions. A text chat is validated here (ChatCompletionRequest, every image part checked)
and proxied to understanding as the validated request: the fields the contract declares, nothing else. `modalities: ["image"]` makes
an image from the last user turn instead (its images make it an edit); `modalities: ["text", "image"]` an
interleaved answer (interleave.py): text and generated images in order."""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any, Optional

import anyio
import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from services.contract import limits as L
from services.contract.chat import ChatCompletionRequest, ChatImageOptions, ChatMessage, ImagePart, content_runs
from services.contract.image import ImageOptions, merge_options
from services.kit import sse
from services.kit.errors import APIError, bad_request
from services.kit.streaming import OwnedStream
from services.kit.web import ParsedJsonRoute, json_body, until_disconnect

from .. import interleave
from ..chat_upstream import CHAT_PATH as PATH, UND, abort_chat_later, open_chat
from ..context import cache_salt, gateway, request_id
from ..inputs import data_url
from ..jobs import build_job, check_options, generate_fields
from ..relay import client_gone, collect_job, stream_events, stream_job
from ..routing import conversation_key
from ..schemas import ERRORS, ChatCompletionChunk, ChatCompletionResponse, sse_content
from ..state import GatewayState
from ..upstream import Target, connection_error, engine_headers, error_from_event, is_timeout, reading

router = APIRouter(tags=["chat"], route_class=ParsedJsonRoute)
# image options a chat body may carry at its top level (or under extra_body); chat means other things by these
IMAGE_KEYS = frozenset(ImageOptions.model_fields) - {"n", "stream", "response_format"}

STREAM_DOC = {200: {"description": "JSON, or with stream: SSE chat.completion.chunk events then [DONE]",
                    "content": sse_content(ChatCompletionChunk)}}


def image_parts(req: ChatCompletionRequest, limit: int = L.MAX_CHAT_IMAGES) -> list[tuple[str, str]]:
    """(param, url) of every image part of the conversation; more than `limit` is a 400 before any is read."""
    parts = [(f"messages[{i}].content[{j}]", part.url) for i, m in enumerate(req.messages)
             if isinstance(m.content, list) for j, part in enumerate(m.content) if isinstance(part, ImagePart)]
    if len(parts) > limit:
        raise bad_request(f"{len(parts)} images in one chat request; at most {limit} are allowed",
                          param=parts[limit][0], code="too_many_images")
    return parts


def image_prompt(msg: ChatMessage, param: str) -> tuple[str, list[tuple[str, str]], list[int]]:
    """A user message (`param` names it) as an image request's prompt: its text parts (joined by newlines where
    two touch), its images as (param, url) (they make the request an edit) and where each stands in the prompt
    (character offsets, from the parts' order: PrefixRequest.image_offsets)."""
    runs, pics = content_runs(msg.content, sep="\n")
    text = "".join(runs)
    if not text.strip():
        raise bad_request("the last user message needs text: it is the image prompt", param=param)
    where = [j for j, p in enumerate(msg.content) if isinstance(p, ImagePart)] if pics else []
    images = [(f"{param}.content[{j}]", p.url) for j, p in zip(where, pics)]
    return text, images, list(itertools.accumulate(len(r) for r in runs[:-1]))


def last_user_turn(req: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]], list[int]]:
    """The image prompt of a chat request: its last user message's (image_prompt)."""
    i, msg = [(i, m) for i, m in enumerate(req.messages) if m.role == "user"][-1]
    return image_prompt(msg, f"messages[{i}]")


def chat_image_options(body: dict, req: ChatCompletionRequest) -> ChatImageOptions:
    """The image options of a chat request: image fields at the top level or under extra_body (aliases such as
    flow_shift included), overridden by `image_config`; `think` follows chat_template_kwargs.enable_thinking
    unless given."""
    try:
        flat = merge_options(body)
        opts = {k: v for k, v in flat.items() if k in IMAGE_KEYS}
        if isinstance(flat.get("image_config"), dict):
            opts.update(merge_options(flat["image_config"]))
    except ValueError as exc:      # an option given twice, extra_body not an object
        raise bad_request(str(exc), param=(getattr(exc, "context", None) or {}).get("param")) from None
    thinking = req.chat_template_kwargs.enable_thinking if req.chat_template_kwargs else None
    if "think" not in opts and thinking is not None:
        opts["think"] = thinking
    opts["stream"] = req.stream
    return ChatImageOptions.model_validate(opts)


@router.post(PATH, response_model=ChatCompletionResponse, response_model_exclude_none=True,
             responses={**ERRORS, **STREAM_DOC})
async def chat_completions(req: ChatCompletionRequest, request: Request, state: GatewayState = Depends(gateway)):
    """OpenAI chat completions (plus the vLLM-style sampling extensions), or an image with modalities ['image']."""
    body = await json_body(request)
    salt = cache_salt(request, state, req.cache_salt)
    state.adapters.resolve(req.model)   # an unknown model: 404 before any work (understanding resolves it again)
    if req.wants_interleave:
        return await chat_interleave(request, state, req, body, salt)
    if req.wants_image:
        return await chat_image(request, state, req, body, salt)
    await state.images.check(image_parts(req, state.config.max_chat_images))
    body = req.model_dump(mode="json", exclude_unset=True)    # known fields only: unknown ones stay here
    if salt is not None:
        body["cache_salt"] = salt
    if req.stream:
        return await proxy_stream(request, state, body)
    return await proxy(request, state, body)


# ------------------------------------------------------------------------------------------ text: proxied
async def proxy(request: Request, state: GatewayState, body: dict):
    """A non-streamed chat: the answer comes in one piece, so only the request deadline bounds the wait."""
    rid, deadline, target = request_id(request), state.deadline(), Target(key=conversation_key(body))
    hdrs = engine_headers(state.config.internal_token, rid)

    async def call() -> bytes:
        resp = await open_chat(state, body, hdrs, deadline, target, idle=False)
        async with reading(state.und, target.ep, resp):
            return await deadline.wait(resp.aread(), UND, idle=False)

    try:
        finished, raw = await until_disconnect(request, call)
    except APIError as err:
        if is_timeout(err):
            state.metrics.timeouts.labels(err.code).inc()
            abort_chat_later(state, target, hdrs, rid)
        raise
    if not finished:
        state.metrics.cancelled.inc()
        abort_chat_later(state, target, hdrs, rid)
        return client_gone()
    try:
        return JSONResponse(json.loads(raw))
    except ValueError:
        raise APIError(502, "understanding service returned a non-JSON body", code="upstream_protocol_error") from None


def _first_event_error(line: str) -> Optional[APIError]:
    """An error as the stream's first event (e.g. a 429) is still the response status."""
    ev = next(iter(sse.events([line])), None)
    if ev is not None and "error" in ev and isinstance(ev.get("status"), int):
        return error_from_event(ev, UND)
    return None


async def proxy_stream(request: Request, state: GatewayState, body: dict):
    """A streamed chat, relayed line by line. No line within the idle limit (or the deadline passing) ends it
    with an error event and [DONE] and aborts the engine's work, as a client that goes away does."""
    rid, deadline, target = request_id(request), state.deadline(), Target(key=conversation_key(body))
    hdrs = engine_headers(state.config.internal_token, rid)
    resp: Optional[httpx.Response] = None
    try:
        resp = await open_chat(state, body, hdrs, deadline, target, idle=True)
        lines = deadline.lines(resp, UND)
        head: list[str] = []
        try:
            async for line in lines:
                head.append(line)
                if line.startswith("data:"):
                    err = _first_event_error(line)
                    if err is not None:
                        raise err
                    break
        except httpx.TransportError as exc:
            state.und.down(target.ep)
            raise connection_error(UND, target.ep.url, exc) from None
    except BaseException as exc:
        if isinstance(exc, APIError) and is_timeout(exc):
            state.metrics.timeouts.labels(exc.code).inc()
            abort_chat_later(state, target, hdrs, rid)
        elif isinstance(exc, asyncio.CancelledError):
            abort_chat_later(state, target, hdrs, rid)
        if resp is not None:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
        raise
    ep = target.ep
    ep.in_flight += 1
    progress = {"outcome": "streaming"}       # -> done | timeout; still streaming when closed = client gone

    async def relay():
        try:
            for line in head:
                yield (line + "\n").encode()
            async for line in lines:
                yield (line + "\n").encode()
            progress["outcome"] = "done"
        except APIError as err:              # the idle limit or the deadline
            progress["outcome"] = "timeout"
            state.metrics.timeouts.labels(err.code).inc()
            yield sse.encode(err.event())
            yield sse.encode(sse.DONE)
        except httpx.TransportError as exc:  # the engine went away: nothing left to abort
            progress["outcome"] = "done"
            state.und.down(ep)
            yield sse.encode(connection_error(UND, ep.url, exc).event())
            yield sse.encode(sse.DONE)

    async def close():
        ep.in_flight -= 1
        await resp.aclose()
        if progress["outcome"] == "streaming":
            state.metrics.cancelled.inc()
        if progress["outcome"] != "done":
            abort_chat_later(state, target, hdrs, rid)

    return OwnedStream(relay(), on_close=close)


# ------------------------------------------------------------------------------------------ image modality
def partial_image_delta(index: int, ev: dict) -> dict:
    """A generation preview (partial_images) as a chat delta: {index, partial_image_index, image_url}."""
    return {"partial_image": {"index": index, "partial_image_index": ev["partial_image_index"],
                              "image_url": {"url": data_url(ev["b64"], ev.get("format", "jpeg"))}}}


async def chat_image(request: Request, state: GatewayState, req: ChatCompletionRequest, body: dict,
                     salt: Optional[str]):
    opts = chat_image_options(body, req)
    if req.n != 1:
        raise bad_request("an image answer has one choice (image_config.n sets the images): n must be 1",
                          param="n")
    if isinstance(opts.size, list):
        raise bad_request("a list of sizes is for interleaved answers (modalities ['text', 'image']); an image "
                          "answer takes one size", param="image_config.size")
    prompt, parts, offsets = last_user_turn(req)
    mode = "edit" if parts else "t2i"
    sampler = check_options(state.config, opts, mode, prompt)   # before any image is decoded
    checked = await state.images.check(parts)
    job = build_job(state.config, opts, mode=mode, prompt=prompt, request_id=request_id(request),
                    images=[c.b64 for c in checked],
                    first_image_wh=(checked[0].width, checked[0].height) if checked else None, cache_salt=salt,
                    lora=state.adapters.resolve(req.model), image_offsets=offsets or None, checked=sampler)
    cid, created, model = "chatcmpl-" + job.request_id, int(time.time()), req.model or state.config.model_name

    def part(ev: dict) -> dict:
        return {"type": "image_url", "image_url": {"url": data_url(ev["b64"], ev.get("format", job.output_format))}}

    if not job.stream:
        result = await collect_job(request, state, job)
        if result is None:
            return client_gone()
        think_text, images = result
        parts_out = [part(im) for im in images]
        message: dict[str, Any] = {"role": "assistant", "content": parts_out, "images": parts_out}
        if think_text:
            message["reasoning_content"] = think_text
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}

    def chunk(delta: dict, finish: Optional[str] = None) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def convert(ev: dict) -> list[dict]:
        if ev.get("type") == "think_delta" and ev.get("text"):
            return [chunk({"reasoning_content": ev["text"]})]
        if ev.get("type") == "image":
            return [chunk({"images": [part(ev)]})]
        if ev.get("type") == "partial_image":
            return [chunk(partial_image_delta(ev.get("index", 0), ev))]
        return []

    return await stream_job(request, state, job, convert, head=[chunk({"role": "assistant", "content": ""})],
                            tail=[chunk({}, "stop")])


# ------------------------------------------------------------------------------------------ interleaved answers
async def chat_interleave(request: Request, state: GatewayState, req: ChatCompletionRequest, body: dict,
                          salt: Optional[str]):
    """modalities ['text', 'image']: text and generated images in one answer (greedy text as the official
    interleave_gen; think mode unless enable_thinking is false; image_config.size one size for every image or a
    list, one per image, the last repeated)."""
    opts = chat_image_options(body, req)
    if opts.n != 1:
        raise bad_request("an interleaved answer makes its images one at a time: image_config.n must be 1",
                          param="image_config.n")
    if req.n != 1:
        raise bad_request("an interleaved answer has one choice: n must be 1", param="n")
    interleave.image_sizes(state.config, opts, None)         # explicit sizes: before any image is decoded
    first = opts.model_copy(update={"size": opts.sizes[0]})
    sampler = check_options(state.config, first, "edit", "")
    checked = await state.images.check(image_parts(req, state.config.max_chat_images))
    first_wh = (checked[0].width, checked[0].height) if checked else None
    generate = generate_fields(state.config, first, mode="edit", prompt="", first_image_wh=first_wh,
                               checked=sampler, export_image=True)
    lora = state.adapters.resolve(req.model)
    if lora is not None:
        generate["lora"] = lora
    answer = interleave.Answer(
        request_id=request_id(request), messages=[m.model_dump(mode="json", exclude_none=True) for m in req.messages],
        think=opts.think if "think" in opts.model_fields_set else True,
        max_tokens=interleave.default_max_tokens(req.max_tokens), max_images=opts.max_images, generate=generate,
        sizes=interleave.image_sizes(state.config, opts, first_wh), logit_bias=req.logit_bias, cache_salt=salt,
        lora=lora, return_token_ids=req.return_token_ids)
    cid, created, model = "chatcmpl-" + answer.request_id, int(time.time()), req.model or state.config.model_name
    fmt = opts.output_format

    def image_part(ev: dict) -> dict:
        return {"type": "image_url", "image_url": {"url": data_url(ev["b64"], ev.get("format", fmt))}}

    if not req.stream:
        async def work():
            reasoning, parts, images, done, token_ids = [], [], [], None, []
            async for ev in interleave.run(state, answer, state.deadline()):
                kind = ev["type"]
                token_ids += ev.get("token_ids") or []
                if kind == "text":
                    reasoning.append(ev.get("reasoning") or "")
                    if ev.get("content"):
                        if parts and parts[-1]["type"] == "text":
                            parts[-1]["text"] += ev["content"]
                        else:
                            parts.append({"type": "text", "text": ev["content"]})
                elif kind == "image":
                    images.append(image_part(ev))
                    parts.append(images[-1])
                elif kind == "done":
                    done = ev
            return "".join(reasoning), parts, images, done, token_ids

        finished, result = await until_disconnect(request, work)
        if not finished:
            return client_gone()
        reasoning, parts, images, done, token_ids = result
        message: dict[str, Any] = {"role": "assistant", "content": parts, "images": images}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "finish_reason": done["finish_reason"]}
        out = {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
               "usage": done["usage"]}
        if req.return_token_ids:         # vLLM's fields: the prompt's ids on the response, the answer's on the choice
            choice["token_ids"] = token_ids
            out["prompt_token_ids"] = done.get("prompt_token_ids")
        return out

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict, finish: Optional[str] = None) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    head = [chunk({"role": "assistant", "content": ""})]

    def with_ids(c: dict, ev: dict) -> dict:
        if req.return_token_ids:
            c["choices"][0]["token_ids"] = ev.get("token_ids") or []
        return c

    def convert(ev: dict) -> list[dict]:
        kind = ev["type"]
        if kind == "text":
            if "prompt_token_ids" in ev:     # vLLM puts them on the first chunk (sent after this event)
                head[0]["prompt_token_ids"] = ev["prompt_token_ids"]
            delta = {k: ev[v] for k, v in (("reasoning_content", "reasoning"), ("content", "content")) if ev.get(v)}
            return [with_ids(chunk(delta), ev)] if delta or ev.get("token_ids") else []
        if kind == "image":
            return [with_ids(chunk({"images": [{**image_part(ev), "index": ev["image"]}]}), ev)]
        if kind == "image_progress":
            return [chunk({"image_progress": {"index": ev["image"], "step": ev["step"], "total": ev["total"]}})]
        if kind == "partial_image":
            return [chunk(partial_image_delta(ev["image"], ev))]
        if kind == "done":
            out = [chunk({}, ev["finish_reason"])]
            if include_usage:
                out.append({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": ev["usage"]})
            return out
        return []

    return await stream_events(request, interleave.run(state, answer, state.deadline()), convert, head=head)
