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

from .. import textgen
from ..inputs import image_refs, prompt_messages, text_params
from ..state import app_state
from .responses import sse_response, until_done_or_gone

router = APIRouter()


def _enable_thinking(req: ChatCompletionRequest):
    """False unless asked: True opens <think> in the prompt, an explicit null lets the model decide."""
    kw = req.chat_template_kwargs
    return kw.enable_thinking if kw is not None and "enable_thinking" in kw.model_fields_set else False


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    st = app_state(request)
    req = ChatCompletionRequest.model_validate(await json_body(request))
    if req.wants_image:
        raise bad_request("image output is served by the gateway's /v1/chat/completions, not by the "
                          "understanding service", "modalities")
    think = _enable_thinking(req)
    st.require_engine()
    admission = st.admit()
    try:
        pils = await st.images.decode(image_refs(req.messages), st.limits.min_pixels, st.limits.max_pixels)
        inp = await st.build_prompt(PR.chat_input, st.tok, prompt_messages(req.messages, pils), think,
                                    st.limits.min_pixels, st.limits.max_pixels)
        params = text_params(req, len(inp.input_ids), st.limits)
        rid = st.engine_rid(request.state.request_id)
        gen = textgen.generate(st, rid, inp, params, think, req.cache_salt)
        if req.stream:
            # run up to the first event so an immediate error is still a plain 4xx/5xx response
            first = await anext(gen, None)
    except BaseException:
        admission.close()
        raise
    created, model, resp_id = int(time.time()), st.model_name, f"chatcmpl-{uuid.uuid4().hex}"

    async def cleanup():
        await gen.aclose()       # aborts the engine request if it did not finish
        admission.close()

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta, finish=None):
            return {"id": resp_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        async def events():
            usage = None
            try:
                yield sse.encode(chunk({"role": "assistant", "content": ""}))
                ev = first
                while ev is not None:
                    delta = {}
                    if ev["reasoning"]:
                        delta["reasoning_content"] = ev["reasoning"]
                    if ev["content"]:
                        delta["content"] = ev["content"]
                    if delta or (req.return_token_ids and ev["ids"]):
                        c = chunk(delta)
                        if req.return_token_ids:
                            c["choices"][0]["token_ids"] = ev["ids"]
                        yield sse.encode(c)
                    if "finish_reason" in ev:
                        usage = ev["usage"]
                        st.metrics.requests.labels("chat", ev["finish_reason"]).inc()
                        yield sse.encode(chunk({}, ev["finish_reason"]))
                        break
                    ev = await anext(gen, None)
                if include_usage and usage:
                    yield sse.encode({"id": resp_id, "object": "chat.completion.chunk", "created": created,
                                      "model": model, "choices": [], "usage": usage})
            except APIError as e:
                yield sse.encode(e.body())
            yield sse.encode(sse.DONE)

        return sse_response(events(), cleanup)

    async def collect():
        reasoning, content, ids, final = [], [], [], None
        async for ev in gen:
            reasoning.append(ev["reasoning"])
            content.append(ev["content"])
            ids.extend(ev["ids"])
            if "finish_reason" in ev:
                final = ev
        return "".join(reasoning), "".join(content), ids, final

    finished, res = await until_done_or_gone(request, collect, cleanup)
    if not finished:
        return Response(status_code=499)
    reasoning, content, ids, final = res
    st.metrics.requests.labels("chat", final["finish_reason"]).inc()
    message = {"role": "assistant", "content": content}
    if think is not False:
        message["reasoning_content"] = reasoning or None
    choice = {"index": 0, "message": message, "finish_reason": final["finish_reason"], "logprobs": None}
    if req.return_token_ids:
        stop_ids = set(st.stop_ids(params))
        choice["token_ids"] = [t for t in ids if t not in stop_ids]
    return {"id": resp_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": final["usage"]}
