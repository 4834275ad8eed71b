"""Validation of the public request bodies (chat completions, native /generate) into engine inputs.
Every problem becomes a 400 that names the offending field."""
from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any, Optional

from services.model import images as IM

from .api_errors import bad_request
from .sampling import SamplingParams

_ROLES = ("system", "user", "assistant")


@dataclass
class Limits:
    max_model_len: int
    max_image_bytes: int = 20 * 1024 * 1024
    min_pixels: int = IM.VQA_MIN_PIXELS
    max_pixels: int = IM.VQA_MAX_PIXELS
    max_images: int = 16
    allow_remote_images: bool = False


def _num(body: dict, name: str, default, kind=float, allow_none=True):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"{name} must be a number", name)
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise bad_request(f"{name} must be an integer", name)
        return int(v)
    v = float(v)
    if not math.isfinite(v):
        raise bad_request(f"{name} must be finite", name)
    return v


def decode_image_ref(ref: Any, limits: Limits, param: str):
    """A data URL or bare base64 string -> PIL image; 400 with the reason otherwise."""
    if not isinstance(ref, str) or not ref:
        raise bad_request(f"{param} must be a data URL or base64 string", param)
    data = ref
    if ref.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are disabled on this server; send a data URL "
                          "(data:image/png;base64,...)", param, "remote_images_disabled")
    if ref.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep or ";base64" not in head:
            raise bad_request(f"{param}: only base64 data URLs are supported", param)
    if len(data) > limits.max_image_bytes * 4 // 3 + 8:
        raise bad_request(f"{param}: image is larger than {limits.max_image_bytes} bytes", param, "image_too_large")
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: broken base64 data", param, "invalid_base64") from None
    try:
        return IM.load_image(raw, max_bytes=limits.max_image_bytes)
    except IM.ImageError as e:
        raise bad_request(f"{param}: {e}", param, "invalid_image") from None


def parse_messages(messages: Any, limits: Limits) -> list[dict]:
    """OpenAI messages -> the `prompts.chat_input` form (image parts become PIL images)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out, n_images = [], 0
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{p}.role must be one of {list(_ROLES)}, got {role!r}", f"{p}.role")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{p}.content must be a string or a list of parts", f"{p}.content")
        parts = []
        for j, part in enumerate(content):
            pp = f"{p}.content[{j}]"
            if not isinstance(part, dict):
                raise bad_request(f"{pp} must be an object", pp)
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"{pp}.text must be a string", pp)
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                if role != "user":
                    raise bad_request(f"{pp}: images are only allowed in user messages", pp)
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                n_images += 1
                if n_images > limits.max_images:
                    raise bad_request(f"at most {limits.max_images} images per request", pp)
                parts.append({"type": "image", "image": decode_image_ref(url, limits, f"{pp}.image_url")})
            else:
                raise bad_request(f"{pp}.type must be 'text' or 'image_url', got {kind!r}", pp)
        out.append({"role": role, "content": parts})
    if not any(m["role"] == "user" for m in out):
        raise bad_request("messages must contain at least one user message", "messages")
    return out


def parse_stop(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise bad_request("stop must be a non-empty string or a list of up to 16 non-empty strings", "stop")
    return v


def sampling_from_openai(body: dict) -> tuple[SamplingParams, bool]:
    """Returns (params, max_tokens_given)."""
    if body.get("n", 1) not in (1, None):
        raise bad_request("only n = 1 is supported", "n")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    given = mt is not None
    if given:
        if isinstance(mt, bool) or not isinstance(mt, int):
            raise bad_request("max_tokens must be an integer", "max_tokens")
        if mt < 1:
            raise bad_request(f"max_tokens must be at least 1, got {mt}", "max_tokens")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("seed must be an integer", "seed")
    p = SamplingParams(
        max_tokens=mt if given else 1,
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        top_k=_num(body, "top_k", -1, int),
        repetition_penalty=_num(body, "repetition_penalty", 1.0),
        presence_penalty=_num(body, "presence_penalty", 0.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0),
        seed=seed, stop=parse_stop(body.get("stop")), stop_token_ids=list(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)))
    if p.top_k == 0:
        p.top_k = -1
    err = p.validate()
    if err:
        raise bad_request(err[0], err[1])
    return p, given


def sampling_from_native(params: dict) -> tuple[SamplingParams, bool]:
    """LightLLM-style `parameters` (max_new_tokens, do_sample, stop_sequences, ...)."""
    if not isinstance(params, dict):
        raise bad_request("parameters must be an object", "parameters")
    body = dict(params)
    if "max_new_tokens" in body:
        body["max_tokens"] = body.pop("max_new_tokens")
    if "stop_sequences" in body:
        body["stop"] = body.pop("stop_sequences")
    if body.get("do_sample") is False:
        body["temperature"] = 0.0
    return sampling_from_openai(body)


def finalize_max_tokens(p: SamplingParams, given: bool, prompt_len: int, limits: Limits) -> None:
    """Reject prompts over the context limit; clamp max_tokens into what is left of it."""
    if prompt_len >= limits.max_model_len:
        raise bad_request(f"the prompt is {prompt_len} tokens, over the context limit of {limits.max_model_len} "
                          "tokens", "messages", "context_length_exceeded")
    room = limits.max_model_len - prompt_len
    p.max_tokens = min(p.max_tokens, room) if given else room


def enable_thinking(body: dict) -> Optional[bool]:
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    v = kw.get("enable_thinking", False)
    if v is not None and not isinstance(v, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    return v
