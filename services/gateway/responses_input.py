"""A Responses request's `input` (and `instructions`) as chat messages, the form understanding's chat path takes
(the one conversion of messages to the model's prompt stays there). Earlier output items a client sends back
are read too: an assistant message's text, an image_generation_call's image (the picture a next edit starts
from); reasoning items are dropped (the model thinks again)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from services.kit.errors import bad_request

USER_ROLES = ("user", "system", "developer", "assistant")


@dataclass
class Turn:
    """What a request adds to the conversation: its chat messages, and the last image among them (an input
    image or an earlier generated one sent back), which an image edit starts from when the turn names none."""
    messages: list[dict] = field(default_factory=list)
    last_image: Optional[str] = None         # a data URL or bare base64
    new_images: int = 0                      # input images in this request's user messages


def _image_url(part: dict, param: str) -> str:
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        if part.get("file_id"):
            raise bad_request("input_image by file_id is not served (no files API): send a data URL in image_url",
                              param=param, code="unsupported_value")
        raise bad_request("input_image needs image_url (a data URL)", param=param)
    return url


def _content(content: Union[str, list, None], role: str, param: str, turn: Turn) -> Union[str, list[dict]]:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of parts", param=param)
    parts: list[dict] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        elif kind == "input_image":
            if role != "user":
                raise bad_request("images are only allowed in user messages", param=where)
            url = _image_url(part, where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
            turn.last_image, turn.new_images = url, turn.new_images + 1
        elif kind == "refusal":
            continue
        else:
            raise bad_request(f"content part type {kind!r} is not served (input_text, input_image, output_text)",
                              param=where, code="unsupported_value")
    return parts


def read_input(input_: Union[str, list[dict[str, Any]]], instructions: Optional[str]) -> Turn:
    """The request's items as a Turn (a 400 naming the item for anything this server does not take)."""
    turn = Turn()
    if instructions:
        turn.messages.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        turn.messages.append({"role": "user", "content": input_})
        return turn
    for i, item in enumerate(input_):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in USER_ROLES:
                raise bad_request(f"role must be one of {', '.join(USER_ROLES)}", param=f"{param}.role")
            turn.messages.append({"role": role, "content": _content(item.get("content"), role, f"{param}.content",
                                                                    turn)})
        elif kind == "reasoning":
            continue
        elif kind == "image_generation_call":
            if isinstance(item.get("result"), str) and item["result"]:
                turn.last_image = item["result"]
        else:
            raise bad_request(f"input item type {kind!r} is not served (message, reasoning, image_generation_call)",
                              param=param, code="unsupported_value")
    if not any(m["role"] == "user" for m in turn.messages) and turn.last_image is None:
        raise bad_request("input needs a user message", param="input")
    return turn


def last_user_text(messages: list[dict]) -> str:
    """The last user message's text: an image's prompt."""
    for msg in reversed(messages):
        if msg["role"] == "user":
            content = msg["content"]
            if isinstance(content, str):
                return content
            return "\n".join(p["text"] for p in content if p["type"] == "text")
    return ""


def last_user_images(messages: list[dict]) -> list[str]:
    """The images of the last user message: they make an image request an edit."""
    for msg in reversed(messages):
        if msg["role"] == "user":
            content = msg["content"]
            return [] if isinstance(content, str) else [p["image_url"]["url"] for p in content
                                                        if p["type"] == "image_url"]
    return []


def with_image(messages: list[dict], image: str) -> list[dict]:
    """`messages` whose last user message carries `image` first (a text question about the picture an earlier
    turn made)."""
    out = list(messages)
    for k in range(len(out) - 1, -1, -1):
        if out[k]["role"] == "user":
            content = out[k]["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
            out[k] = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, *parts]}
            break
    return out
