"""/openapi.json describes every public route: request body and response, each field with its type, range and
default (the contract's, or this server's tighter limit); /docs serves Swagger UI. No network needed. The
`gateway` fixture has API keys, so both are behind the key (--public-docs opens them)."""
import httpx
import pytest

from services.contract import limits as L

from .conftest import API_KEY, MAX_STEPS

KEY = {"Authorization": f"Bearer {API_KEY}"}

PUBLIC_POSTS = ("/v1/chat/completions", "/v1/images/generations", "/v1/images/edits")


@pytest.fixture(scope="module")
def spec(gateway):
    r = httpx.get(gateway + "/openapi.json", timeout=10, headers=KEY)
    assert r.status_code == 200
    return r.json()


def sse_payload(media: dict) -> dict:
    """The JSON payload schema of a `text/event-stream` entry (its `schema` describes one SSE event)."""
    data = media["schema"]["properties"]["data"]["anyOf"]
    return next(d for d in data if "contentSchema" in d)["contentSchema"]["anyOf"][0]


def resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def prop(spec: dict, schema: dict, name: str) -> dict:
    """A property, with the non-null member of an Optional merged in."""
    p = dict(resolve(spec, schema)["properties"][name])
    for variant in p.pop("anyOf", []):
        if variant.get("type") != "null":
            p.update(resolve(spec, variant))
    return p


def body_schema(spec: dict, path: str, ctype: str = "application/json") -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"][ctype]["schema"]


def test_every_public_route_declares_request_and_response(spec):
    for path in PUBLIC_POSTS:
        op = spec["paths"][path]["post"]
        assert "application/json" in op["requestBody"]["content"], path
        ok = op["responses"]["200"]["content"]
        assert resolve(spec, ok["application/json"]["schema"])["properties"], path
        assert "text/event-stream" in ok, path
        for status in ("400", "401", "429", "503", "504"):
            err = resolve(spec, op["responses"][status]["content"]["application/json"]["schema"])
            assert set(resolve(spec, err["properties"]["error"])["properties"]) == {"message", "type", "param", "code"}
        assert "422" not in op["responses"], path
    models = spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert "data" in resolve(spec, models)["properties"]


def test_image_extension_fields_with_their_limits_and_defaults(spec):
    gen = body_schema(spec, "/v1/images/generations")
    steps = prop(spec, gen, "num_inference_steps")
    assert steps["type"] == "integer" and steps["minimum"] == 1
    assert steps["maximum"] == MAX_STEPS        # this server's --max-steps, tighter than the contract's
    seed = prop(spec, gen, "seed")
    assert (seed["minimum"], seed["maximum"]) == (0, L.SEED_MAX)
    assert prop(spec, gen, "guidance_scale")["maximum"] == L.MAX_GUIDANCE
    assert prop(spec, gen, "max_think_tokens")["maximum"] == L.MAX_THINK_TOKENS
    assert set(prop(spec, gen, "cfg_norm")["enum"]) == {"none", "global", "channel", "cfg_zero_star"}
    assert prop(spec, gen, "output_format")["default"] == "png"
    n = prop(spec, gen, "n")
    assert (n["default"], n["maximum"]) == (1, L.MAX_IMAGES_PER_REQUEST)
    assert prop(spec, gen, "prompt")["maxLength"] == L.MAX_PROMPT_CHARS
    assert "cache_salt" in resolve(spec, gen)["properties"]
    assert "prompt" in resolve(spec, gen)["required"]


def test_edit_body_as_multipart_and_json(spec):
    form = body_schema(spec, "/v1/images/edits", "multipart/form-data")
    image = form["properties"]["image"]
    assert image["items"]["format"] == "binary" and image["maxItems"] == L.MAX_IMAGES_PER_REQUEST
    assert prop(spec, form, "num_inference_steps")["maximum"] == MAX_STEPS
    as_json = body_schema(spec, "/v1/images/edits")
    assert prop(spec, as_json, "image")["type"] == "array"
    assert prop(spec, as_json, "image_guidance_scale")["maximum"] == L.MAX_GUIDANCE


def test_chat_fields_with_their_limits(spec):
    chat = body_schema(spec, "/v1/chat/completions")
    assert prop(spec, chat, "temperature")["maximum"] == L.MAX_TEMPERATURE
    top_p = prop(spec, chat, "top_p")
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    assert prop(spec, chat, "seed")["maximum"] == L.SEED_MAX
    assert prop(spec, chat, "presence_penalty")["minimum"] == -L.MAX_ABS_PENALTY
    image_config = prop(spec, chat, "image_config")
    assert prop(spec, image_config, "num_inference_steps")["maximum"] == MAX_STEPS
    assert "cache_salt" in resolve(spec, chat)["properties"]


def test_no_raw_pydantic_bounds_left(spec):
    """pydantic writes the bounds of Optional numbers as ge/le; the schema has only JSON Schema keywords."""
    found = []

    def walk(node, where):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number") and {"ge", "le", "gt", "lt"} & set(node):
                found.append(where)
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")
    walk(spec, "")
    assert not found, found


def test_docs_page_is_served_behind_the_key(gateway):
    r = httpx.get(gateway + "/docs", timeout=10, headers=KEY)
    assert r.status_code == 200 and "swagger" in r.text.lower() and "/openapi.json" in r.text
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(gateway + path, timeout=10).status_code == 401
