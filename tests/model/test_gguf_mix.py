"""A per-layer GGUF mix (`u1serve convert --to gguf:q8_0:0,q4_k:1-`): each layer's targets in their own type, the
syntax's errors said clearly, and the mixed checkpoint served through a real stack (chat and an image)."""
import base64
import os
import subprocess
import sys

import pytest

from services.model.convert import ConvertError, convert_checkpoint, parse_target
from services.model.gguf_io import GGUF_FILE
from tests.system.stackproc import ROOT, RunningStack

MIX = "gguf:q8_0:0,q4_k:1-"


@pytest.fixture(scope="module")
def mixed(tiny_checkpoint, tmp_path_factory):
    return convert_checkpoint(tiny_checkpoint("u1"), str(tmp_path_factory.mktemp("mix")), MIX)


def test_each_layer_gets_its_type(mixed):
    import gguf
    reader = gguf.GGUFReader(os.path.join(mixed, GGUF_FILE))
    T = gguf.GGMLQuantizationType
    kinds = {}
    for t in reader.tensors:
        if ".mlp" in t.name and t.name.endswith("_proj.weight") or "self_attn.q_proj" in t.name:
            kinds.setdefault(int(t.name.split(".")[3]), set()).add(t.tensor_type)
    assert kinds == {0: {T.Q8_0}, 1: {T.Q4_K}}
    assert reader.get_field("u1serve.gguf_type").contents() == "q8_0:0-0,q4_k:1-"


@pytest.mark.parametrize("to,says", [("gguf:q8_0:0-3,q4_k:2-", "overlaps"), ("gguf:q8_0:x", "TYPE:FIRST-LAST"),
                                     ("gguf:q5_k:0-", "unsupported GGUF type"), ("gguf:q8_0:3-1", "empty")])
def test_bad_mix_is_refused(to, says):
    with pytest.raises(ConvertError, match=says):
        parse_target(to)


def test_range_past_the_last_layer_is_refused(tiny_checkpoint, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.launch.cli", "convert", tiny_checkpoint("u1"), str(tmp_path / "o"),
                           "--to", "gguf:q8_0:0-1,q4_k:5-"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 2 and "layers 0-1" in proc.stderr


def test_mixed_checkpoint_serves_chat_and_images(mixed, tmp_path):
    from openai import OpenAI
    stack = RunningStack(mixed, "colocate", str(tmp_path)).wait_ready()
    try:
        client = OpenAI(base_url=stack.base + "/v1", api_key="unused", timeout=120)
        chat = client.chat.completions.create(model="sensenova-u1", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason in ("stop", "length")
        img = client.images.generate(model="sensenova-u1", prompt="a fox", size="64x64", response_format="b64_json",
                                     extra_body={"num_inference_steps": 2, "seed": 1})
        assert base64.b64decode(img.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        stack.stop_clean()
