"""The reference pipeline on every family: T2I, editing, think, determinism, halves == one call."""
import pytest
import torch
from PIL import Image

from services.contract.image import SamplerParams
from services.model import prompts as P
from services.model import reference as R
from services.model.loader import load_model
from services.model.tokenizer import NeoTokenizer

VARIANTS = ["u1", "u1.5", "a3b"]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    cache = {}

    def get(variant):
        if variant not in cache:
            d = tiny_checkpoint(variant)
            cache[variant] = (load_model(d, "both"), NeoTokenizer.from_dir(d))
        return cache[variant]

    return get


def _img(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr)


@pytest.mark.parametrize("variant", VARIANTS)
def test_t2i_sizes_and_seeds(loaded, variant):
    model, tok = loaded(variant)
    p = SamplerParams(num_inference_steps=4)
    a, _ = R.text_to_image(model, tok, "a red cube", 64, 64, p, seed=1)
    b, _ = R.text_to_image(model, tok, "a red cube", 64, 64, p, seed=1)
    c, _ = R.text_to_image(model, tok, "a red cube", 64, 64, p, seed=2)
    assert a.shape == (1, 3, 64, 64) and torch.equal(a, b) and not torch.equal(a, c)
    wide, _ = R.text_to_image(model, tok, "a red cube", 96, 64, p, seed=1, n=2)
    assert wide.shape == (2, 3, 64, 96)
    imgs = R.to_pil(wide)
    assert imgs[0].size == (96, 64) and imgs[0].mode == "RGB"


@pytest.mark.parametrize("variant", VARIANTS)
def test_edit_two_images_three_branches(loaded, variant):
    model, tok = loaded(variant)
    ims = [_img(64, 96, 1), _img(80, 64, 2)]
    p = SamplerParams(mode="edit", num_inference_steps=3, guidance_scale=4.0, image_guidance_scale=2.0)
    pre = R.image_prefixes(model, tok, "edit", "swap them", ims, p)
    assert set(pre) == {"cond", "img_cond", "uncond"}
    assert pre["cond"].t_offset > pre["img_cond"].t_offset > pre["uncond"].t_offset
    x = R.denoise(model, pre, 64, 64, p, seed=0)
    y, _ = R.edit(model, tok, "swap them", ims, 64, 64, p, seed=0)
    assert torch.equal(x, y) and x.shape == (1, 3, 64, 64)
    # default edit recipe (g=4, g_i=1): cond + img_cond only
    assert set(R.image_prefixes(model, tok, "edit", "x", ims[:1], SamplerParams(mode="edit"))) == {"cond", "img_cond"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_think_mode(loaded, variant):
    model, tok = loaded(variant)
    p = SamplerParams(num_inference_steps=2)
    pre = R.image_prefixes(model, tok, "t2i", "a cat", [], p, think=True, max_think_tokens=6)
    cond = pre["cond"]
    assert isinstance(cond.think_text, str) and pre["uncond"].think_text is None
    # cond ends in <think>\n + think tokens + "\n\n<img>"; its t_offset continues after them
    think_ids = cond.think_ids
    assert cond.think_text == tok.decode(think_ids) and 0 < len(think_ids) <= 6
    tail = tok.encode(P.THINK_TAIL)
    assert cond.num_tokens == len(cond.input_ids) + len(think_ids) + len(tail)
    assert cond.t_offset == cond.num_tokens  # text only: t = position
    x = R.denoise(model, pre, 64, 64, p, seed=0)
    assert torch.isfinite(x).all()


def test_halves_compose_to_one_call(loaded):
    model, tok = loaded("u1")
    p = SamplerParams(num_inference_steps=3, cfg_norm="global")
    one, _ = R.text_to_image(model, tok, "a dog", 64, 96, p, seed=5)
    pre = R.image_prefixes(model, tok, "t2i", "a dog", [], p)
    steps = []
    two = R.denoise(model, pre, 64, 96, p, seed=5, on_step=lambda k, n: steps.append((k, n)))
    assert torch.equal(one, two) and steps == [(1, 3), (2, 3), (3, 3)]


def test_prompt_texts(loaded):
    model, tok = loaded("u1")
    assert P.UNCOND_TEXT == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<img>"
    inp = P.t2i_inputs(tok, "hi", SamplerParams().branches())
    text = tok.decode(inp["cond"].input_ids)
    assert text.startswith("<|im_start|>system\n" + P.default_gen_system_message() + "<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<img>")
    assert len(P.default_gen_system_message()) == 1175
    ims = [_img(64, 64, 1), _img(64, 64, 2)]
    e = P.edit_inputs(tok, "merge", ims, SamplerParams(mode="edit", image_guidance_scale=2.0).branches())
    et = tok.decode([i for i in e["cond"].input_ids if i != tok.img_context_id])
    assert "user\nImage-1:<img></img>\nImage-2:<img></img>\nmerge<|im_end|>" in et
    it = tok.decode([i for i in e["img_cond"].input_ids if i != tok.img_context_id])
    assert it == "<|im_start|>user\n<img></img><img></img><|im_end|>\n<|im_start|>assistant\n<img>"
    chat = P.chat_input(tok, [{"role": "user", "content": [{"type": "image", "image": ims[0]},
                                                            {"type": "text", "text": "what?"}]}],
                        enable_thinking=False)
    ct = tok.decode([i for i in chat.input_ids if i != tok.img_context_id])
    assert ct == "<|im_start|>user\n<img></img>\nwhat?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert len(chat.images) == 1 and chat.images[0].grid_hw == (16, 16)  # 64 px upscaled to min 256x256


def test_sampled_text_is_seeded(loaded):
    model, tok = loaded("a3b")
    inp = P.chat_input(tok, [{"role": "user", "content": "hello"}])
    a = R.generate_text(model, tok, inp, 8, temperature=1.0, top_p=0.9, top_k=50, seed=3, stop_ids=())
    b = R.generate_text(model, tok, inp, 8, temperature=1.0, top_p=0.9, top_k=50, seed=3, stop_ids=())
    assert a == b and len(a) == 8
