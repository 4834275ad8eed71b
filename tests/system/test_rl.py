"""RL rollout and scoring through the gateway against a real `u1serve up` stack (tiny checkpoint, CPU, fp32):
score reproduces the rollout's log-probs (1e-5) for every SDE kind and a MixGRPO window, rollouts are bit-exact
for the same seeds, an ODE rollout (noise 0) is the image API's image, trajectories come back as safetensors, and
a cancelled rollout leaves no KV page and no trajectory behind."""
import base64
import io
import json
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.waiting import wait_until

BASE = {"prompts": [{"prompt": "a red cat"}, {"prompt": "a blue dog"}], "group_size": 2, "size": "64x64",
        "num_inference_steps": 4, "guidance_scale": 2.0, "timestep_shift": 3.0, "seed": 5}


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base, timeout=180) as c:
        yield c


def load(blob: bytes) -> tuple[dict, dict]:
    from safetensors import safe_open
    from safetensors.numpy import load as np_load
    tensors = np_load(blob)
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(blob)
        f.flush()
        with safe_open(f.name, "np") as st:
            meta = st.metadata()
    return tensors, json.loads(meta["u1serve"])


def rollout(client, **kw) -> dict:
    r = client.post("/v1/rl/rollout", json={**BASE, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def score(client, body: dict, **kw) -> dict:
    r = client.post("/v1/rl/score", json={**body, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert (x is None) == (y is None), (ra, rb)
            if x is not None:
                assert abs(x - y) <= tol, (ra, rb)


def png_data_url(color) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("sde", [{"kind": "flow", "noise_level": 0.7, "window": {"start": 1, "size": 2}},
                                 {"kind": "dance", "noise_level": 0.5},
                                 {"kind": "cps", "noise_level": 0.8, "steps": [0, 2]}])
def test_score_reproduces_the_rollout(client, sde):
    prompts = BASE["prompts"]
    if sde["kind"] == "dance":      # an edit: three CFG branches over the input image
        prompts = [prompts[0], {"prompt": "make it blue", "images": [png_data_url((200, 30, 30))]}]
    body = {**BASE, "prompts": prompts, "image_guidance_scale": 1.5, "sde": sde}
    out = rollout(client, **body)
    steps = out["sde_steps"]
    assert steps == {"flow": [1, 2], "dance": [0, 1, 2], "cps": [0, 2]}[sde["kind"]]
    assert [(s["prompt_index"], s["sample_index"], s["seed"]) for s in out["samples"]] == \
        [(0, 0, 5), (0, 1, 6), (1, 0, 7), (1, 1, 8)]
    lps = [s["logprobs"] for s in out["samples"]]
    for row in lps:
        assert [k for k, x in enumerate(row) if x is not None] == steps
    assert out["prefill"]["prefixes"] == 2 and out["prefill"]["shared_by"] == 2
    assert out["weights_version"] == "0" and len(out["timesteps"]) == 5
    body = {**body, "trajectory_id": out["trajectory_id"]}
    cur = score(client, body)
    close(cur["logprobs"], lps)
    assert cur["weights_version"] == "0"
    if sde["kind"] == "flow":
        ref = score(client, body, weights="reference")  # the weights have not moved: the same numbers
        close(ref["logprobs"], lps)


def test_trajectory_blob_determinism_and_upload(client):
    sde = {"kind": "flow", "noise_level": 0.9}
    a, b = rollout(client, sde=sde), rollout(client, sde=sde)
    ta = client.get(f"/v1/rl/trajectories/{a['trajectory_id']}")
    assert ta.status_code == 200 and ta.headers["content-type"] == "application/octet-stream"
    tensors, meta = load(ta.content)
    lat = tensors["latents"]
    assert lat.shape == (4, 5, 3, 64, 64) and lat.dtype == np.float32
    assert tensors["sde_mask"].tolist() == [1, 1, 1, 0]
    np.testing.assert_array_equal(np.nan_to_num(tensors["logprobs"], nan=-1.0),
                                  np.array([[-1.0 if x is None else x for x in s["logprobs"]] for s in a["samples"]],
                                           dtype=np.float32))
    assert meta["weights_version"] == "0" and meta["kind"] == "flow"
    tb, _ = load(client.get(f"/v1/rl/trajectories/{b['trajectory_id']}").content)
    assert np.array_equal(lat, tb["latents"])                       # same seeds: bit for bit
    assert [s["logprobs"] for s in a["samples"]] == [s["logprobs"] for s in b["samples"]]
    assert [s["image"] for s in a["samples"]] == [s["image"] for s in b["samples"]]
    assert not np.array_equal(lat[0], lat[1])                        # different seeds in the group
    # an uploaded trajectory scores like the stored one
    up = score(client, {**BASE, "sde": sde, "trajectory_b64": base64.b64encode(ta.content).decode()})
    close(up["logprobs"], [s["logprobs"] for s in a["samples"]])
    bad = client.post("/v1/rl/score", json={**BASE, "group_size": 3, "sde": sde, "trajectory_id": a["trajectory_id"]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "trajectory_mismatch", bad.text
    # delete, then it is gone
    assert client.delete(f"/v1/rl/trajectories/{a['trajectory_id']}").status_code == 200
    gone = client.get(f"/v1/rl/trajectories/{a['trajectory_id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "trajectory_not_found"
    miss = client.post("/v1/rl/score", json={**BASE, "trajectory_id": a["trajectory_id"]})
    assert miss.status_code == 404 and miss.json()["error"]["code"] == "trajectory_not_found"
    assert client.get("/v1/rl/trajectories/bad$id").status_code == 400


def test_same_initial_noise_and_the_ode_limit(client):
    out = rollout(client, same_initial_noise=True, prompts=[{"prompt": "a red cat"}], group_size=3)
    t, _ = load(client.get(f"/v1/rl/trajectories/{out['trajectory_id']}").content)
    z = t["latents"]
    assert np.array_equal(z[0, 0], z[1, 0]) and np.array_equal(z[0, 0], z[2, 0])
    assert not np.array_equal(z[0, 1], z[1, 1])                    # the SDE noise differs per sample
    # noise 0: the SDE step is the Euler step, so the image is the images API's for the same seed
    ode = rollout(client, prompts=[{"prompt": "a red cat"}], group_size=1, seed=11, return_trajectory=False,
                  sde={"kind": "flow", "noise_level": 0.0})
    assert ode["trajectory_id"] is None
    img = client.post("/v1/images/generations", json={"prompt": "a red cat", "size": "64x64", "seed": 11,
                                                       "num_inference_steps": 4, "guidance_scale": 2.0,
                                                       "timestep_shift": 3.0})
    assert img.status_code == 200, img.text
    pix = lambda b64: np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))
    assert np.array_equal(pix(ode["samples"][0]["image"]), pix(img.json()["data"][0]["b64_json"]))


@pytest.mark.parametrize("body,param", [
    ({"sde": {"kind": "ddim"}}, "sde.kind"),
    ({"group_size": 65}, "group_size"),
    ({"size": "65x64"}, "size"),
    ({"sde": {"window": {"start": 3, "size": 1}}}, None),
    ({"seeds": [[1, 2]]}, None),
])
def test_bad_rollouts_are_400(client, body, param):
    r = client.post("/v1/rl/rollout", json={**BASE, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_cancelled_rollout_leaks_nothing(stack):
    gen_health = lambda: httpx.get(stack.gen + "/health", timeout=10).json()
    und_pages = lambda: httpx.get(stack.und + "/health", timeout=10).json()["shm_pages_used"]
    before = gen_health()["rl_trajectories"]["trajectories"]
    body = json.dumps({**BASE, "prompts": BASE["prompts"][:1], "num_inference_steps": 400,
                       "size": "128x128"}).encode()
    host, port = stack.base.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/rl/rollout HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_until(lambda: gen_health()["running"] > 0, 240, interval=0.1)   # denoising: the prefix pages are in use
    sock.close()                                                         # the client goes away
    wait_until(lambda: gen_health()["running"] == 0 and gen_health()["queued"] == 0, 90, interval=0.2)
    wait_until(lambda: und_pages() == 0, 90, interval=0.2)
    wait_until(lambda: gen_health()["rl_trajectories"]["trajectories"] == before, 90, interval=0.2)
    time.sleep(0.5)
    assert gen_health()["rl_trajectories"]["trajectories"] == before and und_pages() == 0


def test_think_sampling_with_logprobs_and_rescoring(client):
    body = {**BASE, "prompts": [{"prompt": "a red cat"}], "group_size": 2, "sde": {"kind": "flow", "steps": [1]},
            "think": {"enabled": True, "temperature": 0.9, "top_p": 0.95, "max_tokens": 6}}
    out = rollout(client, **body)
    assert out["prefill"]["prefixes"] == 2 and out["prefill"]["shared_by"] == 1   # one prefix per sample
    for s in out["samples"]:
        th = s["think"]
        assert th is not None and 1 <= len(th["token_ids"]) <= 6
        assert len(th["logprobs"]) == len(th["token_ids"]) and all(lp <= 0.0 for lp in th["logprobs"])
    again = rollout(client, **body)                     # the think seed is the sample's seed
    assert [s["think"]["token_ids"] for s in again["samples"]] == [s["think"]["token_ids"] for s in out["samples"]]
    sc = score(client, {**body, "trajectory_id": out["trajectory_id"],
                        "think_token_ids": [s["think"]["token_ids"] for s in out["samples"]]})
    close(sc["logprobs"], [s["logprobs"] for s in out["samples"]])


def test_sampled_think_never_holds_image_markers_and_always_rescores(client, tiny_checkpoint):
    """The random tiny model emits image-span markers often when sampled freely; a sampled think block must not
    (re-prefilled, they would read as an image run and scoring would refuse the trajectory)."""
    from services.model.prompts import think_excluded_ids
    from services.model.tokenizer import NeoTokenizer
    excluded = set(think_excluded_ids(NeoTokenizer.from_dir(tiny_checkpoint("u1"))))
    body = {**BASE, "prompts": [{"prompt": "a red cat"}], "group_size": 6, "sde": {"kind": "flow", "steps": [1]},
            "think": {"enabled": True, "temperature": 1.5, "max_tokens": 24}}
    out = rollout(client, **body)
    ids = [s["think"]["token_ids"] for s in out["samples"]]
    assert sum(map(len, ids)) >= 24 and not excluded & {t for row in ids for t in row}
    sc = score(client, {**body, "trajectory_id": out["trajectory_id"], "think_token_ids": ids})
    close(sc["logprobs"], [s["logprobs"] for s in out["samples"]])


def test_replays_are_bit_exact_under_cpu_load(client):
    """Same seeds, same weights: the same trajectory bit for bit, also while other processes load every core (the
    prompts' prefixes once read each other's cached pages or not depending on timing; _own_salt)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        runs = []
        for _ in range(4):
            out = rollout(client, sde={"kind": "flow", "noise_level": 0.9})
            blob = client.get(f"/v1/rl/trajectories/{out['trajectory_id']}").content
            client.delete(f"/v1/rl/trajectories/{out['trajectory_id']}")
            runs.append((load(blob)[0]["latents"].tobytes(), [s["logprobs"] for s in out["samples"]]))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert all(r == runs[0] for r in runs[1:])
