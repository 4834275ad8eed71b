"""Text generation through the engine (shared by the OpenAI and the native routes) and the one mapping of an
engine request's failure to an HTTP error."""
from __future__ import annotations

import time
from typing import Optional

from services.kit.errors import APIError, bad_request, overloaded, unavailable
from services.model import prompts as PR

from .detokenizer import LogprobEntries, OutputText
from .engine_client import EngineDead
from .protocol import RequestOutput, SubmitRequest
from .sampling import SamplingParams


def output_error(o: RequestOutput) -> APIError:
    """What a failed / aborted engine request means for the client."""
    code = o.error_code or o.finish_reason or "engine_error"
    message = o.error or f"request {o.finish_reason}"
    if code == "engine_dead":
        return unavailable(message, "engine_dead")
    if code in ("kv_cache_too_small", "invalid_request"):
        return bad_request(message, code=code)
    if code == "model_not_found":
        return APIError(404, message, param="model", code=code)
    if code == "queue_timeout":
        return overloaded(message, 1.0, "queue_timeout")
    if o.finish_reason == "abort":
        return APIError(499, message, code="abort")
    return APIError(500, message, code=code)


async def generate(state, rid: str, inp: PR.PromptInput, params: SamplingParams, think: Optional[bool],
                   cache_salt: Optional[str] = None, lora: Optional[str] = None):
    """Async iterator of dicts: {"reasoning", "content", "ids", "logprobs"?, "finish_reason"?, "usage"?} (logprobs:
    OpenAI entries of the tokens that became content, when the params ask); a failure raises APIError. Closing it
    early aborts the engine request."""
    engine = state.require_engine()
    stop_ids = state.stop_ids(params)
    msg = SubmitRequest(rid, list(inp.input_ids), list(inp.images), params, "text", stop_token_ids=stop_ids,
                        cache_salt=cache_salt, lora=lora)
    out = OutputText(state.tok, think, params.stop, set(stop_ids))
    entries = LogprobEntries(state.tok) if params.logprobs is not None else None
    metrics = state.metrics
    t0 = time.monotonic()
    last = None
    finished = False
    try:
        try:
            q = engine.submit(msg)
        except EngineDead as e:
            raise unavailable(str(e), "engine_dead") from None
        n_out = cached = 0
        while True:
            o = await q.get()
            now = time.monotonic()
            if o.new_ids:
                if last is None:
                    metrics.ttft.observe(now - t0)
                else:
                    metrics.itl.observe((now - last) / len(o.new_ids))
                last = now
            n_out += len(o.new_ids)
            cached = o.cached_tokens
            r_delta, c_delta = out.push(o.new_ids)
            extra = {}
            if entries is not None:
                extra["logprobs"] = entries.entries(o.new_ids, o.logprobs or [], out.content_positions)
            reason = o.finish_reason
            if out.stopped and reason is None:
                engine.abort(rid)      # a stop string ended it; free the KV at the next iteration
                reason = "stop"
            if reason is not None:
                finished = True
                if reason == "error":
                    raise output_error(o)
                r2, c2 = out.finish()
                # whole KV pages only: a one-token difference of another client's cached prompt cannot be probed
                page = state.args.kv_page_tokens
                usage = {"prompt_tokens": len(inp.input_ids), "completion_tokens": n_out,
                         "total_tokens": len(inp.input_ids) + n_out,
                         "prompt_tokens_details": {"cached_tokens": cached - cached % page}}
                metrics.e2e.observe(now - t0)
                yield {"reasoning": r_delta + r2, "content": c_delta + c2, "ids": o.new_ids, **extra,
                       "finish_reason": "stop" if out.stopped else reason, "usage": usage}
                return
            if r_delta or c_delta or o.new_ids:
                yield {"reasoning": r_delta, "content": c_delta, "ids": o.new_ids, **extra}
    finally:
        if not finished:
            engine.abort(rid)
        engine.done(rid)
