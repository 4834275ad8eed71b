"""Live weight updates through the gateway on a real `u1serve up` stack (tiny checkpoint, CPU): versions, refused updates, the prefix cache, requests in flight during an
update, the upload and LoRA paths, and the end state compared with a fresh stack started on the updated
checkpoint (same seeds: the same bytes)."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import shutil
import threading

import httpx
import pytest
import torch
from safetensors.torch import save_file

from services.model import weights_io as W
from services.model.loader import load_model
from tests.system.stackproc import RunningStack
from tests.waiting import wait_until

API_KEY = "sk-weights-test"
ADMIN_KEY = "sk-weights-test-operator"       # weight updates need the operator key (services/gateway/roles.py)
STACK_FLAGS: list[str] = []       # CFG-parallel staging: tests/generation/test_cfg_parallel.py
GEN_KEYS = ("language_model.model.layers.0.self_attn.k_proj_mot_gen.weight",
            "language_model.model.layers.1.mlp_mot_gen.up_proj.weight",
            "fm_modules.fm_head.2.weight")
UND_KEYS = ("language_model.model.layers.1.self_attn.q_proj.weight", "language_model.lm_head.weight")
LORA_MODULES = ("language_model.model.layers.0.self_attn.q_proj_mot_gen",
                "language_model.model.layers.1.mlp_mot_gen.down_proj",
                "language_model.model.layers.0.mlp.gate_proj")
CHAT = "Tell me about foxes in the snow, please."
LONG = "Once upon a time " * 12          # long enough for the prefix cache to hold pages of it


def start_stack(model: str, run_dir: str) -> RunningStack:
    keys, admin = os.path.join(run_dir, "keys"), os.path.join(run_dir, "admin-keys")
    with open(keys, "w") as f:
        f.write(API_KEY + "\n")
    with open(admin, "w") as f:
        f.write(ADMIN_KEY + "\n")
    return RunningStack(model, "colocate", run_dir, extra=[
        "--api-key-file", keys, "--admin-api-key-file", admin, "--enable-rl", "--allowed-local-dirs",
        os.path.dirname(os.path.abspath(run_dir)), *STACK_FLAGS]).wait_ready()


class RoleClient(httpx.Client):
    """A tenant client whose weight updates (POST /v1/rl/weights*) go with the operator key."""

    def post(self, url, *a, **kw):
        if str(url).startswith("/v1/rl/weights"):
            kw["headers"] = {**(kw.get("headers") or {}), "Authorization": f"Bearer {ADMIN_KEY}"}
        return super().post(url, *a, **kw)


def client(s: RunningStack) -> httpx.Client:
    return RoleClient(base_url=s.base, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})


_SALTS = itertools.count()


def fresh_salt() -> str:
    """A prefix-cache domain of its own: the prompt is computed from scratch, never read from pages cached by an
    earlier request (a cached prefix gives the same text, but not the same bits as one computed at once)."""
    return f"salt-{next(_SALTS)}"


def image(c: httpx.Client, seed: int, steps: int = 3, size: str = "64x64") -> str:
    r = c.post("/v1/images/generations", json={"prompt": "a red fox in the snow", "size": size, "seed": seed,
                                                "num_inference_steps": steps, "guidance_scale": 3.0,
                                                "cache_salt": fresh_salt()})
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["b64_json"]


def chat(c: httpx.Client, text: str = CHAT, max_tokens: int = 12, salt: str | None = None) -> tuple[str, int]:
    r = c.post("/v1/chat/completions", json={"model": "sensenova-u1", "messages": [{"role": "user", "content": text}],
                                             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                             "cache_salt": salt or fresh_salt()})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"].get("cached_tokens", 0)


def streamed_chat(c: httpx.Client, text: str, max_tokens: int, started: threading.Event | None = None) -> str:
    """A greedy streamed chat's text; `started` is set when its first token arrives (the job is then running)."""
    body = {"model": "sensenova-u1", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "cache_salt": fresh_salt(), "stream": True}
    out = []
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[len("data: "):])["choices"][0]["delta"].get("content") or ""
            if delta and started is not None:
                started.set()
            out.append(delta)
    return "".join(out)


def outputs(c: httpx.Client) -> tuple:
    return image(c, 7), chat(c)[0]


def versions(s: RunningStack, c: httpx.Client) -> set:
    got = c.get("/v1/rl/weights").json()
    assert got["generation"] == got["understanding"] == got["weights_version"], got
    for port in (s.und_port, s.gen_port):
        got_engine = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["weights_version"]
        assert got_engine == got["weights_version"]
    return got["weights_version"]


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """The updates: new values for some keys of both branches, the base values of the same keys, an adapter."""
    d = tmp_path_factory.mktemp("updates")
    base = W.checkpoint_state(load_model(tiny_dir, "both"))
    g = torch.Generator().manual_seed(11)
    new = {k: (0.2 * torch.randn(base[k].shape, generator=g)).to(torch.bfloat16) for k in GEN_KEYS + UND_KEYS}
    lora = {}
    for m in LORA_MODULES:
        w = base[m + ".weight"]
        lora[m + ".lora_down.weight"] = 0.5 * torch.randn(4, w.shape[1], generator=g)
        lora[m + ".lora_up.weight"] = 0.5 * torch.randn(w.shape[0], 4, generator=g)
        lora[m + ".alpha"] = torch.tensor(8.0)
    save_file(lora, str(d / "adapter.safetensors"))
    revert = str(d / "revert.safetensors")
    save_file({k: base[k].to(torch.bfloat16).contiguous() for k in new}, revert)
    return {"base": base, "new": W.write_tensors(new, str(d / "new")), "new_values": new, "revert": revert,
            "lora": str(d / "adapter.safetensors"), "dir": d}


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    s = start_stack(tiny_dir, str(tmp_path_factory.mktemp("weights-stack")))
    yield s
    s.stop_clean()


RECORD: dict = {}


def test_starts_at_version_0_and_refuses_bad_updates(stack, files):
    with client(stack) as c:
        assert versions(stack, c) == "0"
        RECORD["v0"] = outputs(c)
        base = files["base"]
        k_gen, k_und = GEN_KEYS[0], UND_KEYS[0]
        bad = {
            "nan": ({k_gen: torch.full(base[k_gen].shape, float("nan"))}, ["NaN or Inf", k_gen]),
            "shape": ({k_und: torch.zeros(5, 7)}, ["wrong shape", k_und, "(5, 7)"]),
            "unknown": ({"language_model.model.layers.0.self_attn.nope.weight": torch.zeros(4)},
                        ["unknown", "nope"]),
        }
        for name, (tensors, words) in bad.items():
            d = W.write_tensors({**tensors, GEN_KEYS[1]: files["new_values"][GEN_KEYS[1]]}, str(files["dir"] / name))
            r = c.post("/v1/rl/weights", json={"path": d, "version": "bad"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_weights" and all(w in err["message"] for w in words), err
        r = c.post("/v1/rl/weights", json={"path": str(files["dir"] / "missing")})
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
        r = c.post("/v1/rl/weights", json={"version": "x"})
        assert r.status_code == 400
        assert httpx.post(stack.base + "/v1/rl/weights", json={"path": files["new"]}).status_code == 401
        assert versions(stack, c) == "0"
        assert outputs(c) == RECORD["v0"]          # the old weights keep serving


def test_update_changes_outputs_and_empties_the_prefix_cache(stack, files):
    with client(stack) as c:
        chat(c, LONG, 2, salt="shared")
        assert chat(c, LONG, 2, salt="shared")[1] > 0              # the prompt is cached
        r = c.post("/v1/rl/weights", json={"path": files["new"], "version": "v1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["weights_version"] == "v1"
        assert body["updated"] == {"generation": len(GEN_KEYS), "understanding": len(UND_KEYS)}
        assert versions(stack, c) == "v1"
        _, cached = chat(c, LONG, 2, salt="shared")
        assert cached == 0                          # no KV computed under the old weights is read again
        RECORD["v1"] = outputs(c)
        assert RECORD["v1"][0] != RECORD["v0"][0] and RECORD["v1"][1] != RECORD["v0"][1]


def _health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()


def test_requests_in_flight_see_one_version_and_upload_reverts(stack, files):
    """A job running when an update comes finishes under the old weights (drain); an image whose prefix the new
    understanding weights computed while generation still drains waits for generation's commit (held), so
    it never mixes an old prefix with new denoising weights, or the reverse. Each compared with the same request
    run alone (batching changes the bits on CPU, so the in-flight ones run alone too)."""
    with client(stack) as c, cf.ThreadPoolExecutor(3) as pool:
        first, second = (lambda: image(c, 21, steps=40, size="128x128")), (lambda: image(c, 22, steps=4))
        old = (first(), second())

        def upload():
            with open(files["revert"], "rb") as f:
                return c.post("/v1/rl/weights/upload", params={"version": "v2"}, content=f.read(),
                              headers={"content-type": "application/octet-stream"})
        f1 = pool.submit(first)
        wait_until(lambda: _health(stack.gen_port)["running"] >= 1, 60, interval=0.02)   # 40 steps: a wide window
        fu = pool.submit(upload)
        wait_until(lambda: _health(stack.und_port)["weights_version"] == "v2", 60, interval=0.02)
        f2 = pool.submit(second)        # understanding has committed, generation may still drain
        got1, got2, r = f1.result(), f2.result(), fu.result()
        assert r.status_code == 200, r.text
        assert set(r.json()["drain_seconds"]) == {"generation", "understanding"}
        assert versions(stack, c) == "v2"
        new = (first(), second())
        assert got1 == old[0] != new[0]
        assert got2 == new[1] != old[1]
        assert outputs(c) == RECORD["v0"]           # the base weights again, bit for bit

        # A streamed chat is in flight once its first token has come (polling /health for it can miss a short job).
        first = lambda started=None: streamed_chat(c, "one fox", 120, started)   # noqa: E731
        old = first()
        started = threading.Event()
        f1 = pool.submit(first, started)
        assert started.wait(60)
        r = c.post("/v1/rl/weights", json={"path": files["new"]})
        assert r.status_code == 200 and r.json()["weights_version"] == "v3", r.text
        assert f1.result() == old != first()
        assert outputs(c) == RECORD["v1"]


def test_lora_delta_and_a_fresh_stack_agree(stack, files, tiny_dir, tmp_path_factory):
    with client(stack) as c:
        r = c.post("/v1/rl/weights", json={"lora": files["lora"], "lora_strength": 0.7})
        assert r.status_code == 200, r.text
        assert r.json()["weights_version"] == "v4" and r.json()["updated"] == {"generation": 2, "understanding": 1}
        assert versions(stack, c) == "v4"
        got = outputs(c)
    assert got != RECORD["v1"]
    # the checkpoint the stack now serves: base + the update, the adapter merged (fp32, as the CPU stack holds it)
    ckpt = str(tmp_path_factory.mktemp("merged") / "ckpt")
    shutil.copytree(tiny_dir, ckpt)
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(ckpt, name))
    W.write_tensors({**files["base"], **files["new_values"]}, ckpt)
    merged = load_model(ckpt, "both", lora=[(files["lora"], 0.7)])
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(ckpt, name))
    W.write_checkpoint_weights(merged, ckpt)
    fresh = start_stack(ckpt, str(tmp_path_factory.mktemp("fresh-stack")))
    try:
        with client(fresh) as c:
            assert outputs(c) == got
    finally:
        fresh.stop_clean()
