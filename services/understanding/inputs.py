"""Public request bodies -> engine inputs. The fields and their ranges are the contract's
(`services.contract.chat`); what is checked here needs the model: the context limit, the vocabulary, the
native API's LightLLM spellings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, Field, ValidationError

from services.contract.chat import ChatMessage, ImagePart, TextSampling
from services.contract.types import PUBLIC, CacheSalt
from services.kit.errors import APIError, bad_request, from_validation
from services.model.constants import VQA_MAX_PIXELS, VQA_MIN_PIXELS

from .sampling import SamplingParams


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    min_pixels: int = VQA_MIN_PIXELS
    max_pixels: int = VQA_MAX_PIXELS


def image_refs(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(param, url) of every image part, in prompt order."""
    return [(f"messages[{i}].content[{j}].image_url", part.url)
            for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if isinstance(part, ImagePart)]


def prompt_messages(messages: list[ChatMessage], pils: list) -> list[dict]:
    """Contract messages -> the `prompts.chat_input` form, the image parts replaced by decoded images (in the
    order of `image_refs`). `developer` is OpenAI's newer name of the system role."""
    out, it = [], iter(pils)
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
            continue
        out.append({"role": role, "content": [
            {"type": "image", "image": next(it)} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
            for p in m.content]})
    return out


def text_params(req: TextSampling, prompt_len: int, limits: Limits, param: str = "messages",
                logprobs: Optional[int] = None, clamp: bool = False) -> SamplingParams:
    """The engine's SamplingParams: the prompt must leave room in the context and a client's max_tokens must fit
    in what is left (as vLLM: a 400 with the numbers; `clamp`: cut it to what is left instead, for a budget the
    server chose), default all of it; stop token ids and logit_bias ids must be in the vocabulary."""
    if prompt_len >= limits.max_model_len:
        raise bad_request(f"the prompt is {prompt_len} tokens, over the context limit of {limits.max_model_len} "
                          "tokens", param, "context_length_exceeded")
    if req.max_tokens and prompt_len + req.max_tokens > limits.max_model_len and not clamp:
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens; the request asks "
                          f"for {prompt_len + req.max_tokens} ({prompt_len} in the prompt, max_tokens "
                          f"{req.max_tokens} for the completion): lower max_tokens to at most "
                          f"{limits.max_model_len - prompt_len}", "max_tokens", "context_length_exceeded")
    bad = [t for t in req.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids: {bad[0]} is not a token id; ids are 0..{limits.vocab_size - 1}",
                          "stop_token_ids")
    bad = [t for t in req.bias_map if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"logit_bias: {bad[0]} is not a token id; ids are 0..{limits.vocab_size - 1}",
                          "logit_bias")
    room = limits.max_model_len - prompt_len
    return SamplingParams.from_request(req, min(req.max_tokens, room) if req.max_tokens else room, logprobs)


# ---- the LightLLM-style native API (/generate, /generate_stream) -----------------------------------------
_NATIVE_NAMES = {"max_new_tokens": "max_tokens", "stop_sequences": "stop"}


class NativeImage(BaseModel):
    model_config = PUBLIC
    type: Optional[str] = None
    data: str


class NativeMultimodal(BaseModel):
    model_config = PUBLIC
    images: list[NativeImage | str] = Field(default_factory=list)


class NativeRequest(BaseModel):
    model_config = PUBLIC
    inputs: str = Field(min_length=1, description="the prompt, chat template included; <image> marks images")
    parameters: dict[str, Any] = Field(default_factory=dict)
    multimodal_params: Optional[NativeMultimodal] = None

    def image_refs(self) -> list[tuple[str, str]]:
        imgs = self.multimodal_params.images if self.multimodal_params else []
        return [(f"multimodal_params.images[{i}]", im if isinstance(im, str) else im.data)
                for i, im in enumerate(imgs)]


class NativeSampling(TextSampling):
    cache_salt: CacheSalt = None


def native_sampling(parameters: dict[str, Any]) -> NativeSampling:
    """`parameters` with LightLLM's names (max_new_tokens, stop_sequences, do_sample) -> the contract's
    sampling fields; errors name the field as the client spelled it."""
    body, spelled = {}, {}
    for key, value in parameters.items():
        name = _NATIVE_NAMES.get(key, key)
        body[name], spelled[name] = value, key
    if body.pop("do_sample", None) is False:
        body["temperature"] = 0.0
    try:
        return NativeSampling.model_validate(body)
    except ValidationError as e:
        err: APIError = from_validation(e.errors())
        name = (err.param or "").split(".")[0].split("[")[0]
        if name in spelled:
            err.param = "parameters." + spelled[name] + (err.param or "")[len(name):]
            err.message = f"parameters.{spelled[name]}" + err.message[len(name):]
        raise err from None
