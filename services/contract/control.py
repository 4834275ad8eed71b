"""Control bodies between the services and the events of generation's job stream, declared once (pydantic only).

One verb per idea: a request that ended early is *aborted* on the engine still working on it (understanding and
generation both take `POST /internal/abort` with an `AbortRequest`); prefix pages nobody will read are
*released* (`POST /internal/release` on understanding). The two-phase weights update has its own abort
(`/internal/weights/abort`, rl_weights.py): a staged update, not a request.

Generation's `/internal/generate` and `/internal/rl/*` streams are SSE of `GenerationEvent`s, then `[DONE]`: it
starts with `queued` when the job is accepted; `progress` after each step; `partial_image` at the preview steps;
`image` per image (its `image_handle` only when the float image was exported for an interleaved answer);
`rl_result` for RL jobs; an `error` ends a job that failed (then `[DONE]`).

Understanding's prefix streams (`/internal/image_prefix` and `/internal/interleave_segment`, with stream) are SSE
of `PrefixEvent`s, then `[DONE]`: `think_delta` while a think block is decoded (image prefix), `text` while an
interleaved answer's text is decoded, then `handles` (one KVHandle per CFG branch: the job goes on to
generation), or `done` when an interleaved answer ends without another image; an `error` ends a stream that
failed.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from . import limits as L
from .image import Branch
from .types import INTERNAL


# -- control bodies ------------------------------------------------------------------------------------------
class AbortRequest(BaseModel):
    model_config = INTERNAL
    request_id: str = Field(min_length=1, max_length=L.MAX_REQUEST_ID_CHARS)


class AbortReply(BaseModel):
    request_id: str
    aborted: int = Field(description="pieces of work stopped under this id (0: nothing ran under it any more)")


class ReleaseRequest(BaseModel):
    model_config = INTERNAL
    handles: list[Any] = Field(description="KVHandle dicts the caller will not use")


# -- generation's event stream -------------------------------------------------------------------------------
class QueuedEvent(BaseModel):
    type: Literal["queued"] = "queued"


class ProgressEvent(BaseModel):
    type: Literal["progress"] = "progress"
    step: int = Field(description="steps done")
    total: int


class PartialImageEvent(BaseModel):
    type: Literal["partial_image"] = "partial_image"
    index: int
    partial_image_index: int
    step: int
    b64: Union[str, bytes] = Field(description="the encoded preview, base64")
    format: str
    width: int
    height: int


class ImageEvent(BaseModel):
    type: Literal["image"] = "image"
    index: int
    b64: Union[str, bytes] = Field(description="the encoded image, base64")
    format: str
    width: int
    height: int
    seed: Optional[int] = None
    branch_steps: Optional[dict[str, dict[str, int]]] = Field(
        None, description="per CFG branch: steps computed in full and steps that reused a cached residual")
    weights_version: Optional[str] = None
    image_handle: Optional[dict] = Field(None, description="the float image in the KV pool (interleave only)")
    applied: Optional[dict] = Field(None, description="the speed options the steps ran with: step cache "
                                    "computed / reused branch-steps, CUDA graphs and fp8 (true / false / "
                                    "not_applicable / emulated) and their step counts")


class RlResultEvent(BaseModel):
    type: Literal["rl_result"] = "rl_result"
    logprobs: list[list[Optional[float]]] = Field(description="[n, steps]; null on ODE steps")
    timesteps: list[float]
    sde_steps: list[int]
    noise_scale: float
    weights_version: str


class ErrorDetail(BaseModel):
    """An error, OpenAI-shaped (every service's error bodies and error events)."""
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    status: int
    error: ErrorDetail


GenerationEvent = Annotated[Union[QueuedEvent, ProgressEvent, PartialImageEvent, ImageEvent, RlResultEvent,
                                  ErrorEvent], Field(discriminator="type")]


def wire(event: BaseModel) -> dict:
    """An event built with `model_construct` (trusted: the service's own values, an image's base64 not copied by
    validation) as the dict `sse.encode` writes: its type and the fields that were given."""
    given = event.model_fields_set
    fields = [k for k in type(event).model_fields if k in given and k != "type"]
    return {"type": event.type, **{k: getattr(event, k) for k in fields}}


# -- understanding's prefix stream ---------------------------------------------------------------------------
class ThinkDeltaEvent(BaseModel):
    type: Literal["think_delta"] = "think_delta"
    text: str = Field(description="the next piece of the think text")


class TextEvent(BaseModel):
    """A piece of an interleaved answer's text (its token ids with return_token_ids; a first segment's first
    event also carries the prompt's ids)."""
    type: Literal["text"] = "text"
    reasoning: str
    content: str
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class HandlesEvent(BaseModel):
    """The prefix is exported: one KVHandle dict per CFG branch, which the receiver now owns."""
    type: Literal["handles"] = "handles"
    handles: dict[Branch, dict]
    think_text: Optional[str] = Field(None, description="the decoded think block (think mode)")
    think_token_ids: Optional[list[int]] = Field(None, description="RL: the sampled think tokens")
    think_logprobs: Optional[list[float]] = Field(None, description="RL: their log-probs")
    token_ids: Optional[list[int]] = Field(None, description="interleave: the segment's text tokens")
    usage: Optional[dict[str, Any]] = Field(None, description="interleave: the segment's token counts")
    image_span_ids: Optional[list[int]] = Field(None, description="interleave: <img>, <IMG_CONTEXT>, </img>")


class AnswerDoneEvent(BaseModel):
    """An interleaved answer ended in this segment's text (no handles follow)."""
    type: Literal["done"] = "done"
    finish_reason: str
    token_ids: list[int] = Field(description="the segment's text tokens")
    usage: dict[str, Any]
    image_span_ids: Optional[list[int]] = None


PrefixEvent = Annotated[Union[ThinkDeltaEvent, TextEvent, HandlesEvent, AnswerDoneEvent, ErrorEvent],
                        Field(discriminator="type")]
