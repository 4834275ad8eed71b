"""/openapi.json and /docs for what issue 14 added: chat n / logprobs / top_logprobs / logit_bias, interleaved
answers (modalities, image_config.max_images), partial_images on every image request, the stream chunk and the
logprobs of a response; and the playground is served but not part of the API schema. No engines needed."""
import httpx
import pytest

from services.contract import limits as L

from .test_openapi import KEY, body_schema, prop, resolve, sse_payload

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def spec(gateway):
    return httpx.get(gateway + "/openapi.json", timeout=10, headers=KEY).json()


def test_chat_fields_with_their_limits(spec):
    chat = body_schema(spec, CHAT)
    assert prop(spec, chat, "n")["maximum"] == L.MAX_CHAT_CHOICES and prop(spec, chat, "n")["minimum"] == 1
    top = prop(spec, chat, "top_logprobs")
    assert (top["minimum"], top["maximum"]) == (0, L.MAX_TOP_LOGPROBS)
    assert prop(spec, chat, "logprobs")["default"] is False
    assert "-100" in prop(spec, chat, "logit_bias")["description"]
    assert "'text', 'image'" in prop(spec, chat, "modalities")["description"]
    assert "absent" in prop(spec, prop(spec, chat, "chat_template_kwargs"), "enable_thinking")["description"]
    image_config = prop(spec, chat, "image_config")
    cap = prop(spec, image_config, "max_images")
    assert (cap["minimum"], cap["maximum"], cap["default"]) == (0, L.MAX_INTERLEAVE_IMAGES, L.DEFAULT_INTERLEAVE_IMAGES)
    assert prop(spec, image_config, "partial_images")["maximum"] == L.MAX_PARTIAL_IMAGES
    size = resolve(spec, image_config)["properties"]["size"]   # one size, or one per image of an interleaved answer
    assert {a.get("type") for a in size["anyOf"]} >= {"string", "array"} and "list" in size["description"]
    assert "prompt_token_ids" in prop(spec, chat, "return_token_ids")["description"]


def test_partial_images_on_image_requests(spec):
    for path, ctype in (("/v1/images/generations", "application/json"), ("/v1/images/edits", "multipart/form-data")):
        p = prop(spec, body_schema(spec, path, ctype), "partial_images")
        assert (p["minimum"], p["maximum"], p["default"]) == (0, L.MAX_PARTIAL_IMAGES, 0)
    event = spec["paths"]["/v1/images/generations"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert "partial_image_index" in sse_payload(event)["properties"]


def test_chat_response_and_chunk_models(spec):
    ok = spec["paths"][CHAT]["post"]["responses"]["200"]["content"]
    choice = resolve(spec, prop(spec, ok["application/json"]["schema"], "choices")["items"])
    token = resolve(spec, prop(spec, prop(spec, choice, "logprobs"), "content")["items"])
    assert {"token", "logprob", "bytes", "top_logprobs"} <= set(token["properties"])
    assert sse_payload(ok["text/event-stream"])["title"] == "ChatCompletionChunk"
    defs = ok["text/event-stream"]["schema"].get("$defs", {})
    delta = defs["ChatDelta"]["properties"]
    assert {"images", "image_progress", "partial_image", "reasoning_content"} <= set(delta)


def test_playground_is_served_and_open(gateway):
    r = httpx.get(gateway + "/", timeout=10, follow_redirects=True)
    assert r.status_code == 200 and r.url.path == "/playground"       # no API key needed for the page itself
    assert "playground.js" in r.text
    assert httpx.get(gateway + "/playground/static/nope.js", timeout=10).status_code == 404
    assert httpx.get(gateway + "/v1/models", timeout=10).status_code == 401   # the API still wants its key
