"""`u1serve up --mode separate` on CPU: serves; Ctrl-C (SIGINT) leaves no processes, no shm segments."""
import base64
import io
import os

import httpx
from PIL import Image

from .stackproc import RunningStack


def test_separate_mode_serves_then_sigint_leaves_nothing(tiny_model, tmp_path):
    s = RunningStack(tiny_model, "separate", str(tmp_path))
    try:
        s.wait_ready()
        assert os.path.exists("/dev/shm/" + s.pool)     # the KV pool exists while serving
        r = httpx.post(s.base + "/v1/chat/completions", timeout=60,
                       json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        r = httpx.post(s.base + "/v1/images/generations", timeout=60,
                       json={"prompt": "x", "size": "64x96", "num_inference_steps": 2, "n": 2})
        assert r.status_code == 200, r.text
        ims = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
        assert [im.size for im in ims] == [(64, 96)] * 2
    finally:
        code = s.stop()
    groups, shm = s.leftovers()
    assert code == 0, s.output()
    assert groups == [], f"processes left: {groups}"
    assert shm == [], f"/dev/shm left: {shm}"
    assert not os.path.exists("/dev/shm/" + s.pool)
    assert "[u1serve] stopped" in s.output()
