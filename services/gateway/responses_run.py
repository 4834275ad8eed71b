"""One response's work, as OpenAI's Responses stream events, over the gateway's own engine calls: a text answer
is understanding's chat stream (the chat route's body and upstream calls), an image answer an image job on the
orchestrator (the images API's job). `ResponseRun.events` yields the events without sequence numbers and keeps
`response` (the object GET /v1/responses/{id} shows) up to date as they go.

An error before the engines accepted the work propagates as an APIError (a 4xx, 429, 503 is the HTTP status
of a foreground request); after it, it becomes an `error` event and `response.failed`. Closing the iterator
(client gone, cancel) stops the engines' work."""
from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, AsyncIterator, Optional

from services.kit import sse
from services.kit.errors import APIError

from .chat_upstream import UND, abort_chat_later, open_chat
from .jobs import ImageJob
from .responses_store import new_id
from .routing import conversation_key
from .state import GatewayState
from .upstream import Target, engine_headers, error_from_event, reading


def response_object(rid: str, req: Any, model: str) -> dict:
    """A new response object (status in_progress; queued for a background one until it starts)."""
    return {"id": rid, "object": "response", "created_at": int(time.time()),
            "status": "queued" if req.background else "in_progress", "background": req.background, "error": None,
            "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": model, "output": [], "parallel_tool_calls": False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice, "tools": req.tools, "top_p": req.top_p, "truncation": "disabled",
            "usage": None, "metadata": req.metadata or {}}


def usage_of(chat_usage: Optional[dict]) -> dict:
    """A chat usage (prompt_tokens_details.cached_tokens: the prefix cache's hit) as Responses usage."""
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0), "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.get("total_tokens", 0)}


async def chat_chunks(state: GatewayState, body: dict, rid: str) -> AsyncIterator[dict]:
    """Understanding's streamed chat chunks for `body` (a validated chat request with stream: true); an error
    event is raised. The engine is told to stop when the iterator is closed early."""
    deadline, target = state.deadline(), Target(key=conversation_key(body))
    hdrs = engine_headers(state.config.internal_token, rid)
    finished = False
    try:
        resp = await open_chat(state, body, hdrs, deadline, target, idle=True)
        async with reading(state.und, target.ep, resp):
            async for ev in sse.aevents(deadline.lines(resp, UND)):
                if "error" in ev:
                    finished = True
                    raise error_from_event(ev, UND)
                yield ev
        finished = True
    finally:
        if not finished:
            abort_chat_later(state, target, hdrs, rid)


class ResponseRun:
    def __init__(self, state: GatewayState, response: dict, *, rid: str, chat_body: Optional[dict] = None,
                 job: Optional[ImageJob] = None, image_fields: Optional[dict] = None):
        """rid: the engine-facing request id; chat_body: a text answer; job (+ the image_generation_call fields
        echoed: size, quality, ...): an image."""
        self.state, self.response, self.chat_body, self.job, self.rid = state, response, chat_body, job, rid
        self.image_fields = image_fields or {}
        self.started = False
        self.answer_text = ""                 # the message's text (the next turn's assistant message)
        self.image: Optional[str] = None      # the generated image (base64)
        self._open: dict[str, dict] = {}      # "reasoning" / "message": the item being written

    # ------------------------------------------------------------------------------------------ items
    def _add(self, item: dict) -> dict:
        self.response["output"].append(item)
        return {"type": "response.output_item.added", "output_index": len(self.response["output"]) - 1,
                "item": copy.deepcopy(item)}

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.response["output"]) if it is item)

    def _reasoning(self, delta: str) -> list[dict]:
        out = []
        item = self._open.get("reasoning")
        if item is None:
            item = self._open["reasoning"] = {"id": new_id("rs_"), "type": "reasoning", "summary": [],
                                              "content": [{"type": "reasoning_text", "text": ""}],
                                              "status": "in_progress"}
            out.append(self._add(item))
        item["content"][0]["text"] += delta
        out.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": self._index(item),
                    "content_index": 0, "delta": delta})
        return out

    def _close_reasoning(self) -> list[dict]:
        item = self._open.pop("reasoning", None)
        if item is None:
            return []
        item["status"] = "completed"
        i = self._index(item)
        return [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": i,
                 "content_index": 0, "text": item["content"][0]["text"]},
                {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(item)}]

    def _text(self, delta: str) -> list[dict]:
        out = self._close_reasoning()
        item = self._open.get("message")
        if item is None:
            item = self._open["message"] = {"id": new_id("msg_"), "type": "message", "role": "assistant",
                                            "status": "in_progress", "content": []}
            out.append(self._add(item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": item["id"],
                        "output_index": self._index(item), "content_index": 0, "part": copy.deepcopy(part)})
        if delta:
            item["content"][0]["text"] += delta
            self.answer_text += delta
            out.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self._index(item),
                        "content_index": 0, "delta": delta, "logprobs": []})
        return out

    def _close_message(self, status: str) -> list[dict]:
        item = self._open.pop("message", None)
        if item is None:
            return []
        item["status"] = status
        i, part = self._index(item), item["content"][0]
        return [{"type": "response.output_text.done", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(item)}]

    def _start(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        self.response["status"] = "in_progress"
        # a background response announced its creation (queued) when it was made (routers/responses.py)
        created = [] if self.response["background"] else [{"type": "response.created",
                                                           "response": self.snapshot(output=False)}]
        return created + [{"type": "response.in_progress", "response": self.snapshot(output=False)}]

    def snapshot(self, output: bool = True) -> dict:
        snap = dict(self.response)
        snap["output"] = copy.deepcopy(self.response["output"]) if output else []
        return snap

    # ------------------------------------------------------------------------------------------ the work
    async def events(self, raise_early: bool = True) -> AsyncIterator[dict]:
        """The response's events, ending with response.completed / .incomplete, or error + response.failed."""
        work = self._image_events() if self.job is not None else self._text_events()
        try:
            async with contextlib.aclosing(work) as events:
                async for ev in events:
                    yield ev
        except APIError as err:
            if raise_early and not self.started:
                raise
            for ev in self._start():
                yield ev
            self.fail(err)
            yield {"type": "error", "code": err.code, "message": err.message, "param": err.param}
            yield {"type": "response.failed", "response": self.snapshot()}
            return
        yield {"type": f"response.{self.response['status']}", "response": self.snapshot()}

    def fail(self, err: APIError) -> None:
        for item in self.response["output"]:
            if item.get("status") not in ("completed", "incomplete"):
                item["status"] = "failed" if item["type"] == "image_generation_call" else "incomplete"
        self.response["status"] = "failed"
        self.response["error"] = {"code": err.code or err.type, "message": err.message}

    async def _text_events(self) -> AsyncIterator[dict]:
        finish, usage = None, None
        async with contextlib.aclosing(chat_chunks(self.state, self.chat_body, self.rid)) as chunks:
            async for chunk in chunks:
                for ev in self._start():
                    yield ev
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    for ev in (self._reasoning(delta["reasoning_content"]) if delta.get("reasoning_content")
                               else []):
                        yield ev
                    if delta.get("content"):
                        for ev in self._text(delta["content"]):
                            yield ev
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        for ev in self._start() + self._close_reasoning() + (self._text("") if "message" not in self._open else []):
            yield ev
        status = "incomplete" if finish == "length" else "completed"
        for ev in self._close_message(status):
            yield ev
        self.response["usage"] = usage_of(usage)
        self.response["status"] = status
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}

    async def _image_events(self) -> AsyncIterator[dict]:
        call: Optional[dict] = None
        revised = None
        async with contextlib.aclosing(self.state.orchestrator.run(self.job, self.state.deadline())) as events:
            async for ev in events:
                for out in self._start():
                    yield out
                kind = ev.get("type")
                if kind == "think_delta" and ev.get("text"):
                    for out in self._reasoning(ev["text"]):
                        yield out
                    continue
                if kind == "think_done":
                    revised = ev.get("think_text")
                    if revised and "reasoning" not in self._open and not self.response["output"]:
                        for out in self._reasoning(revised):
                            yield out
                    continue
                if kind not in ("queued", "progress", "partial_image", "image"):
                    continue
                if call is None:
                    pending = self._close_reasoning()
                    call = {"id": new_id("ig_"), "type": "image_generation_call", "status": "in_progress",
                            "result": None, "revised_prompt": revised, **self.image_fields}
                    pending.append(self._add(call))
                    pending.append({"type": "response.image_generation_call.in_progress", "item_id": call["id"],
                                    "output_index": self._index(call)})
                    for out in pending:
                        yield out
                i = self._index(call)
                if kind in ("progress", "partial_image") and call["status"] == "in_progress":
                    call["status"] = "generating"
                    yield {"type": "response.image_generation_call.generating", "item_id": call["id"],
                           "output_index": i}
                if kind == "partial_image":
                    yield {"type": "response.image_generation_call.partial_image", "item_id": call["id"],
                           "output_index": i, "partial_image_index": ev.get("partial_image_index", 0),
                           "partial_image_b64": ev["b64"].encode(), **self.image_fields,
                           "output_format": ev.get("format", "jpeg")}
                elif kind == "image":
                    call["result"], call["status"] = ev["b64"], "completed"
                    self.image = ev["b64"]
                    yield {"type": "response.image_generation_call.completed", "item_id": call["id"],
                           "output_index": i}
                    yield {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(call)}
        self.response["usage"] = usage_of(None)
        self.response["status"] = "completed"
