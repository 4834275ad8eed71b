"""Interleaved text-and-image answers (chat `modalities: ["text", "image"]`), driven here, in the spirit of the
official interleave_gen (interleave_spec.md), over the two engines' HTTP APIs.

An answer is a run of segments. Each segment is one image job of the orchestrator whose understanding half is
`/internal/interleave_segment`: greedy text over the conversation + the answer so far, up to `<img>` (then the
prefix handles of the image's CFG branches: cond = everything, tu = the images only, iu = the static prefix) or
to the end of the answer. Generation denoises the image (the k-th draw of the answer's seeded generator) and
writes its float pixels into the KV pool (`export_image`); the next segment names that handle, and understanding
re-encodes the image in place. Only handles cross the gateway, never KV or pixels but the encoded image the
client gets. The answer stays on the endpoints its first segment used (the float images live in that pool).
The float images belong to the answer: released on understanding when it ends, however it ends.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar, Optional

from services.contract import limits as L
from services.contract.interleave import InterleaveSegmentRequest
from services.kit.errors import APIError

from .jobs import GenerationTarget, generate_body, resolve_size
from .routing import conversation_key
from .upstream import Deadline, engine_headers, release_pages


@dataclass
class Answer:
    """One interleaved answer: what every segment needs, and the answer so far."""
    request_id: str
    messages: list[dict]               # the client's conversation (input images as data URLs, checked)
    think: bool
    max_tokens: int                    # text tokens over the whole answer
    max_images: int
    generate: dict                     # jobs.generate_fields: GenerateRequest fields but the per-image ones
    sizes: list[tuple[int, int]] = field(default_factory=list)   # (W, H) per image; the last one repeats
    logit_bias: Optional[dict] = None
    cache_salt: Optional[str] = None
    lora: Optional[str] = None         # the LoRA adapter of every segment (routers/lora.py); also in `generate`
    return_token_ids: bool = False
    transcript: list[dict] = field(default_factory=list)
    floats: list[dict] = field(default_factory=list)        # the float images' handles (the answer's to free)
    text_tokens: int = 0

    @property
    def images(self) -> int:
        return len(self.floats)

    def size(self, k: int) -> tuple[int, int]:
        """Image k's (W, H): the official loop's image_size list, padded with its last entry (none: the size of
        `generate`)."""
        if not self.sizes:
            return self.generate["width"], self.generate["height"]
        return self.sizes[min(k, len(self.sizes) - 1)]


def image_sizes(cfg, opts, first_image_wh: Optional[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each entry of image_config.size (a string or a list) resolved and checked as an image request's size is
    ('auto' / absent: the first input image's aspect ratio at the default area, else the default size)."""
    out = []
    for i, size in enumerate(opts.sizes):
        try:
            out.append(resolve_size(cfg, opts.model_copy(update={"size": size}), first_image_wh))
        except APIError as e:
            if isinstance(opts.size, list):
                e.param, e.message = f"image_config.size[{i}]", f"image_config.size[{i}]: {e.message}"
            raise
    return out


@dataclass
class Segment(GenerationTarget):
    """The orchestrator's job for segment k of an answer (the interface of jobs.ImageJob)."""
    answer: Answer
    k: int
    n: ClassVar[int] = 1
    prefix_path: ClassVar[str] = "/internal/interleave_segment"

    @property
    def request_id(self) -> str:
        return f"{self.answer.request_id}-{self.k}"

    def prefix_body(self) -> dict[str, Any]:
        a = self.answer
        g = a.generate
        return InterleaveSegmentRequest(
            request_id=self.request_id, messages=a.messages, think=a.think, transcript=a.transcript,
            max_tokens=a.max_tokens - a.text_tokens, images_left=a.max_images - a.images,
            guidance_scale=g["guidance_scale"], image_guidance_scale=g["image_guidance_scale"],
            logit_bias=a.logit_bias, cache_salt=a.cache_salt, lora=a.lora,
            return_token_ids=a.return_token_ids).model_dump(mode="json", exclude_none=True)

    @staticmethod
    def route_key(prefix_body: dict) -> int:
        """The answer's conversation: every segment goes where its earlier turns are cached."""
        return conversation_key(prefix_body)

    def generate_body(self, handles: dict) -> dict[str, Any]:
        a = self.answer
        width, height = a.size(a.images)
        return generate_body({**a.generate, "width": width, "height": height}, handles, request_id=self.request_id,
                             noise_draws=[a.size(k) for k in range(a.images)], export_image=True)


async def run(state, answer: Answer, deadline: Deadline) -> AsyncIterator[dict]:
    """The answer's events: text {reasoning, content}; per image image_progress {image, step, total},
    partial_image {image, ...generation's fields}, image {image, b64, format, width, height, seed}; finally
    done {finish_reason, usage}. With `return_token_ids` (vLLM's field): text and image events carry `token_ids`
    (an image as the span it takes in the sequence: <img>, one <IMG_CONTEXT> per token, </img>); the first
    text event and done carry `prompt_token_ids`. Raises APIError; closing it early undoes the segment in flight
    and frees the float images."""
    pins: dict = {}
    prompt_tokens = None
    prompt_ids, span = None, None
    try:
        for k in itertools.count():
            seg = Segment(answer, k)
            async for ev in state.orchestrator.run(seg, deadline, pins):
                kind = ev.get("type")
                if kind == "text":
                    if "prompt_token_ids" in ev:
                        prompt_ids = ev["prompt_token_ids"]
                    yield ev
                elif kind in ("think_done", "answer_done"):
                    info = ev.get("prefix", ev)
                    ids = list(info.get("token_ids") or [])
                    answer.transcript.append({"token_ids": ids})
                    answer.text_tokens += len(ids)
                    if prompt_tokens is None:
                        prompt_tokens = (info.get("usage") or {}).get("prompt_tokens", 0)
                    span = info.get("image_span_ids") or span
                    if kind == "answer_done":
                        done = {"type": "done", "finish_reason": ev.get("finish_reason", "stop"),
                                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": answer.text_tokens,
                                          "total_tokens": prompt_tokens + answer.text_tokens}}
                        yield {**done, "prompt_token_ids": prompt_ids} if answer.return_token_ids else done
                        return
                elif kind == "progress":
                    yield {"type": "image_progress", "image": answer.images, "step": ev.get("step"),
                           "total": ev.get("total")}
                elif kind == "partial_image":
                    yield {**ev, "image": answer.images}
                elif kind == "image":
                    handle = ev.get("image_handle")
                    if not isinstance(handle, dict):
                        raise APIError(502, "generation service returned no float image for an interleaved "
                                       "answer", code="upstream_protocol_error")
                    answer.floats.append(handle)
                    answer.transcript.append({"image": handle, "width": ev.get("width"),
                                              "height": ev.get("height")})
                    image = {"type": "image", "image": answer.images - 1, "b64": ev["b64"],
                             "format": ev.get("format", answer.generate["output_format"]), "width": ev.get("width"),
                             "height": ev.get("height"), "seed": ev.get("seed")}
                    if answer.return_token_ids:
                        image["token_ids"] = image_span(span, ev.get("width"), ev.get("height"))
                    yield image
    finally:
        if answer.floats:
            url = pins.get("understanding") or state.und.endpoints[0].url
            hdrs = engine_headers(state.config.internal_token, answer.request_id)
            state.janitor.later(release_pages(state.http, url, list(answer.floats), hdrs))


def image_span(span_ids: Optional[list[int]], width: int, height: int) -> list[int]:
    """A generated image as the token ids it takes in the sequence: <img>, one <IMG_CONTEXT> per 32-px block,
    </img> (understanding's `image_span_ids`)."""
    if not span_ids or len(span_ids) != 3 or not width or not height:
        raise APIError(502, "understanding service sent no image span ids for return_token_ids",
                       code="upstream_protocol_error")
    start, context, end = span_ids
    return [start] + [context] * ((width // L.IMAGE_BLOCK) * (height // L.IMAGE_BLOCK)) + [end]


def default_max_tokens(requested: Optional[int]) -> int:
    return requested if requested is not None else L.DEFAULT_INTERLEAVE_TOKENS
