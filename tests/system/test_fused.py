"""The fused colocate mode (`u1serve up --colocate-engines fused`: both engines' loops threads of one process) through
the real stack on the CPU: the API checks the two-process colocate passes, its images bit-identical to the
two-process stack's (the session's `stack`, fp32, fixed seeds), the GIL measurement, and its fault rules (an engine
error it handles fails one request; an engine that dies or hangs takes the process down and the launcher restarts
it; meanwhile 503s, never garbage). One fused stack for the module; the faults come last (they restart it), the drain
ends it."""
import base64
import io
import json
import os
import signal
import threading

import httpx
import numpy as np
import pytest
from PIL import Image

from services.kit import sse
from tests.waiting import wait_until

from .conftest import sdk_client, serve
from .stackproc import RunningStack

MARK = {"oom": "fz-oom", "nan": "fz-nan", "crash": "fz-crash", "hang": "fz-hang", "und_crash": "fz-undcrash"}
HANG_S = 8.0
ENV = {"U1SERVE_FAULT_STEP_OOM": MARK["oom"], "U1SERVE_FAULT_STEP_NAN": MARK["nan"],
       "U1SERVE_FAULT_STEP_CRASH": MARK["crash"], "U1SERVE_FAULT_STEP_HANG": MARK["hang"],
       "U1SERVE_FAULT_UND_STEP_CRASH": MARK["und_crash"]}


@pytest.fixture(scope="module")
def fused(tiny_model, tmp_path_factory):
    yield from serve(RunningStack(tiny_model, "colocate", str(tmp_path_factory.mktemp("stack-fused")), env=ENV,
                                  extra=["--colocate-engines", "fused", "--enable-rl",
                                         "--fused-args", f"--hang-s {HANG_S:g} --gil-probe-ms 1"]))


@pytest.fixture(scope="module")
def twin(tiny_model, tmp_path_factory):
    """A two-process colocate stack with the same history as `fused` when compared (fresh, the same requests in the
    same order). Not the session's shared stack: a prompt prefilled after other traffic reuses the radix cache's
    prefix KV and computes only the rest, at another GEMM row count, so its pixels differ from a fresh stack's in
    the low bits (the same request twice on one stack differs too; with --no-prefix-cache it does not: 2026-12-06)."""
    yield from serve(RunningStack(tiny_model, "colocate", str(tmp_path_factory.mktemp("stack-twin"))))


@pytest.fixture(scope="module")
def fused_client(fused):
    return sdk_client(fused)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def png(w: int, h: int) -> bytes:
    arr = np.zeros((h, w, 3), np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    arr[..., 1] = 120
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def post(stack, path: str, body: dict, rid: str | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(stack.base + path, json=body, timeout=timeout, headers={"x-request-id": rid} if rid else {})


def fused_stats(stack) -> dict:
    r = httpx.get(f"http://127.0.0.1:{stack.und_port}/internal/fused", timeout=10,
                  headers={"Authorization": f"Bearer {stack.token}"})
    assert r.status_code == 200, r.text
    return r.json()


def image_ok(stack, prompt: str = "after") -> None:
    r = post(stack, "/v1/images/generations", {"prompt": prompt, "size": "64x64", "num_inference_steps": 2})
    assert r.status_code == 200, r.text


def chat_ok(stack) -> None:
    r = post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


# -- the mode, said and recorded ----------------------------------------------------------------------------------
def test_one_process_serves_both_engines_and_says_so(fused):
    with open(fused.state_file) as f:
        state = json.load(f)
    # both engines keep their own servers inside the one process: stack.json names them
    assert state["colocate_engines"] == {"engines": "fused", "why": "asked for", "health_urls": {
        "und": f"http://127.0.0.1:{fused.und_port}/health", "gen": f"http://127.0.0.1:{fused.gen_port}/health"}}
    assert sorted(state["services"]) == ["fused", "gateway"]
    # the ready line is written once the launcher has seen every service up: maybe just after the fixture did
    assert wait_until(lambda: "(fused engines)" in fused.output(), 30), fused.output()
    assert "colocate engines: fused (asked for)" in fused.output()
    pid = state["services"]["fused"]["pid"]
    und = httpx.get(f"http://127.0.0.1:{fused.und_port}/health", timeout=10).json()
    gen = httpx.get(f"http://127.0.0.1:{fused.gen_port}/health", timeout=10).json()
    assert und["status"] == "ok" and gen["status"] == "ok"
    assert gen["engine_pids"] == [pid] != []      # the engine loop is a thread of the one process


# -- the API, as the two-process colocate passes it ---------------------------------------------------------------
def test_chat_and_streamed_chat(fused_client):
    # ignore_eos: random tiny weights may sample the end of the text early (seen once: 4 tokens of 5)
    r = fused_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                             extra_body={"ignore_eos": True})
    assert r.choices[0].message.content and r.usage.completion_tokens == 5
    chunks = list(fused_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_images_and_edits_bit_identical_to_the_two_process_stack(fused, twin):
    """The same seeds give the same pixels in both modes (fp32 on the CPU): a thread of the fused process runs the
    very engine code a rank process runs."""
    body = {"prompt": "a lighthouse at dusk", "size": "64x64", "num_inference_steps": 3, "seed": 11, "n": 2}
    a = post(fused, "/v1/images/generations", body)
    b = post(twin, "/v1/images/generations", body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    for x, y in zip(a.json()["data"], b.json()["data"], strict=True):
        assert np.array_equal(pixels(x["b64_json"]), pixels(y["b64_json"]))
    files = {"image": ("in.png", png(48, 40), "image/png")}
    data = {"prompt": "make it blue", "size": "64x64", "num_inference_steps": "2", "seed": "4"}
    ea = httpx.post(fused.base + "/v1/images/edits", files=files, data=data, timeout=120)
    eb = httpx.post(twin.base + "/v1/images/edits", files=files, data=data, timeout=120)
    assert ea.status_code == eb.status_code == 200, (ea.text, eb.text)
    assert np.array_equal(pixels(ea.json()["data"][0]["b64_json"]), pixels(eb.json()["data"][0]["b64_json"]))


def test_interleaved_answer_same_as_the_two_process_stack(fused, twin):
    body = {"model": "m", "messages": [{"role": "user", "content": "Draw a red house, then describe it"}],
            "modalities": ["text", "image"], "max_tokens": 30, "logit_bias": {"262": 0.2}, "temperature": 0,
            "image_config": {"size": "64x64", "num_inference_steps": 2, "seed": 9, "max_images": 2}}
    a, b = post(fused, "/v1/chat/completions", body), post(twin, "/v1/chat/completions", body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    ma, mb = a.json()["choices"][0]["message"], b.json()["choices"][0]["message"]
    images = [p for p in ma["content"] if p["type"] == "image_url"]
    assert images, ma
    assert ma == mb


def test_rl_rollout_with_logprobs(fused):
    body = {"prompts": [{"prompt": "a red cat"}], "group_size": 2, "size": "64x64", "num_inference_steps": 3,
            "guidance_scale": 2.0, "seed": 5}
    r = post(fused, "/v1/rl/rollout", body, timeout=180)
    assert r.status_code == 200, r.text
    samples = r.json()["samples"]
    assert len(samples) == 2
    for s in samples:
        lps = [x for x in s["logprobs"] if x is not None]
        assert lps and all(np.isfinite(lps)), s["logprobs"]


def test_abort_on_disconnect_frees_the_engine(fused):
    body = {"prompt": "long job", "size": "256x256", "num_inference_steps": 200, "stream": True}
    with httpx.stream("POST", fused.base + "/v1/images/generations", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "image_generation.progress" in line:
                break          # leave mid-denoise
    assert wait_until(lambda: httpx.get(f"http://127.0.0.1:{fused.gen_port}/health",
                                        timeout=5).json()["running"] == 0, 30)
    image_ok(fused, "after cancel")


def test_gil_and_step_times_are_measured_per_loop(fused):
    stats = fused_stats(fused)
    assert stats["engines"] == "fused" and stats["streams"] == {"understanding": "high", "generation": "low"}
    for name in ("understanding", "generation"):
        loop = stats["loops"][name]
        assert loop["steps"] > 0 and 0 < loop["cpu_s"] and loop["wall_s"] > 0, loop
    assert stats["gil_probe"]["samples"] > 0
    assert stats["yield_signal"]["decode_steps"] > 0     # the in-process yield flag saw the decode steps


# -- faults an engine handles: one request fails, nothing restarts ------------------------------------------------
@pytest.mark.parametrize("fault,code,status", [("oom", "engine_oom", 503), ("nan", "nonfinite_output", 500)])
def test_a_handled_engine_fault_fails_only_its_request(fused, fault, code, status):
    pid = fused.service_pids()["fused"]
    r = post(fused, "/v1/images/generations", {"prompt": "x", "size": "64x64", "num_inference_steps": 3},
             rid=f"{MARK[fault]}-1")
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    chat_ok(fused)
    image_ok(fused)
    assert fused.service_pids()["fused"] == pid


# -- faults that take the process down: 503 meanwhile, the launcher restarts it -----------------------------------
def _restarted(stack, pid: int) -> None:
    assert wait_until(lambda: stack.service_pids()["fused"] != pid, 60), stack.output()
    assert wait_until(lambda: httpx.get(stack.base + "/health", timeout=5).status_code == 200, 240), stack.output()
    stack.pids = stack.service_pids()     # teardown checks the new process group
    chat_ok(stack)
    image_ok(stack)


def _stream_image(stack, rid: str) -> list:
    body = {"prompt": "doomed", "size": "64x64", "num_inference_steps": 4, "stream": True}
    with httpx.stream("POST", stack.base + "/v1/images/generations", json=body, timeout=120,
                      headers={"x-request-id": rid}) as r:
        assert r.status_code == 200
        return list(sse.events(r.iter_lines()))


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_a_dead_or_hung_generation_engine_restarts_the_process(fused, fault):
    pid = fused.service_pids()["fused"]
    events = _stream_image(fused, f"{MARK[fault]}-1")
    err = events[-1]
    assert err["type"] == "error" and err["status"] == 503, events
    # wait for this fault's own line: an earlier test's "exiting with code 3" is already in the output, and the
    # launcher relays the process's log after the client has its 503 (a loaded machine: seconds after)
    why = ("generation engine died: rank 0: SystemError('injected by U1SERVE_FAULT_STEP_CRASH" if fault == "crash"
           else "generation engine hung")
    assert wait_until(lambda: why in fused.output(), 30), fused.output()
    line = next(x for x in fused.output().splitlines() if why in x)
    assert "exiting with code 3" in line, line
    _restarted(fused, pid)


def test_a_dead_understanding_engine_restarts_the_process(fused):
    pid = fused.service_pids()["fused"]
    r = post(fused, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
             rid=f"{MARK['und_crash']}-1")
    assert r.status_code == 503, r.text
    # generation does not go on alone: the whole process goes, and comes back
    assert wait_until(lambda: "understanding engine died" in fused.output(), 30), fused.output()
    _restarted(fused, pid)


def test_killed_process_restarts(fused):
    pid = fused.service_pids()["fused"]
    os.killpg(pid, signal.SIGKILL)
    r = post(fused, "/v1/images/generations", {"prompt": "meanwhile", "size": "64x64", "num_inference_steps": 1})
    assert r.status_code in (200, 503), r.text
    _restarted(fused, pid)


def test_drain_on_sigterm_finishes_the_request_in_flight(fused):
    """SIGTERM to `u1serve up` with an image in flight: the answer still comes (or a clean 503), the stack exits 0
    and leaves nothing behind (the fixture's teardown checks)."""
    result = {}

    def run():
        # enough steps to still be in flight when the health poll sees it (a loaded 2-core host polls slowly)
        result["r"] = post(fused, "/v1/images/generations", {"prompt": "last", "size": "128x128",
                                                             "num_inference_steps": 50}, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: httpx.get(f"http://127.0.0.1:{fused.gen_port}/health", timeout=5).json()["running"]
                      + httpx.get(f"http://127.0.0.1:{fused.gen_port}/health", timeout=5).json()["queued"] > 0,
                      30, interval=0.05)
    fused.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result["r"].status_code in (200, 503), result["r"].text
    assert fused.proc.wait(60) == 0, fused.output()
