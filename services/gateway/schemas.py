"""Response models of the public routes (the request models are services/contract's). They document
/openapi.json; responses that carry engine output allow extra fields, so new engine fields pass through."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from services.contract.control import ErrorDetail

OPEN = ConfigDict(extra="allow")


class ErrorResponse(BaseModel):
    """Every error, OpenAI-shaped."""
    error: ErrorDetail


# ------------------------------------------------------------------------------------------ images
class ImageData(BaseModel):
    b64_json: Optional[str] = Field(None, description="the image (response_format b64_json)")
    url: Optional[str] = Field(None, description="a data URL of the image (response_format url)")
    revised_prompt: Optional[str] = Field(None, description="the think text, when think was on")
    seed: Optional[int] = None
    branch_steps: Optional[dict[str, dict[str, int]]] = Field(
        None, description="denoising steps each CFG branch computed / reused (step caching)")
    applied: Optional[dict[str, Any]] = Field(
        None, description="the speed options the denoising steps actually ran with: cache {computed, reused} "
                          "branch-steps and cache_mode, graphs (true / false / \"not_applicable\" off CUDA) and "
                          "graph_steps, fp8 (true / false / \"emulated\" on CPU) and fp8_steps")


class ImageUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str = Field(description="WIDTHxHEIGHT of the images")
    usage: ImageUsage
    think_text: Optional[str] = None


class ImageStreamEvent(BaseModel):
    """One `data:` event of a streamed image request (`image_generation.*` or `image_edit.*`), then `[DONE]`;
    an `error` event (with `status`) ends a stream that failed after it started."""
    model_config = OPEN
    type: str = Field(description="<prefix>.think_delta | .think_done | .progress | .partial_image | .completed | "
                                  "error")
    text: Optional[str] = Field(None, description="think text (think_delta, think_done)")
    step: Optional[int] = Field(None, description="progress: denoising step done, 1-based; partial_image: the "
                                                  "step whose estimate it shows")
    total: Optional[int] = Field(None, description="progress: steps in all")
    index: Optional[int] = Field(None, description="completed, partial_image: which of the n images")
    partial_image_index: Optional[int] = Field(
        None, description="partial_image (partial_images > 0): 0-based preview number; a preview is the model's "
                          "estimate of the final image at evenly spaced steps, at most 512 px on its long side, "
                          "JPEG unless the request asked for WebP")
    b64_json: Optional[str] = None
    url: Optional[str] = None
    size: Optional[str] = None
    seed: Optional[int] = None
    output_format: Optional[str] = None


# ------------------------------------------------------------------------------------------ chat
class ChatResponseMessage(BaseModel):
    model_config = OPEN
    role: Literal["assistant"] = "assistant"
    content: Union[str, list[dict[str, Any]], None] = Field(
        None, description="text; image_url parts for modalities ['image']; text and image_url parts in answer "
                          "order for modalities ['text', 'image']")
    reasoning_content: Optional[str] = None
    images: Optional[list[dict[str, Any]]] = Field(None, description="the generated images as image_url parts")


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="natural log; -9999.0 for an impossible token")
    bytes: Optional[list[int]] = Field(None, description="the token's bytes (it may hold part of a character)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list, description="the top_logprobs most likely tokens")


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = Field(None, description="one entry per content token")


class ChatChoice(BaseModel):
    model_config = OPEN
    index: int
    message: ChatResponseMessage
    finish_reason: Optional[str] = None
    logprobs: Optional[ChoiceLogprobs] = Field(None, description="with logprobs: true")
    token_ids: Optional[list[int]] = Field(None, description="with return_token_ids: the output's token ids")


class ChatUsage(BaseModel):
    model_config = OPEN
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatDelta(BaseModel):
    model_config = OPEN
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    images: Optional[list[dict[str, Any]]] = Field(None, description="a finished image (image_url part with its "
                                                                     "`index` in the answer)")
    image_progress: Optional[dict[str, int]] = Field(
        None, description="modalities ['text', 'image']: {index, step, total} while an image denoises")
    partial_image: Optional[dict[str, Any]] = Field(
        None, description="image_config.partial_images > 0: {index, partial_image_index, image_url} previews")


class ChatChunkChoice(BaseModel):
    model_config = OPEN
    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChoiceLogprobs] = None
    token_ids: Optional[list[int]] = Field(None, description="with return_token_ids: this chunk's token ids")


class _ChatEnvelope(BaseModel):
    model_config = OPEN
    id: str
    created: int
    model: str
    usage: Optional[ChatUsage] = None
    prompt_token_ids: Optional[list[int]] = Field(
        None, description="with return_token_ids: the prompt's token ids (streaming: on the first chunk)")


class ChatCompletionChunk(_ChatEnvelope):
    """One `data:` event of a streamed chat; the last one before `[DONE]` carries `usage` (and no choices) with
    stream_options.include_usage."""
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ChatCompletionResponse(_ChatEnvelope):
    """POST /v1/chat/completions without stream; with stream: `chat.completion.chunk` events, then `[DONE]`."""
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


# ------------------------------------------------------------------------------------------ ops
class ModelCard(BaseModel):
    model_config = OPEN
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "u1serve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EngineProbe(BaseModel):
    service: str
    url: str
    status: Literal["ok", "unavailable"]
    http_status: Optional[int] = None
    detail: Optional[str] = None


class HealthReport(BaseModel):
    """200 when every engine service has a healthy replica ("degraded": some replica is not), else 503 with the
    same body."""
    status: Literal["ok", "degraded", "unavailable"]
    understanding: list[EngineProbe]
    generation: list[EngineProbe]


def sse_content(payload: type[BaseModel]) -> dict:
    """The `text/event-stream` entry of a streamed response: `schema` describes one SSE event (OpenAPI before 3.2),
    whose `data` is `[DONE]` or JSON: the payload model, or an error event (`{"error": {...}}`, maybe `status`)."""
    event = payload.model_json_schema()
    defs = event.pop("$defs", None)
    error = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object"},
                                                                      "status": {"type": "integer"}}}
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                             "contentSchema": {"anyOf": [event, error]}}]}
    schema = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}},
              "description": f"SSE events: data is a {payload.__name__} (or an error event), then [DONE]"}
    if defs:
        schema["$defs"] = defs
    return {"text/event-stream": {"schema": schema}}


ERRORS: dict = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "bad input: the message says what is allowed"), (401, "missing or invalid API key"),
    (403, "a gateway without an API key: a Host or Origin it does not serve"),
    (404, "the request's `model` is neither the served model nor a loaded LoRA adapter (or, on the adapter routes, "
          "the named adapter is not loaded)"),
    (413, "body over the route's size limit"), (415, "a body that is not JSON (or multipart where taken)"),
    (429, "too many requests in flight (Retry-After)"),
    (499, "the client went away"), (502, "an engine answered something unusable"),
    (503, "an engine is down or its KV pool is full"), (504, "an engine sent nothing in time, or the deadline passed"))}
