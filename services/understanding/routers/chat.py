"""POST /v1/chat/completions (OpenAI; the gateway forwards chat bodies here as they are)."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.contract.chat import ChatCompletionRequest
from services.kit import sse
from services.kit.errors import APIError, bad_request
from services.kit.web import json_body
from services.model import prompts as PR

from ..choices import Choices, merged_usage
from ..inputs import image_refs, prompt_messages, text_params
from ..lora import requested_adapter
from ..state import app_state
from ..responses import sse_response, until_done_or_gone

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    st = app_state(request)
    req = ChatCompletionRequest.model_validate(await json_body(request))
    if req.wants_image or req.wants_interleave:
        raise bad_request("image output is served by the gateway's /v1/chat/completions, not by the "
                          "understanding service", "modalities")
    # absent: the official prompt (ends at 'assistant\n'); false: the empty think block; true: opens <think>
    think = req.thinking
    st.require_engine()
    admission = st.admit(req.n)
    try:
        pils = await st.images.decode(image_refs(req.messages), st.limits.min_pixels, st.limits.max_pixels)
        inp = await st.build_prompt(PR.chat_input, st.tok, prompt_messages(req.messages, pils), think,
                                    st.limits.min_pixels, st.limits.max_pixels)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = text_params(req, len(inp.input_ids), st.limits, logprobs=logprobs)
        rid = st.engine_rid(request.state.request_id)
        choices = Choices(st, rid, inp, params, think, req.n, req.cache_salt, requested_adapter(st, req.model))
        events = choices.events()
        if req.stream:
            # run up to the first event so an immediate error is still a plain 4xx/5xx response
            first = await anext(events)
    except BaseException:
        admission.close()
        raise
    created, model, resp_id = int(time.time()), st.model_name, f"chatcmpl-{uuid.uuid4().hex}"

    async def cleanup():
        await events.aclose()
        await choices.close()     # aborts the engine requests that did not finish
        admission.close()

    def logprobs_of(ev: dict):
        return {"content": ev["logprobs"]} if "logprobs" in ev else None

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(i: int, delta: dict, finish=None, lp=None):
            return {"id": resp_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}]}

        async def stream():
            finals: dict[int, dict] = {}
            try:
                for i in range(req.n):      # vLLM: return_token_ids puts the prompt's ids on the first chunks
                    c = chunk(i, {"role": "assistant", "content": ""})
                    if req.return_token_ids:
                        c["prompt_token_ids"] = list(inp.input_ids)
                    yield sse.encode(c)
                pending = first
                while pending is not None:
                    i, ev = pending
                    delta = {}
                    if ev["reasoning"]:
                        delta["reasoning_content"] = ev["reasoning"]
                    if ev["content"]:
                        delta["content"] = ev["content"]
                    lp = logprobs_of(ev) if ev.get("logprobs") else None
                    if delta or lp or (req.return_token_ids and ev["ids"]):
                        c = chunk(i, delta, lp=lp)
                        if req.return_token_ids:
                            c["choices"][0]["token_ids"] = ev["ids"]
                        yield sse.encode(c)
                    if "finish_reason" in ev:
                        finals[i] = ev
                        st.metrics.requests.labels("chat", ev["finish_reason"]).inc()
                        yield sse.encode(chunk(i, {}, ev["finish_reason"]))
                    pending = await anext(events, None)
                if include_usage and finals:
                    yield sse.encode({"id": resp_id, "object": "chat.completion.chunk", "created": created,
                                      "model": model, "choices": [], "usage": merged_usage(finals)})
            except APIError as e:
                yield sse.encode(e.body())
            yield sse.encode(sse.DONE)

        return sse_response(stream(), cleanup)

    async def collect():
        got = {i: {"reasoning": [], "content": [], "ids": [], "logprobs": [], "final": None} for i in range(req.n)}
        async for i, ev in events:
            g = got[i]
            g["reasoning"].append(ev["reasoning"])
            g["content"].append(ev["content"])
            g["ids"].extend(ev["ids"])
            g["logprobs"].extend(ev.get("logprobs") or [])
            if "finish_reason" in ev:
                g["final"] = ev
        return got

    finished, got = await until_done_or_gone(request, collect, cleanup)
    if not finished:
        return Response(status_code=499)
    out = []
    for i in range(req.n):
        g = got[i]
        st.metrics.requests.labels("chat", g["final"]["finish_reason"]).inc()
        message = {"role": "assistant", "content": "".join(g["content"])}
        if think is not False:
            message["reasoning_content"] = "".join(g["reasoning"]) or None
        choice = {"index": i, "message": message, "finish_reason": g["final"]["finish_reason"],
                  "logprobs": {"content": g["logprobs"]} if req.logprobs else None}
        if req.return_token_ids:     # as vLLM's: the stop token (EOS / a stop_token_ids id) that ended it included
            choice["token_ids"] = g["ids"]
        out.append(choice)
    resp = {"id": resp_id, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": merged_usage({i: got[i]["final"] for i in range(req.n)})}
    if req.return_token_ids:
        resp["prompt_token_ids"] = list(inp.input_ids)
    return resp
