"""POST /generate, /generate_stream: the LightLLM-style native API (the prompt is sent as text, chat template
included; `<image>` marks where each image of multimodal_params goes)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.kit import sse
from services.kit.errors import APIError
from services.kit.web import json_body
from services.model import prompts as PR

from .. import textgen
from ..inputs import NativeRequest, native_sampling, text_params
from ..state import app_state
from ..responses import sse_response, until_done_or_gone

router = APIRouter()


def _expand(tok, text: str, pils: list, min_pixels: int, max_pixels: int) -> PR.PromptInput:
    from services.model.images import preprocess
    tensors = [preprocess(p, min_pixels, max_pixels) for p in pils]
    missing = len(tensors) - text.count(PR.IMAGE_PLACEHOLDER)
    return PR.expand_images(tok, (PR.IMAGE_PLACEHOLDER + "\n") * max(0, missing) + text, tensors)


async def _start(request: Request):
    """Validate, admit, build the prompt: (state, generator, prompt, params, cleanup)."""
    st = app_state(request)
    req = NativeRequest.model_validate(await json_body(request))
    sampling = native_sampling(req.parameters)
    st.require_engine()
    admission = st.admit()
    try:
        pils = await st.images.decode(req.image_refs(), st.limits.min_pixels, st.limits.max_pixels)
        inp = await st.build_prompt(_expand, st.tok, req.inputs, pils, st.limits.min_pixels, st.limits.max_pixels)
        params = text_params(sampling, len(inp.input_ids), st.limits, "inputs")
        rid = st.engine_rid(request.state.request_id)
        gen = textgen.generate(st, rid, inp, params, False, sampling.cache_salt)
    except BaseException:
        admission.close()
        raise

    async def cleanup():
        await gen.aclose()       # aborts the engine request if it did not finish
        admission.close()
    return st, gen, inp, params, cleanup


@router.post("/generate")
async def generate(request: Request):
    st, gen, inp, params, cleanup = await _start(request)

    async def collect():
        text, ids, final = [], [], None
        async for ev in gen:
            text.append(ev["content"])
            ids.extend(ev["ids"])
            if "finish_reason" in ev:
                final = ev
        return "".join(text), ids, final

    finished, res = await until_done_or_gone(request, collect, cleanup)
    if not finished:
        return Response(status_code=499)
    text, ids, final = res
    st.metrics.requests.labels("generate", final["finish_reason"]).inc()
    stop_ids = set(st.stop_ids(params))
    return {"generated_text": [text], "count_output_tokens": len(ids), "finish_reason": final["finish_reason"],
            "prompt_tokens": len(inp.input_ids), "token_ids": [t for t in ids if t not in stop_ids],
            "cached_tokens": final["usage"]["prompt_tokens_details"]["cached_tokens"]}


@router.post("/generate_stream")
async def generate_stream(request: Request):
    st, gen, inp, params, cleanup = await _start(request)

    async def events():
        count = 0
        try:
            async for ev in gen:
                count += len(ev["ids"])
                done = "finish_reason" in ev
                yield sse.encode({"token": {"id": ev["ids"][-1] if ev["ids"] else None, "text": ev["content"],
                                            "logprob": None, "special": False, "count_output_tokens": count,
                                            "prompt_tokens": len(inp.input_ids)},
                                  "generated_text": None, "finished": done,
                                  "finish_reason": ev.get("finish_reason"), "details": None})
                if done:
                    st.metrics.requests.labels("generate_stream", ev["finish_reason"]).inc()
        except APIError as e:
            yield sse.encode(e.body())

    return sse_response(events(), cleanup)
