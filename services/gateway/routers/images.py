"""POST /v1/images/generations and /v1/images/edits (JSON with data URLs, or multipart files)."""
from __future__ import annotations

import copy
import time
from typing import Any, Union

from fastapi import APIRouter, Depends, Request
from starlette.datastructures import UploadFile

from services.contract import limits as L
from services.contract.image import ImageEditRequest, ImageGenerationRequest
from services.kit import timeline
from services.kit.errors import APIError, bad_request
from services.kit.web import ParsedJsonRoute, json_body

from ..context import cache_salt, gateway, request_id
from ..inputs import Raw, data_url
from ..jobs import ImageJob, build_job, check_options
from ..relay import client_gone, collect_job, stream_job
from ..schemas import ERRORS, ImagesResponse, ImageStreamEvent, sse_content
from ..state import GatewayState

router = APIRouter(tags=["images"], route_class=ParsedJsonRoute)
MULTIPART_IMAGE_FIELDS = ("image", "image[]")


def _stream_doc(prefix: str) -> dict:
    return {200: {"description": f"JSON, or with stream: SSE events {prefix}.* then [DONE]",
                  "content": sse_content(ImageStreamEvent)}}


def _edit_body_doc() -> dict:
    """/openapi.json for the edit body: the same fields as JSON (data URLs) or as multipart (files)."""
    as_json = ImageEditRequest.model_json_schema()
    form = copy.deepcopy(as_json)
    form["title"] = "ImageEditForm"
    form["properties"]["image"] = {
        "type": "array", "items": {"type": "string", "format": "binary"}, "minItems": 1,
        "maxItems": L.MAX_IMAGES_PER_REQUEST,
        "description": f"1 to {L.MAX_IMAGES_PER_REQUEST} image files, as 'image' or 'image[]'"}
    form["required"] = ["prompt", "image"]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form},
                                                          "application/json": {"schema": as_json}}}}


def image_items(job: ImageJob, images: list[dict], think_text: str | None) -> list[dict]:
    items = []
    for im in images:
        item: dict[str, Any] = {"revised_prompt": think_text, "seed": im.get("seed", job.seed)}
        if im.get("branch_steps"):   # denoising steps each CFG branch computed / reused (step caching)
            item["branch_steps"] = im["branch_steps"]
        if im.get("applied"):        # which speed options the steps actually ran with (cache, graphs, fp8)
            item["applied"] = im["applied"]
        if job.response_format == "url":
            item["url"] = data_url(im["b64"], im.get("format", job.output_format))
        else:
            item["b64_json"] = im["b64"]
        items.append(item)
    return items


_OWN_IMAGE_FIELDS = {"type", "request_id", "b64", "format", "width", "height", "index", "seed"}


def stream_events(job: ImageJob, prefix: str, created: int):
    """Engine event -> client events. Fields the engines add to progress/image events pass through; unknown
    event types are not relayed."""
    def convert(ev: dict) -> list[dict]:
        kind = ev.get("type")
        if kind == "think_delta" and ev.get("text"):
            return [{"type": f"{prefix}.think_delta", "text": ev["text"]}]
        if kind == "think_done" and ev.get("think_text"):
            return [{"type": f"{prefix}.think_done", "text": ev["think_text"]}]
        if kind == "progress":
            return [{**{k: v for k, v in ev.items() if k not in ("type", "request_id")},
                     "type": f"{prefix}.progress"}]
        if kind == "partial_image":      # OpenAI's partial_images: a preview (x0 estimate) while denoising
            return [{"type": f"{prefix}.partial_image", "partial_image_index": ev.get("partial_image_index", 0),
                     "index": ev.get("index", 0), "b64_json": ev["b64"].encode(), "created_at": created,
                     "output_format": ev.get("format", "jpeg"), "size": f"{ev.get('width')}x{ev.get('height')}",
                     "step": ev.get("step"), "background": "opaque", "quality": "auto"}]
        if kind == "image":
            fmt = ev.get("format", job.output_format)
            out = {k: v for k, v in ev.items() if k not in _OWN_IMAGE_FIELDS}
            out.update({"type": f"{prefix}.completed", "index": ev.get("index", 0), "created_at": created,
                        "output_format": fmt,
                        "size": f"{ev.get('width', job.width)}x{ev.get('height', job.height)}",
                        "seed": ev.get("seed", job.seed), "background": "opaque", "quality": "auto"})
            if job.response_format == "url":
                out["url"] = data_url(ev["b64"], fmt)
            else:
                out["b64_json"] = ev["b64"].encode()   # bytes: sse.encode splices base64 in without json.dumps
            return [out]
        return []
    return convert


async def serve(request: Request, state: GatewayState, job: ImageJob, prefix: str):
    created = int(time.time())
    timeline.mark("gateway", "request")
    if job.stream:
        return await stream_job(request, state, job, stream_events(job, prefix, created))
    result = await collect_job(request, state, job)
    if result is None:
        return client_gone()
    think_text, images = result
    out = {"created": created, "data": image_items(job, images, think_text), "output_format": job.output_format,
           "size": job.size, "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}}
    if think_text:
        out["think_text"] = think_text
    timeline.mark("gateway", "response")
    return out


@router.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
             responses={**ERRORS, **_stream_doc("image_generation")})
async def generations(body: ImageGenerationRequest, request: Request, state: GatewayState = Depends(gateway)):
    """Text to image. OpenAI's fields plus the u1serve extensions (top level or under extra_body)."""
    job = build_job(state.config, body, mode="t2i", prompt=body.prompt, request_id=request_id(request),
                    cache_salt=cache_salt(request, state, body.cache_salt), lora=state.adapters.resolve(body.model))
    return await serve(request, state, job, "image_generation")


async def _edit_request(request: Request) -> tuple[ImageEditRequest, list[tuple[str, Raw]]]:
    """The edit's fields and its raw input images, from JSON or multipart."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        req = ImageEditRequest.model_validate(await json_body(request))
        return req, [(f"image[{i}]", ref) for i, ref in enumerate(req.image)]
    if not ctype.startswith("multipart/form-data"):
        raise bad_request("POST /v1/images/edits takes multipart/form-data (or JSON with data-URL images)",
                          code="invalid_content_type")
    try:
        form = await request.form(max_files=L.MAX_IMAGES_PER_REQUEST + 4, max_fields=100,
                                  max_part_size=1024 * 1024)
    except APIError:                    # the body limit (kit.bodies), reached while the form streamed in
        raise
    except Exception as exc:   # the multipart parser's own errors are client errors
        raise bad_request(f"malformed multipart body: {exc}", code="invalid_multipart") from None
    values: dict[str, Any] = {}
    images: list[tuple[str, Raw]] = []
    try:
        for key, value in form.multi_items():
            if key in MULTIPART_IMAGE_FIELDS:
                raw: Union[bytes, str] = await value.read() if isinstance(value, UploadFile) else value
                images.append((f"image[{len(images)}]", raw))
            elif isinstance(value, UploadFile):
                raise bad_request(f"unexpected file field {key!r}; images go under 'image' or 'image[]'",
                                  param=key)
            else:
                values[key] = value
    finally:
        await form.close()              # the spooled upload files
    return ImageEditRequest.model_validate(values), images


@router.post("/v1/images/edits", response_model=ImagesResponse, response_model_exclude_none=True,
             responses={**ERRORS, **_stream_doc("image_edit")}, openapi_extra=_edit_body_doc())
async def edits(request: Request, state: GatewayState = Depends(gateway)):
    """Edit 1 to 4 input images. Without a size, the output has the first input's aspect ratio at the default
    area."""
    req, raws = await _edit_request(request)
    if not raws:
        raise bad_request(f"'image' is required (1 to {L.MAX_IMAGES_PER_REQUEST} images)", param="image",
                          code="missing_required_parameter")
    if len(raws) > L.MAX_IMAGES_PER_REQUEST:
        raise bad_request(f"at most {L.MAX_IMAGES_PER_REQUEST} input images, got {len(raws)}", param="image",
                          code="too_many_images")
    sampler = check_options(state.config, req, "edit", req.prompt)   # before any image is decoded
    checked = await state.images.check(raws)
    job = build_job(state.config, req, mode="edit", prompt=req.prompt, request_id=request_id(request),
                    images=[c.b64 for c in checked], first_image_wh=(checked[0].width, checked[0].height),
                    cache_salt=cache_salt(request, state, req.cache_salt), lora=state.adapters.resolve(req.model),
                    checked=sampler)
    return await serve(request, state, job, "image_edit")
