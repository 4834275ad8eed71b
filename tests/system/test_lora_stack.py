"""Multi-LoRA through a real `u1serve up` stack on the tiny checkpoint (CPU): adapters picked by `model` on both
engines, a batch mixing adapters equals each request alone, prefix-cache entries keyed by the adapter, load and
unload behind the operator key (a tenant key is a 403, a path outside --allowed-local-dirs a 400), and an unload
while a request uses the adapter (docs/lora.md)."""
import itertools
import threading

import httpx
import pytest

from services.kit import sse
from services.model.tiny_lora import write_tiny_lora
from tests.system.stackproc import ONE_THREAD, RunningStack
from tests.waiting import wait_until

KEY = "sk-lora-test"
ADMIN_KEY = "sk-lora-test-operator"
_SALTS = itertools.count()


@pytest.fixture(scope="module")
def lora_stack(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-stack")
    tiny = tiny_checkpoint("u1")
    paths = {"a": write_tiny_lora(str(d / "a"), tiny, seed=11),
             "b": write_tiny_lora(str(d / "b.safetensors"), tiny, seed=12, layout="official"),
             "c": write_tiny_lora(str(d / "c"), tiny, seed=13, branches=("gen",))}
    (d / "keys").write_text(KEY + "\n")
    (d / "admin-keys").write_text(ADMIN_KEY + "\n")
    s = RunningStack(tiny, "colocate", str(d), extra=[
        "--api-key-file", str(d / "keys"), "--admin-api-key-file", str(d / "admin-keys"), "--enable-runtime-lora",
        "--allowed-local-dirs", str(d), "--lora-modules", f"a={paths['a']}", f"b={paths['b']}",
        "--max-loras", "2", "--max-lora-rank", "8"], env=ONE_THREAD).wait_ready()   # compared only with itself
    s.paths = paths
    yield s
    s.stop_clean()


@pytest.fixture()
def admin(lora_stack):
    """The operator: adapter load / unload take its key (services/gateway/roles.py)."""
    with httpx.Client(base_url=lora_stack.base, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as cl:
        yield cl


@pytest.fixture()
def c(lora_stack):
    with httpx.Client(base_url=lora_stack.base, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as cl:
        yield cl


def salt() -> str:
    return f"lora-salt-{next(_SALTS)}"


def chat(c, model, content="Tell me about foxes in the snow.", cache_salt=None):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def image_body(model, seed=5, steps=3, **kw):
    return {"model": model, "prompt": "a red fox in the snow", "size": "64x64", "seed": seed,
            "num_inference_steps": steps, "guidance_scale": 3.0, "cache_salt": salt(), **kw}


def image(c, model, **kw):
    r = c.post("/v1/images/generations", json=image_body(model, **kw))
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["b64_json"]


def test_models_lists_the_adapters_and_unknown_models_are_404(c):
    ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert ids == ["sensenova-u1", "a", "b"]
    for path, body in (("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/images/generations", image_body("nope"))):
        r = c.post(path, json=body)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_a_batch_mixing_adapters_equals_each_request_alone(c):
    models = ["a", "b", "sensenova-u1"]
    alone_img = {m: image(c, m) for m in models}
    alone_txt = {m: chat(c, m, cache_salt=salt())["choices"][0]["message"]["content"] for m in models}
    assert len(set(alone_img.values())) == 3 and len(set(alone_txt.values())) == 3   # each adapter changes both
    results = {}

    def run(kind, m):
        results[(kind, m)] = image(c, m) if kind == "img" else \
            chat(c, m, cache_salt=salt())["choices"][0]["message"]["content"]
    threads = [threading.Thread(target=run, args=(k, m)) for m in models for k in ("img", "txt")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for m in models:
        assert results[("img", m)] == alone_img[m], m
        assert results[("txt", m)] == alone_txt[m], m


def test_prefix_cache_entries_are_keyed_by_the_adapter(c):
    prompt = "A long shared prompt about foxes " * 8
    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]   # noqa: E731
    chat(c, "sensenova-u1", prompt)
    assert cached(chat(c, "sensenova-u1", prompt)) > 0      # the base model's own entries are reused
    assert cached(chat(c, "a", prompt)) == 0                 # never another adapter's (nor the base's)
    assert cached(chat(c, "a", prompt)) > 0
    assert cached(chat(c, "b", prompt)) == 0


def test_interleaved_answers_use_the_adapter(c):
    """Both the segments' text (understanding) and their images (generation) run with the request's adapter."""
    def answer(model):
        body = {"model": model, "messages": [{"role": "user", "content": "Draw a red house, then describe it"}],
                "modalities": ["text", "image"], "max_tokens": 12, "logit_bias": {"262": 5.0}, "cache_salt": salt(),
                "image_config": {"size": "64x64", "num_inference_steps": 2, "seed": 3, "max_images": 1}}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return [p for p in r.json()["choices"][0]["message"]["content"] if p["type"] == "image_url"]
    base, adapted = answer("sensenova-u1"), answer("a")
    assert len(base) == 1 and len(adapted) == 1 and base != adapted
    assert answer("a") == adapted


def test_step_cache_with_an_adapter(c):
    """A cached step runs the later layers on a subset of the rows: their adapter slots follow them."""
    cache = {"mode": "first_block", "threshold": 10.0}
    img = image(c, "a", seed=4, steps=6, cache=cache)
    assert img == image(c, "a", seed=4, steps=6, cache=cache) and img != image(c, "sensenova-u1", seed=4, steps=6,
                                                                             cache=cache)


def test_load_and_unload_are_admin_routes(lora_stack, c, admin):
    r = httpx.post(lora_stack.base + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert r.status_code == 401
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": lora_stack.paths["a"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required", r.text
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope/adapter"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "path_not_allowed", r.text
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": lora_stack.paths["a"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_already_loaded"
    r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "zz"})
    assert r.status_code == 404


def test_unload_while_a_request_uses_the_adapter(lora_stack, c, admin):
    """The running request finishes with the adapter (the same image as alone); new requests get 404 at once; its
    slot is not reused until the request ends (a load meanwhile is refused, and rolled back where it took), then the
    name can be loaded again."""
    steps = 30
    want = image(c, "a", seed=9, steps=steps)
    out, started = {}, threading.Event()

    def long_request():
        body = image_body("a", seed=9, steps=steps, stream=True, partial_images=3)
        with c.stream("POST", "/v1/images/generations", json=body) as r:
            assert r.status_code == 200
            for ev in sse.events(r.iter_lines()):
                if ev.get("type", "").endswith("partial_image"):
                    started.set()
                if ev.get("type", "").endswith("completed"):
                    out["b64"] = ev["b64_json"]
    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(120)
    r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200, r.text
    assert c.post("/v1/images/generations", json=image_body("a")).status_code == 404
    if t.is_alive():      # a's slot on generation still serves it: every slot is taken there
        r = admin.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": lora_stack.paths["c"]})
        assert r.status_code in (200, 409), r.text
        if r.status_code == 409:
            assert r.json()["error"]["code"] == "lora_slots_full"
            assert "c" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
        else:
            admin.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    t.join(300)
    assert out["b64"] == want
    wait_until(lambda: admin.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": lora_stack.paths["a"]}
                              ).status_code == 200, 30, interval=0.2)
    assert image(c, "a", seed=9, steps=3) == image(c, "a", seed=9, steps=3)
