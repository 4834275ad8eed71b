"""The model core reproduces the official code's outputs on the tiny official-schema checkpoint."""
import json
import os

import pytest
import torch

from services.contract.image import SamplerParams
from services.model import prompts as P
from services.model import reference as R
from services.model import sampler as S
from services.model.loader import load_model
from services.model.positions import image_token_positions
from services.model.tokenizer import NeoTokenizer
from tests.conftest import GOLDEN

CKPT = os.path.join(GOLDEN, "tiny-u1")
CASE = os.path.join(GOLDEN, "cases", "t2i_64_cfg4_none")


@pytest.fixture(scope="module")
def model_tok():
    return load_model(CKPT, "both", torch.float32), NeoTokenizer.from_dir(CKPT)


@pytest.fixture(scope="module")
def params():
    meta = torch.load(CASE + ".kv.pt", weights_only=True)["meta"]
    return SamplerParams(num_inference_steps=meta["steps"], guidance_scale=meta["cfg"], cfg_norm=meta["cfg_norm"],
                           timestep_shift=meta["shift"], t_eps=meta["t_eps"])


def test_prefix_kv_and_hidden_match(model_tok, params):
    model, tok = model_tok
    gold = torch.load(CASE + ".kv.pt", weights_only=True)
    pre = R.image_prefixes(model, tok, "t2i", gold["meta"]["prompt"], [], params)
    assert set(pre) == {"cond", "uncond"}
    for branch in ("cond", "uncond"):
        g = gold[branch]
        assert pre[branch].input_ids == g["input_ids"][0].tolist()
        assert pre[branch].t_offset == int(g["indexes"][0].max()) + 1
        for layer in range(model.num_layers):
            torch.testing.assert_close(pre[branch].kv[layer, 0], g["keys"][layer][0].transpose(0, 1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pre[branch].kv[layer, 1], g["values"][layer][0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        inp = P.t2i_inputs(tok, gold["meta"]["prompt"], params.branches())[branch]
        _, positions, hidden = R.prefill(model, inp)
        assert torch.equal(positions.cpu(), g["indexes"])
        torch.testing.assert_close(hidden, g["last_hidden_state"][0], rtol=1e-5, atol=1e-5)


def test_every_denoise_step_matches(model_tok, params):
    model, tok = model_tok
    gold = torch.load(CASE + ".kv.pt", weights_only=True)
    trace = torch.load(CASE + ".trace.pt", weights_only=True)["steps"]
    pre = R.image_prefixes(model, tok, "t2i", gold["meta"]["prompt"], [], params)
    th = tw = 64 // 32
    s = S.noise_scale(model.cfg, th * tw)
    grid = S.timesteps(params.num_inference_steps, params.timestep_shift)
    for rec in trace:
        t = torch.tensor(rec["t"])
        assert any(abs(float(g) - rec["t"]) < 1e-7 for g in grid)
        z = rec["z"]
        x = S.unpatchify(z, th, tw)
        x_in = model.gen_embed(x, t, s)
        torch.testing.assert_close(x_in, rec["gen_embeds"], rtol=1e-5, atol=1e-5)
        p = pre[rec["branch"]]
        assert torch.equal(image_token_positions(th, tw, p.t_offset), rec["indexes_image"])
        v = R.gen_velocity(model, p.kv, p.t_offset, x_in, z, t, th, tw, params.t_eps)
        torch.testing.assert_close(v, rec["v_pred"], rtol=1e-4, atol=1e-4)


def test_image_matches(model_tok, params):
    model, tok = model_tok
    gold = torch.load(CASE + ".pt", weights_only=True)
    x, _ = R.text_to_image(model, tok, "a red cube on a table", 64, 64, params, seed=0)
    assert (x - gold).abs().max() < 1e-4


def test_greedy_chat_matches(model_tok):
    model, tok = model_tok
    case = json.load(open(os.path.join(GOLDEN, "cases", "chat_text.json")))
    inp = P.chat_input(tok, [{"role": "user", "content": "Describe a red cube."}])
    ids = R.generate_text(model, tok, inp, max_new_tokens=len(case["token_ids"]))
    assert ids == case["token_ids"]
    assert tok.decode(ids) == case["response"]
