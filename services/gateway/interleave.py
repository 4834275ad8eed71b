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
from services.contract.control import ReleaseRequest
from services.contract.interleave import InterleaveSegmentRequest
from services.kit.errors import APIError

from .jobs import GenerationTarget, generate_body
from .routing import conversation_key
from .upstream import CONTROL_TIMEOUT_S, Deadline, engine_headers, tell


@dataclass
class Answer:
    """One interleaved answer: what every segment needs, and the answer so far."""
    request_id: str
    messages: list[dict]               # the client's conversation (input images as data URLs, checked)
    think: bool
    max_tokens: int                    # text tokens over the whole answer
    max_images: int
    generate: dict                     # jobs.generate_fields: GenerateRequest fields but the per-image ones
    logit_bias: Optional[dict] = None
    cache_salt: Optional[str] = None
    transcript: list[dict] = field(default_factory=list)
    floats: list[dict] = field(default_factory=list)        # the float images' handles (the answer's to free)
    text_tokens: int = 0

    @property
    def images(self) -> int:
        return len(self.floats)


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
            logit_bias=a.logit_bias, cache_salt=a.cache_salt).model_dump(mode="json", exclude_none=True)

    @staticmethod
    def route_key(prefix_body: dict) -> int:
        """The answer's conversation: every segment goes where its earlier turns are cached."""
        return conversation_key(prefix_body)

    def generate_body(self, handles: dict) -> dict[str, Any]:
        return generate_body(self.answer.generate, handles, request_id=self.request_id,
                             noise_draw=self.answer.images, export_image=True)


async def run(state, answer: Answer, deadline: Deadline) -> AsyncIterator[dict]:
    """The answer's events: text {reasoning, content}; per image image_progress {image, step, total},
    partial_image {image, ...generation's fields}, image {image, b64, format, width, height, seed}; finally
    done {finish_reason, usage}. Raises APIError; closing it early undoes the segment in flight and frees the
    float images."""
    pins: dict = {}
    prompt_tokens = None
    try:
        for k in itertools.count():
            seg = Segment(answer, k)
            async for ev in state.orchestrator.run(seg, deadline, pins):
                kind = ev.get("type")
                if kind == "text":
                    yield ev
                elif kind in ("think_done", "answer_done"):
                    info = ev.get("prefix", ev)
                    ids = list(info.get("token_ids") or [])
                    answer.transcript.append({"token_ids": ids})
                    answer.text_tokens += len(ids)
                    if prompt_tokens is None:
                        prompt_tokens = (info.get("usage") or {}).get("prompt_tokens", 0)
                    if kind == "answer_done":
                        yield {"type": "done", "finish_reason": ev.get("finish_reason", "stop"),
                               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": answer.text_tokens,
                                         "total_tokens": prompt_tokens + answer.text_tokens}}
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
                    yield {"type": "image", "image": answer.images - 1, "b64": ev["b64"],
                           "format": ev.get("format", answer.generate["output_format"]), "width": ev.get("width"),
                           "height": ev.get("height"), "seed": ev.get("seed")}
    finally:
        if answer.floats:
            url = pins.get("understanding") or state.und.endpoints[0].url
            hdrs = engine_headers(state.config.internal_token, answer.request_id)
            state.janitor.later(tell(state.http, url + "/internal/release",
                                     ReleaseRequest(handles=list(answer.floats)).model_dump(), hdrs, CONTROL_TIMEOUT_S))


def default_max_tokens(requested: Optional[int]) -> int:
    return requested if requested is not None else L.DEFAULT_INTERLEAVE_TOKENS
