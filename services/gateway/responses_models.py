"""POST /v1/responses: the request body (OpenAI's Responses fields this server serves, plus `think` and the image
options as extensions) and the response models that document /openapi.json. Input items are checked where they
become chat messages (responses_input.py), so an error names the item it is about."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.contract import limits as L
from services.contract.image import ImageOptions
from services.contract.types import PUBLIC, Float, Int

from .schemas import OPEN

# quality -> share of the server's default denoising steps (an explicit num_inference_steps wins)
QUALITY_STEPS = {"low": 0.25, "medium": 0.5, "high": 1.0, "auto": 1.0}


class ImageGenerationTool(ImageOptions):
    """`tools: [{"type": "image_generation", ...}]`: OpenAI's fields plus the images API's u1serve options
    (num_inference_steps, seed, guidance_scale, think, ...)."""
    type: Literal["image_generation"]
    quality: Literal["low", "medium", "high", "auto"] = Field(
        "auto", description="low / medium / high: 1/4, 1/2, all of the server's default denoising steps")
    background: Literal["opaque", "auto", "transparent"] = Field(
        "auto", description="the images are always opaque; 'transparent' is refused")
    model: Optional[str] = None
    output_compression: Optional[Int] = Field(None, ge=0, le=100, description="accepted, not used")


class Reasoning(BaseModel):
    model_config = PUBLIC
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[str] = None


class ResponsesRequest(BaseModel):
    """OpenAI's Responses request. `reasoning` (any effort but none / minimal) or `think: true` turns the think
    block on; with the image_generation tool in `tools` (and tool_choice not 'none') the answer is an image."""
    model_config = PUBLIC
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = Field(
        description="a user message as text, or a list of items: messages (role, content: text or input_text / "
                    "input_image parts), earlier output items (message, reasoning, image_generation_call)")
    instructions: Optional[str] = Field(None, max_length=L.MAX_PROMPT_CHARS, description="a system message")
    previous_response_id: Optional[str] = Field(None, max_length=128,
                                                description="continue a stored response (same API key)")
    store: bool = Field(True, description="keep the response (GET /v1/responses/{id}, previous_response_id)")
    background: bool = Field(False, description="answer at once (queued); poll GET /v1/responses/{id}, or stream it "
                             "with stream (the response outlives its stream)")
    stream: bool = False
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=8)
    tool_choice: Union[str, dict[str, Any]] = "auto"
    temperature: Optional[Float] = Field(None, ge=0.0, le=L.MAX_TEMPERATURE, description="below 1e-5: greedy")
    top_p: Optional[Float] = Field(None, gt=0.0, le=1.0)
    max_output_tokens: Optional[Int] = Field(None, ge=1)
    seed: Optional[Int] = Field(None, ge=0, le=L.SEED_MAX, description="u1serve: the text sampler's seed")
    reasoning: Optional[Reasoning] = None
    think: Optional[bool] = Field(None, description="u1serve: think block on / off (over `reasoning`)")
    metadata: Optional[dict[str, str]] = Field(None, max_length=16)
    parallel_tool_calls: Optional[bool] = None
    user: Optional[str] = None

    @model_validator(mode="after")
    def _background_needs_store(self) -> "ResponsesRequest":
        if self.background and not self.store:
            raise ValueError("background responses are stored: background needs store true")
        return self

    @property
    def thinking(self) -> bool:
        if self.think is not None:
            return self.think
        return self.reasoning is not None and self.reasoning.effort not in ("none", "minimal")

    def image_tool(self) -> Optional[ImageGenerationTool]:
        """The image_generation tool when the answer is an image (other tool types are a 400 in the router)."""
        choice = self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.get("type")
        tools = [t for t in self.tools if t.get("type") == "image_generation"]
        if not tools or choice == "none":
            return None
        return ImageGenerationTool.model_validate(tools[0])


# ------------------------------------------------------------------------------------------ response (docs)
class ResponseError(BaseModel):
    code: Optional[str] = None
    message: str


class ResponseUsage(BaseModel):
    model_config = OPEN
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0},
                                                 description="cached_tokens: prompt tokens the prefix cache held")
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


class ResponseObject(BaseModel):
    """A response: status queued | in_progress | completed | incomplete | failed | cancelled; `output` holds
    reasoning, message and image_generation_call items (base64 `result`)."""
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: str
    background: bool = False
    model: str
    output: list[dict[str, Any]]
    error: Optional[ResponseError] = None
    incomplete_details: Optional[dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    usage: Optional[ResponseUsage] = None


class ResponseStreamEvent(BaseModel):
    """One `data:` event of a streamed response: response.created, response.queued (background), response.in_progress,
    response.output_item.added / .done, response.content_part.added / .done, response.output_text.delta / .done,
    response.reasoning_text.delta / .done, response.image_generation_call.in_progress / .generating /
    .partial_image / .completed, response.completed / .incomplete / .failed, error."""
    model_config = OPEN
    type: str
    sequence_number: int
