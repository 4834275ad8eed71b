"""OpenAI's Responses API: POST /v1/responses (text, or an image through the image_generation tool; streamed,
in the background, stored and continued with previous_response_id), GET / DELETE /v1/responses/{id} and
POST /v1/responses/{id}/cancel. The work is the chat route's and the images API's (responses_run.py); what is
kept, per API key and for how long, is responses_store.py's."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Depends, FastAPI, Request

from services.contract.chat import ChatCompletionRequest
from services.kit.errors import APIError, bad_request
from services.kit.web import ParsedJsonRoute, until_disconnect

from ..context import cache_salt, caller_identity, gateway, request_id
from ..jobs import build_job, check_options
from ..relay import client_gone, stream_events
from ..responses_feed import EventFeed
from ..responses_input import last_user_images, last_user_text, read_input, with_image
from ..responses_models import QUALITY_STEPS, ImageGenerationTool, ResponseObject, ResponsesRequest, ResponseStreamEvent
from ..responses_run import ResponseRun, response_object
from ..responses_store import ResponseStore, Stored, new_id
from ..schemas import ERRORS, sse_content
from ..state import GatewayState
from .chat import image_parts

router = APIRouter(tags=["responses"], route_class=ParsedJsonRoute)
log = logging.getLogger("u1serve.gateway")
STREAM_DOC = {200: {"description": "the response; with stream: SSE events (response.created ... response.completed)",
                    "content": sse_content(ResponseStreamEvent)}}


def store_of(request: Request) -> ResponseStore:
    """The app's response store, made on first use."""
    app_state = request.app.state
    if getattr(app_state, "responses", None) is None:
        app_state.responses = ResponseStore(app_state.gateway.config)
    return app_state.responses


async def shutdown(app: FastAPI) -> None:
    """Background responses end with the gateway (their engines are told to stop)."""
    if getattr(app.state, "responses", None) is not None:
        await app.state.responses.cancel_all()


# ------------------------------------------------------------------------------------------ one request's plan
def _image_options(tool: ImageGenerationTool, think: bool, default_steps: int) -> ImageGenerationTool:
    if tool.background == "transparent":
        raise bad_request("background 'transparent' is not served: the images are opaque", param="tools[0].background",
                          code="unsupported_value")
    if tool.n != 1:
        raise bad_request("the image_generation tool makes one image per response", param="tools[0].n")
    update: dict[str, Any] = {}
    if tool.num_inference_steps is None and tool.quality != "auto":
        update["num_inference_steps"] = max(1, round(default_steps * QUALITY_STEPS[tool.quality]))
    if "think" not in tool.model_fields_set:
        update["think"] = think
    return tool.model_copy(update=update)


async def _image_run(request: Request, state: GatewayState, req: ResponsesRequest, tool: ImageGenerationTool,
                     turn_messages: list[dict], last_image: Optional[str], response: dict) -> ResponseRun:
    prompt = last_user_text(turn_messages)
    if not prompt.strip():
        raise bad_request("the image_generation tool needs a user message with text: it is the image prompt",
                          param="input")
    opts = _image_options(tool, req.thinking, state.config.sampler.num_inference_steps)
    images = last_user_images(turn_messages) or ([last_image] if last_image else [])
    mode = "edit" if images else "t2i"
    sampler = check_options(state.config, opts, mode, prompt)   # before any image is decoded
    checked = await state.images.check([(f"input image {k}", ref) for k, ref in enumerate(images)])
    job = build_job(state.config, opts, mode=mode, prompt=prompt, request_id=request_id(request),
                    images=[c.b64 for c in checked],
                    first_image_wh=(checked[0].width, checked[0].height) if checked else None,
                    cache_salt=cache_salt(request, state, None), lora=state.adapters.resolve(req.model or tool.model),
                    checked=sampler)
    fields = {"action": "edit" if images else "generate", "size": job.size, "quality": tool.quality,
              "background": "opaque", "output_format": job.output_format}
    return ResponseRun(state, response, rid=job.request_id, job=job, image_fields=fields)


async def _text_run(request: Request, state: GatewayState, req: ResponsesRequest, messages: list[dict],
                    response: dict) -> ResponseRun:
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True},
                            "chat_template_kwargs": {"enable_thinking": req.thinking}}
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("seed", req.seed),
                        ("max_tokens", req.max_output_tokens)):
        if value is not None:
            chat[name] = value
    chat_req = ChatCompletionRequest.model_validate(chat)
    await state.images.check(image_parts(chat_req, state.config.max_chat_images))
    body = chat_req.model_dump(mode="json", exclude_unset=True)
    salt = cache_salt(request, state, None)
    if salt is not None:
        body["cache_salt"] = salt
    return ResponseRun(state, response, rid=request_id(request), chat_body=body)


# ------------------------------------------------------------------------------------------ routes
@router.post("/v1/responses", response_model=ResponseObject, responses={**ERRORS, **STREAM_DOC})
async def create_response(req: ResponsesRequest, request: Request, state: GatewayState = Depends(gateway)):
    """A response: text, or an image with the image_generation tool; `store` keeps it for
    previous_response_id and GET; `background` answers at once (poll GET, POST .../cancel)."""
    store, owner = store_of(request), caller_identity(request).owner
    prev = store.get(owner, req.previous_response_id, "previous_response_id") if req.previous_response_id else None
    if prev is not None and not prev.done:
        raise bad_request(f"response {prev.id!r} is still {prev.response['status']}: continue it once it finished",
                          param="previous_response_id")
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "image_generation":
            raise bad_request(f"tool type {tool.get('type')!r} is not served (image_generation)",
                              param=f"tools[{i}].type", code="unsupported_value")
    state.adapters.resolve(req.model)               # an unknown model: 404 before any work
    turn = read_input(req.input, req.instructions)
    messages = (prev.messages if prev is not None else []) + turn.messages
    last_image = turn.last_image or (prev.last_image if prev is not None else None)
    response = response_object(new_id(), req, req.model or state.config.model_name)
    tool = req.image_tool()
    if tool is not None:
        run = await _image_run(request, state, req, tool, turn.messages, last_image, response)
    else:
        if prev is not None and prev.made_image and turn.new_images == 0:
            messages = with_image(messages, prev.last_image)     # "what is in it?" about the image it made
        run = await _text_run(request, state, req, messages, response)
    rec = Stored(owner, response, last_image=last_image)

    def record() -> None:
        """The finished response, kept for GET and the next turn (store: true)."""
        if run.image is not None:
            rec.last_image, rec.made_image = run.image, True
        rec.messages = messages + ([{"role": "assistant", "content": run.answer_text}] if run.job is None else [])
        if req.store:
            store.add(rec) if rec.id not in store else store.finished(rec)

    if req.background:
        store.admit_background()
        store.add(rec)
        feed = EventFeed() if req.stream else None
        rec.task = asyncio.create_task(_background(run, rec, record, feed))
        if feed is None:
            return run.snapshot()
        rec.task.add_done_callback(lambda _: feed.close())      # a cancel before it began ends the stream too
        return await stream_events(request, feed.events(), lambda ev: [ev])   # numbered by the feed
    if req.stream:
        counter = itertools.count()
        return await stream_events(request, _recorded(run, record),
                                   lambda ev: [{**ev, "sequence_number": next(counter)}])

    async def work() -> None:
        async with contextlib.aclosing(_recorded(run, record)) as events:
            async for _ in events:
                pass

    finished, _ = await until_disconnect(request, work)
    if not finished:
        return client_gone()
    return run.snapshot()


async def _recorded(run: ResponseRun, record) -> AsyncIterator[dict]:
    async with contextlib.aclosing(run.events()) as events:
        async for ev in events:
            yield ev
    record()


async def _background(run: ResponseRun, rec: Stored, record, feed: Optional[EventFeed] = None) -> None:
    """A background response's work: to its end whatever the client does, or until cancelled. With `feed` (it
    was asked with stream) its events go there too, from its creation (queued) on; a cancel ends that stream."""
    say = feed.put if feed is not None else (lambda ev: None)
    say({"type": "response.created", "response": run.snapshot(output=False)})
    say({"type": "response.queued", "response": run.snapshot(output=False)})
    try:
        async with contextlib.aclosing(run.events(raise_early=False)) as events:
            async for ev in events:
                say(ev)
    except asyncio.CancelledError:
        run.response["status"] = "cancelled"
        for item in run.response["output"]:
            if item.get("status") not in ("completed", "incomplete"):
                item["status"] = "incomplete"
    except Exception as exc:          # a bug: the response still ends, failed
        log.exception("background response %s failed", rec.id)
        run.fail(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
        say({"type": "response.failed", "response": run.snapshot()})
    record()


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS)
async def retrieve_response(response_id: str, request: Request):
    """A stored response (this API key's), as it is now: a background one while it runs too."""
    return _snapshot(store_of(request).get(caller_identity(request).owner, response_id))


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=ERRORS)
async def cancel_response(response_id: str, request: Request):
    """Cancel a background response: its engines stop, its status becomes `cancelled` (a finished one is
    returned as it is)."""
    store = store_of(request)
    rec = store.get(caller_identity(request).owner, response_id)
    if rec.task is None:
        raise bad_request("only background responses can be cancelled", param="response_id")
    if not rec.task.done():
        rec.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(rec.task)
    if not rec.done:                     # cancelled before its work began
        rec.response["status"] = "cancelled"
        store.finished(rec)
    return _snapshot(rec)


@router.delete("/v1/responses/{response_id}", responses=ERRORS)
async def delete_response(response_id: str, request: Request):
    """Forget a stored response (a running background one is cancelled first)."""
    store = store_of(request)
    rec = store.get(caller_identity(request).owner, response_id)
    if rec.task is not None and not rec.task.done():
        rec.task.cancel()
    store.forget(rec.id)
    return {"id": rec.id, "object": "response.deleted", "deleted": True}


def _snapshot(rec: Stored) -> dict:
    return {**rec.response, "output": list(rec.response["output"])}
