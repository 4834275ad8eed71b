"""A checkpoint converted by `u1serve convert --to int8` served by `u1serve up` (both engines load it in its own
format: int8 W8A8 with the checkpoint's per-branch scales, nothing requantised): chat answers and the image is
close to the float checkpoint's (the single-process reference pipeline on the float weights)."""
import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from .stackproc import ROOT, RunningStack


@pytest.fixture(scope="module")
def int8_stack(tiny_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("int8") / "ckpt")
    subprocess.run([sys.executable, "-m", "services.launch.cli", "convert", tiny_model, out, "--to", "int8"], check=True,
                   cwd=ROOT, capture_output=True)
    s = RunningStack(out, "colocate", str(tmp_path_factory.mktemp("stack-int8")))
    s.wait_ready()
    yield s
    s.stop_clean()


def test_int8_checkpoint_through_the_api(int8_stack, reference):
    openai = pytest.importorskip("openai")
    import services.model.reference as R
    from services.contract.image import SamplerParams
    client = openai.OpenAI(base_url=int8_stack.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    r = client.images.generate(model="m", prompt="a red fox", size="64x64", response_format="b64_json",
                               extra_body={"num_inference_steps": 4, "seed": 7})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))).convert("RGB"), np.float64)
    model, tok = reference
    x, _ = R.text_to_image(model, tok, "a red fox", 64, 64, SamplerParams(num_inference_steps=4), seed=7)
    want = np.asarray(R.to_pil(x)[0].convert("RGB"), np.float64)
    diff = np.abs(got - want)
    psnr = 20 * np.log10(255 / np.sqrt((diff ** 2).mean()))
    assert 0 < diff.max() and psnr > 30, (diff.mean(), diff.max(), psnr)   # quantised: close, not equal
