"""Chat requests: OpenAI's chat completion body (plus the vLLM-style extensions u1serve serves) and the text
sampling fields shared with the native /generate API. Validated by the gateway and again by understanding."""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from services.base.content import text_runs

from . import limits as L
from .image import ImageOptions
from .types import PUBLIC, CacheSalt, Float, Int

_TOKEN_ID = re.compile(r"\s*[0-9]{1,10}\s*")   # a non-negative token id, in ASCII digits


class TextPart(BaseModel):
    model_config = PUBLIC
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = PUBLIC
    url: str = Field(description="a data URL (data:image/png;base64,...) or bare base64; remote URLs are refused")
    detail: Optional[str] = None


class ImagePart(BaseModel):
    model_config = PUBLIC
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


def content_runs(content: Union[str, list[ContentPart], None], sep: str = "") -> tuple[list[str], list[ImagePart]]:
    """A message's content (a string or text / image_url parts) as `text_runs`: the text around each image part,
    in the order the client gave the parts, and the image parts. The one conversion of content parts every path
    uses (chat, image chat, interleaved answers, the prompt of an image request)."""
    if content is None or isinstance(content, str):
        return [content or ""], []
    return text_runs((p.text if isinstance(p, TextPart) else p for p in content), sep)


class ChatMessage(BaseModel):
    model_config = PUBLIC
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = Field(
        None, description="text, or text and image_url parts: each image goes where its part stands among the text "
                          "parts (all first: the official template's `<image>\\n` before the text); `<image>` in "
                          "text is text")

    @model_validator(mode="after")
    def _images_from_users(self) -> "ChatMessage":
        if self.role != "user" and isinstance(self.content, list) and any(
                isinstance(p, ImagePart) for p in self.content):
            raise ValueError("images are only allowed in user messages")
        return self


class LogitBias(BaseModel):
    """OpenAI's logit_bias (chat sampling, and the greedy text of interleaved answers)."""
    logit_bias: Optional[dict[str, Float]] = Field(
        None, description=f"token id -> bias in [-{L.MAX_LOGIT_BIAS:g}, {L.MAX_LOGIT_BIAS:g}] added to its logit "
                          f"(at most {L.MAX_LOGIT_BIAS_ENTRIES} ids)")

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        if v is None:
            return v
        if len(v) > L.MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {L.MAX_LOGIT_BIAS_ENTRIES} token ids")
        for key, bias in v.items():
            # ASCII digits only: str.isdigit() also accepts '²' and other digits int() cannot parse
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys are token ids (non-negative integers), got {key[:20]!r}")
            if not -L.MAX_LOGIT_BIAS <= bias <= L.MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{L.MAX_LOGIT_BIAS:g}, {L.MAX_LOGIT_BIAS:g}]")
        return v

    @property
    def bias_map(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}


class TextSampling(LogitBias):
    """Sampling fields (OpenAI + vLLM names). temperature below 1e-5 means greedy."""
    model_config = PUBLIC
    max_tokens: Optional[Int] = Field(None, ge=1, description="default: what is left of the context")
    temperature: Float = Field(1.0, ge=0.0, le=L.MAX_TEMPERATURE)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(-1, ge=-1, description="-1 or 0 = off")
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=L.MAX_REPETITION_PENALTY)
    presence_penalty: Float = Field(0.0, ge=-L.MAX_ABS_PENALTY, le=L.MAX_ABS_PENALTY)
    frequency_penalty: Float = Field(0.0, ge=-L.MAX_ABS_PENALTY, le=L.MAX_ABS_PENALTY)
    seed: Optional[Int] = Field(None, ge=0, le=L.SEED_MAX)
    stop: Union[str, list[str], None] = Field(None, description=f"up to {L.MAX_STOP_STRINGS} strings")
    stop_token_ids: list[Int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if len(items) > L.MAX_STOP_STRINGS or not all(s for s in items):
            raise ValueError(f"stop must be a non-empty string or up to {L.MAX_STOP_STRINGS} non-empty strings")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < L.GREEDY_TEMPERATURE or self.top_k == 1


class StreamOptions(BaseModel):
    model_config = PUBLIC
    include_usage: bool = False


class ChatTemplateKwargs(BaseModel):
    model_config = PUBLIC
    enable_thinking: Optional[bool] = Field(
        None, description="absent: the official prompt (ends at 'assistant\\n', the model decides); "
                          "false: an empty think block; true: the prompt opens <think>")


class ChatImageOptions(ImageOptions):
    """`image_config` of a chat request: the image options, plus the cap of an interleaved answer and its
    per-image sizes."""
    size: Union[str, list[str], None] = Field(
        None, description="'WxH' (multiples of 32) or 'auto'; modalities ['text', 'image'] also takes a list, one "
                          "size per generated image in order, the last one repeated for images past its end (the "
                          f"official interleave_gen's image_size list; at most {L.MAX_INTERLEAVE_IMAGES} entries)")
    max_images: Int = Field(L.DEFAULT_INTERLEAVE_IMAGES, ge=0, le=L.MAX_INTERLEAVE_IMAGES,
                            description="modalities ['text', 'image']: the most images in one answer (an <img> "
                                        "past it ends the answer)")

    @field_validator("size")
    @classmethod
    def _size_list(cls, v):
        if isinstance(v, list) and not 1 <= len(v) <= L.MAX_INTERLEAVE_IMAGES:
            raise ValueError(f"a size list has 1 to {L.MAX_INTERLEAVE_IMAGES} entries, got {len(v)}")
        return v

    @property
    def sizes(self) -> list[Optional[str]]:
        """The size of each generated image, in order (the last one repeats): [size] for a single size."""
        return list(self.size) if isinstance(self.size, list) else [self.size]


class ChatCompletionRequest(TextSampling):
    """POST /v1/chat/completions."""
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1)
    n: Int = Field(1, ge=1, le=L.MAX_CHAT_CHOICES,
                   description="choices: independent samples of one prompt (seeds seed, seed+1, ... when seeded)")
    logprobs: bool = Field(False, description="the log probability of each output token")
    top_logprobs: Optional[Int] = Field(None, ge=0, le=L.MAX_TOP_LOGPROBS,
                                        description="also the most likely tokens at each position (needs logprobs)")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    modalities: Optional[list[Literal["text", "image"]]] = Field(
        None, description="['image']: an image from the last user turn; ['text', 'image']: an interleaved "
                          "answer, text and generated images in order")
    image_config: Optional[ChatImageOptions] = Field(None, description="image options when modalities has 'image'")
    return_token_ids: bool = Field(False, description="vLLM's field: `prompt_token_ids` on the response (on the "
                                                      "first chunk when streaming) and the output's `token_ids` on "
                                                      "each choice / chunk, ending with the stop token (EOS / a "
                                                      "stop_token_ids id) when the answer stopped on one; an "
                                                      "interleaved answer spells each image as <img>, one "
                                                      "<IMG_CONTEXT> per token, </img>")
    cache_salt: CacheSalt = None

    @model_validator(mode="after")
    def _has_user(self) -> "ChatCompletionRequest":
        if not any(m.role == "user" for m in self.messages):
            raise ValueError("messages must contain at least one user message")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def wants_image(self) -> bool:
        """modalities ['image']: one image job, no text."""
        return bool(self.modalities) and "image" in self.modalities and "text" not in self.modalities

    @property
    def wants_interleave(self) -> bool:
        """modalities ['text', 'image']: text and generated images interleaved in one answer."""
        return bool(self.modalities) and {"text", "image"} <= set(self.modalities)

    @property
    def thinking(self) -> Optional[bool]:
        """chat_template_kwargs.enable_thinking: None when absent (the official prompt)."""
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else None
