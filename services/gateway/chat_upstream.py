"""Understanding's chat route as an upstream of the gateway's text answers (the chat completions proxy and the
Responses API): a chat request opened on a replica (an error head raised as the engine's error), and the abort of
one that ended early."""
from __future__ import annotations

import httpx

from services.contract.control import AbortRequest

from .state import GatewayState
from .upstream import CONTROL_TIMEOUT_S, Deadline, Target, error_from_response, open_stream, tell

UND = "understanding"
CHAT_PATH = "/v1/chat/completions"


def abort_chat_later(state: GatewayState, target: Target, hdrs: dict, rid: str) -> None:
    """Tell the replica working on `rid` to stop (in the background)."""
    if target.ep is not None:
        state.janitor.later(tell(state.http, target.ep.url + "/internal/abort",
                                 AbortRequest(request_id=rid).model_dump(), hdrs, CONTROL_TIMEOUT_S))


async def open_chat(state: GatewayState, body: dict, hdrs: dict, deadline: Deadline, target: Target,
                    idle: bool) -> httpx.Response:
    """The chat request's response, its head a 200 (else the engine's error is raised)."""
    resp = await open_stream(state.http, state.und, CHAT_PATH, body, hdrs, deadline, target, idle)
    if resp.status_code != 200:
        try:
            raise await error_from_response(resp, UND, deadline)
        finally:
            await resp.aclose()
    return resp
