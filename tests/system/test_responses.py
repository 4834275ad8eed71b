"""/v1/responses through the openai SDK against the shared CPU stack (tiny model): text (greedy, sampled, think as
a reasoning item), input images, the image_generation tool (generate, edit, partial images), OpenAI's stream
events, stored responses continued with previous_response_id (an edit of the image the previous turn made),
background responses (poll, cancel), per-key ownership and what a restarted gateway says (a second gateway
process in front of the same engines, with API keys)."""
import base64
import io
import time

import httpx
import openai
import pytest
from PIL import Image

from tests.system.stackproc import GatewayProc

STEPS = 3
M = "sensenova-u1"
TOOL = {"type": "image_generation", "size": "64x64", "num_inference_steps": STEPS, "seed": 3}
KEY_A, KEY_B = "sk-responses-a", "sk-responses-b"


def decode(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()
    return im


def png_data_url(w: int = 64, h: int = 64, color=(200, 30, 60)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, *images: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "input_image", "image_url": u} for u in images),
                                          {"type": "input_text", "text": text}]}]


def test_text_greedy_is_deterministic_and_stored(openai_client):
    a = openai_client.responses.create(model="sensenova-u1", input="Write a short poem", temperature=0,
                                       max_output_tokens=8)
    b = openai_client.responses.create(model="sensenova-u1", input="Write a short poem", temperature=0,
                                       max_output_tokens=8)
    assert a.object == "response" and a.status in ("completed", "incomplete") and a.id.startswith("resp_")
    assert a.output[-1].type == "message" and a.output_text == b.output_text
    assert a.usage.input_tokens > 0 and a.usage.output_tokens > 0
    again = openai_client.responses.retrieve(a.id)
    assert again.id == a.id and again.output_text == a.output_text


def test_text_sampled_and_think_as_reasoning(openai_client):
    r = openai_client.responses.create(input="hi", temperature=1.0, top_p=0.9, max_output_tokens=6, extra_body={"seed": 5},
                                       store=False)
    assert r.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):          # store: false keeps nothing
        openai_client.responses.retrieve(r.id)
    t = openai_client.responses.create(input="hi", reasoning={"effort": "medium"}, max_output_tokens=12,
                                       temperature=0)
    kinds = [o.type for o in t.output]
    assert kinds[0] == "reasoning" and t.output[0].content[0].type == "reasoning_text", kinds


def test_text_stream_events_parse(openai_client):
    with openai_client.responses.stream(model=M, input=user("what is this?", png_data_url()), max_output_tokens=6,
                                        temperature=0) as stream:
        events = list(stream)
    final = events[-1].response          # response.completed, or .incomplete at max_output_tokens
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text


def test_image_tool_generate_and_stream(openai_client):
    r = openai_client.responses.create(input="a red kite", tools=[{**TOOL, "output_format": "webp"}])
    call = r.output[-1]
    assert call.type == "image_generation_call" and call.status == "completed"
    assert decode(call.result).size == (64, 64) and decode(call.result).format == "WEBP"
    with openai_client.responses.stream(model=M, input="a kite", tools=[{**TOOL, "partial_images": 2}]) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    for name in ("in_progress", "generating", "partial_image", "completed"):
        assert f"response.image_generation_call.{name}" in kinds, kinds
    partials = [e for e in events if e.type == "response.image_generation_call.partial_image"]
    assert [p.partial_image_index for p in partials] == [0, 1] and decode(partials[0].partial_image_b64)
    done = [e for e in events if e.type == "response.output_item.done"][-1]
    assert done.item.type == "image_generation_call" and decode(done.item.result).size == (64, 64)
    assert kinds[-1] == "response.completed"


def test_quality_maps_to_steps_and_bad_options(openai_client, stack):
    r = openai_client.responses.create(input="x", tools=[{"type": "image_generation", "size": "64x64",
                                                           "quality": "low", "partial_images": 1}], stream=True)
    partial = [e for e in r if e.type == "response.image_generation_call.partial_image"]
    assert partial                      # low quality still makes an image (fewer steps)
    for bad, param in (({"background": "transparent"}, "tools[0].background"), ({"size": "65x64"}, "size")):
        with pytest.raises(openai.BadRequestError) as err:
            openai_client.responses.create(input="x", tools=[{**TOOL, **bad}])
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(input="x", tools=[{"type": "web_search"}])
    assert err.value.body["code"] == "unsupported_value"
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.responses.create(input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"


def test_two_turn_image_edit_without_resending(openai_client):
    first = openai_client.responses.create(input="a red square", tools=[TOOL])
    assert first.output[-1].action == "generate"
    second = openai_client.responses.create(input="make it blue", previous_response_id=first.id, tools=[TOOL])
    call = second.output[-1]
    assert call.type == "image_generation_call" and call.action == "edit" and decode(call.result).size == (64, 64)
    assert second.previous_response_id == first.id
    # a text question about the image the previous turn made
    third = openai_client.responses.create(input="what color is it?", previous_response_id=second.id,
                                           max_output_tokens=4, temperature=0)
    assert third.output[-1].type == "message"


def test_multi_turn_text_reports_cached_tokens(openai_client):
    long = "Tell me about the sea and the sky and the wind. " * 12
    first = openai_client.responses.create(input=long, max_output_tokens=4, temperature=0)
    second = openai_client.responses.create(input="and more?", previous_response_id=first.id, max_output_tokens=4,
                                            temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0, second.usage


def test_background_poll_and_cancel(openai_client):
    r = openai_client.responses.create(input="a slow kite", background=True,
                                       tools=[{**TOOL, "num_inference_steps": 2}])
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 120
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.3)
        r = openai_client.responses.retrieve(r.id)
    assert r.status == "completed" and decode(r.output[-1].result).size == (64, 64)
    slow = openai_client.responses.create(input="a long one", background=True,
                                          tools=[{**TOOL, "num_inference_steps": 200, "size": "256x256"}])
    cancelled = openai_client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert openai_client.responses.retrieve(slow.id).status == "cancelled"
    foreground = openai_client.responses.create(input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):        # only background responses are cancellable
        openai_client.responses.cancel(foreground.id)


def test_background_stream_is_the_responses_and_outlives_its_reader(openai_client):
    stream = openai_client.responses.create(input="a streamed kite", background=True, stream=True,
                                            tools=[{**TOOL, "num_inference_steps": 2, "partial_images": 1}])
    events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.queued"], types
    assert events[0].response.status == "queued" and events[0].response.background
    assert "response.in_progress" in types and "response.image_generation_call.partial_image" in types, types
    assert types[-1] == "response.completed" and types.count("response.created") == 1, types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert decode(done.output[-1].result).size == (64, 64)
    stored = openai_client.responses.retrieve(done.id)
    assert stored.status == "completed" and stored.output[-1].result == done.output[-1].result
    text = list(openai_client.responses.create(input="hello", max_output_tokens=4, background=True, stream=True))
    assert text[-1].type in ("response.completed", "response.incomplete") and text[-1].response.output_text == \
        "".join(e.delta for e in text if e.type == "response.output_text.delta")
    # a reader that leaves after the first event: the response runs on to its end
    stream = openai_client.responses.create(input="a kite nobody watches", background=True, stream=True,
                                            tools=[{**TOOL, "num_inference_steps": 2}])
    first = next(iter(stream))
    stream.close()
    r, deadline = openai_client.responses.retrieve(first.response.id), time.monotonic() + 120
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.3)
        r = openai_client.responses.retrieve(r.id)
    assert r.status == "completed" and decode(r.output[-1].result).size == (64, 64)
    # a cancel ends the stream of the response it cancels
    stream = openai_client.responses.create(input="a long one", background=True, stream=True,
                                            tools=[{**TOOL, "num_inference_steps": 200, "size": "256x256"}])
    events = iter(stream)
    first = next(events)
    assert openai_client.responses.cancel(first.response.id).status == "cancelled"
    rest = list(events)
    assert all(e.type != "response.completed" for e in rest), [e.type for e in rest]


@pytest.fixture()
def keyed_gateway(stack, tmp_path):
    """A second gateway in front of the stack's engines, with two API keys and room for one background job."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    und, gen = f"http://127.0.0.1:{stack.und_port}", f"http://127.0.0.1:{stack.gen_port}"
    flags = ("--api-key-file", str(keys), "--internal-token", stack.token, "--responses-max-background", "1")
    procs = [GatewayProc(und, gen, *flags, log_dir=str(tmp_path)).wait_up()]

    def restart() -> GatewayProc:
        procs[-1].stop()
        procs.append(GatewayProc(und, gen, *flags, log_dir=str(tmp_path)).wait_up())
        return procs[-1]

    yield procs[0], restart
    for p in procs:
        out = p.stop()
        assert "Traceback" not in out, out


def test_ownership_bounds_and_restart(keyed_gateway):
    gw, restart = keyed_gateway

    def client(key: str, base: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)

    a, b = client(KEY_A, gw.base), client(KEY_B, gw.base)
    with pytest.raises(openai.AuthenticationError):
        client("sk-wrong", gw.base).responses.create(input="x")
    mine = a.responses.create(input="hello", max_output_tokens=2, temperature=0)
    assert a.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError) as err:       # another key: as if it never was
        b.responses.retrieve(mine.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.create(input="more", previous_response_id=mine.id)
    running = a.responses.create(input="slow", background=True,
                                 tools=[{**TOOL, "num_inference_steps": 200, "size": "256x256"}])
    full = httpx.post(gw.base + "/v1/responses", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30,
                      json={"input": "x", "background": True})
    assert full.status_code == 429 and int(full.headers["retry-after"]) > 0
    assert full.json()["error"]["code"] == "too_many_background_responses"
    gw2 = restart()                        # the running one is cancelled; the new process knows nothing of it
    with pytest.raises(openai.NotFoundError) as err:
        client(KEY_A, gw2.base).responses.retrieve(running.id)
    assert err.value.body["code"] == "response_lost_on_restart" and "restarted" in err.value.body["message"]
