"""Interleaved text-and-image answers (chat `modalities: ["text", "image"]`): the internal body the gateway sends
understanding for each text segment of an answer. The answer so far (the transcript) travels with every segment,
so no engine keeps state between segments; the prefix cache makes the repeated prompt cheap."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator

from . import limits as L
from .chat import ChatMessage, LogitBias
from .image import LORA_FIELD, Guidance
from .types import INTERNAL, CacheSalt, Int

# The three CFG branches of an interleaved image (interleave_spec §2.1) under the edit rule's names, whose
# combination formulas are the same: cond = the whole conversation, img_cond = "tu" (images only, no text),
# uncond = "iu" (the static 9-token prefix).
TEXT_FREE, ALL_UNCOND = "img_cond", "uncond"
FLOAT_IMAGE_BRANCH = "image"      # the KVHandle branch of a generated float image in the pool


class TranscriptText(BaseModel):
    """Text tokens the answer decoded (exact ids: re-tokenising text could differ)."""
    model_config = INTERNAL
    token_ids: list[Int] = Field(max_length=L.DEFAULT_INTERLEAVE_TOKENS * 4)


class TranscriptImage(BaseModel):
    """A generated image: its float pixels in the KV pool (generation's `image_handle`), re-encoded in place."""
    model_config = INTERNAL
    image: dict = Field(description="KVHandle of the float image [3, height, width] in [-1, 1]")
    width: Int = Field(ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)
    height: Int = Field(ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)

    @field_validator("width", "height")
    @classmethod
    def _block(cls, v: int) -> int:
        if v % L.IMAGE_BLOCK:
            raise ValueError(f"must be a multiple of {L.IMAGE_BLOCK}")
        return v


class InterleaveSegmentRequest(Guidance, LogitBias):
    """Gateway -> understanding POST /internal/interleave_segment: decode the next text segment greedily (until
    `<img>`, `<|im_end|>` or `max_tokens`); at `<img>` also export the prefix KV of each CFG branch. Stream:
    `text` events, then `handles` (an image is due) or `done` (the answer ended)."""
    model_config = INTERNAL
    mode: Literal["edit"] = "edit"
    request_id: str = Field(min_length=1, max_length=L.MAX_REQUEST_ID_CHARS)
    messages: list[ChatMessage] = Field(min_length=1)
    think: bool = Field(False, description="think mode: the prompt ends at 'assistant\\n'; else the empty block")
    system_message: Optional[str] = Field(None, max_length=L.MAX_PROMPT_CHARS,
                                          description="None: the conversation's system message, else the "
                                                      "interleave system prompt")
    transcript: list[Union[TranscriptText, TranscriptImage]] = Field(default_factory=list)
    max_tokens: Int = Field(ge=1, description="text tokens this segment may decode")
    images_left: Int = Field(ge=0, le=L.MAX_INTERLEAVE_IMAGES, description="0: an <img> ends the answer")
    cache_salt: CacheSalt = None
    lora: Optional[str] = LORA_FIELD
    return_token_ids: bool = Field(False, description="text events carry their token ids; the final event the "
                                                      "image span ids, and the prompt's ids on a first segment")

    @property
    def images(self) -> list[TranscriptImage]:
        return [t for t in self.transcript if isinstance(t, TranscriptImage)]
