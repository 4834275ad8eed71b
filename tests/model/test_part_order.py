"""Content parts in order (issue 36): on every path that turns a message with images into a prompt, each image's
tokens sit where its part stands among the text parts; a message whose images all come first keeps the official
template's placement (`<image>\\n` before the question; `Image-k:` labels for several edit images); a literal
`<image>` in client text stays text. Each path is checked against the official prompt string with `<image>`
placeholders, expanded by the trusted (official) route: prompts.expand_images."""
import os

import numpy as np
import pytest
from PIL import Image

from services.contract.chat import ChatCompletionRequest, ChatMessage, content_runs
from services.contract.image import PrefixRequest, SamplerParams
from services.gateway.routers.chat import last_user_turn
from services.model import constants as C
from services.model import images as IM
from services.model import prompts as P
from services.model.tokenizer import NeoTokenizer
from services.understanding.inputs import image_refs, prompt_messages
from tests.conftest import GOLDEN

URL = "data:image/png;base64,AAAA"          # never decoded here: the PIL images stand in for the decoded parts
LOOK = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": URL}},
        {"type": "text", "text": "\nDraw it from above."}]
OFFICIAL_LOOK = "Look: <image>\nDraw it from above."


@pytest.fixture(scope="module")
def tok():
    return NeoTokenizer.from_dir(os.path.join(GOLDEN, "tiny-u1"))


def _img(seed: int, w: int = 64, h: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _served_chat(tok, content: list[dict], pils: list, **kw) -> P.PromptInput:
    """The understanding chat path: the contract's message -> prompt_messages -> chat_input."""
    msgs = [ChatMessage.model_validate({"role": "user", "content": content})]
    assert len(image_refs(msgs)) == len(pils)
    return P.chat_input(tok, prompt_messages(msgs, pils), **kw)


def _official(tok, user_text: str, pils: list, min_px=C.VQA_MIN_PIXELS, max_px=C.VQA_MAX_PIXELS,
              system: str = "", tail: str = "") -> P.PromptInput:
    return P.expand_images(tok, P.neo1_0([("user", user_text)], system) + tail,
                           [IM.preprocess(p, min_px, max_px) for p in pils])


def test_content_runs_keep_the_parts_order():
    msg = ChatMessage.model_validate({"role": "user", "content": LOOK})
    runs, images = content_runs(msg.content)
    assert runs == ["Look: ", "\nDraw it from above."] and [p.url for p in images] == [URL]
    first = ChatMessage.model_validate({"role": "user", "content": [LOOK[1], LOOK[1], {"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]})
    assert content_runs(first.content) == (["", "", "ab"], first.content[:2])
    assert content_runs(first.content, sep="\n")[0] == ["", "", "a\nb"]
    assert content_runs("plain <image>") == (["plain <image>"], [])
    assert content_runs(None) == ([""], [])


def test_chat_puts_an_image_where_its_part_stands(tok):
    im = _img(1)
    got = _served_chat(tok, LOOK, [im])
    want = _official(tok, OFFICIAL_LOOK, [im])
    assert got.input_ids == want.input_ids and got.grids == want.grids
    ids = got.input_ids
    start = ids.index(tok.img_start_id)
    assert tok.decode(ids[:start]).endswith("user\nLook: ")       # the image right after "Look: "
    assert tok.decode(ids[ids.index(tok.img_end_id) + 1:]).startswith("\nDraw it from above.")


def test_chat_images_first_keep_the_official_template(tok):
    ims = [_img(1), _img(2)]
    content = [LOOK[1], LOOK[1], {"type": "text", "text": "Describe both"}]
    got = _served_chat(tok, content, ims, enable_thinking=False)
    assert got.input_ids == _official(tok, "<image>\n<image>\nDescribe both", ims, tail=P.EMPTY_THINK).input_ids   # <image>\n x 2


def test_chat_image_after_the_text_and_between_two_images(tok):
    ims = [_img(1), _img(2)]
    after = _served_chat(tok, [{"type": "text", "text": "What is this?"}, LOOK[1]], ims[:1])
    assert after.input_ids == _official(tok, "What is this?<image>", ims[:1]).input_ids
    between = _served_chat(tok, [LOOK[1], {"type": "text", "text": " vs "}, LOOK[1], {"type": "text", "text": "?"}],
                           ims)
    assert between.input_ids == _official(tok, "<image> vs <image>?", ims).input_ids


def test_a_literal_image_tag_in_text_is_text(tok):
    im = _img(1)
    plain = _served_chat(tok, [{"type": "text", "text": "what does <image> mean in HTML?"}], [])
    assert plain.images == [] and tok.img_start_id not in plain.input_ids
    assert "what does <image> mean" in tok.decode(plain.input_ids)
    # an image part and a literal tag: the image goes where its part is, the tag stays text
    got = _served_chat(tok, [{"type": "text", "text": "the <image> tag: "}, LOOK[1]], [im])
    assert got.input_ids.count(tok.img_start_id) == 1
    assert tok.decode(got.input_ids[:got.input_ids.index(tok.img_start_id)]).endswith("user\nthe <image> tag: ")


def test_interleave_heads_match_the_official_placeholder_prompt(tok):
    im = _img(3, 96, 64)
    system = P.interleave_system_message()
    msgs = prompt_messages([ChatMessage.model_validate({"role": "user", "content": LOOK})], [im])
    for think in (False, True):
        cond, tu = P.interleave_heads(tok, msgs, think, system)
        ocond, otu = P.official_interleave_heads(tok, OFFICIAL_LOOK, [im], think, system)
        assert cond.input_ids == ocond.input_ids and tu.input_ids == otu.input_ids
        assert all(a.pixel_values.equal(b.pixel_values) for a, b in zip(cond.images, ocond.images))
    # images first: the official `<image>\n` prefix, as before
    first = prompt_messages([ChatMessage.model_validate(
        {"role": "user", "content": [LOOK[1], {"type": "text", "text": "Redraw it"}]})], [im])
    assert P.interleave_heads(tok, first, False, system)[0].input_ids == \
        P.official_interleave_heads(tok, "Redraw it", [im], False, system)[0].input_ids


def _edit_cond(tok, prompt, pils, offsets=None):
    return P.edit_inputs(tok, prompt, pils, SamplerParams(mode="edit").branches(), image_offsets=offsets)["cond"]


def _official_edit(tok, user_text, pils):
    n = len(pils)
    tensors = [IM.preprocess(p, IM.EDIT_MIN_PIXELS, IM.edit_max_pixels(n)) for p in pils]
    return P.expand_images(tok, P.neo1_0([("user", user_text)], P.default_gen_system_message())
                           + P.EMPTY_THINK + "<img>", tensors)


def test_chat_image_edit_prompt_in_part_order(tok):
    """modalities ['image'] with input images: the gateway's last_user_turn gives the prompt and where each
    image stands (PrefixRequest.image_offsets); understanding's edit_inputs puts them there."""
    ims = [_img(1), _img(2)]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": LOOK}],
                                                "modalities": ["image"]})
    prompt, images, offsets = last_user_turn(req)
    assert (prompt, offsets, [p for p, _ in images]) == ("Look: \nDraw it from above.", [6], ["messages[0].content[1]"])
    PrefixRequest(request_id="r", mode="edit", prompt=prompt, images=["x"], image_offsets=offsets)
    assert _edit_cond(tok, prompt, ims[:1], offsets).input_ids == _official_edit(tok, OFFICIAL_LOOK, ims[:1]).input_ids
    # two images first (no offsets, or all 0): it2i_generate's Image-k labels; one image first: <image>\n
    two = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        LOOK[1], LOOK[1], {"type": "text", "text": "merge"}, {"type": "text", "text": "them"}]}], "modalities": ["image"]})
    prompt, _, offsets = last_user_turn(two)
    assert (prompt, offsets) == ("merge\nthem", [0, 0])
    labelled = _official_edit(tok, "Image-1:<image>\nImage-2:<image>\nmerge\nthem", ims).input_ids
    assert _edit_cond(tok, prompt, ims, offsets).input_ids == labelled == _edit_cond(tok, prompt, ims).input_ids
    literal = _edit_cond(tok, "a <image> b", ims[:1])
    assert literal.input_ids.count(tok.img_end_id) == 1 and "a <image> b" in tok.decode(literal.input_ids)


def test_image_offsets_are_checked():
    base = dict(request_id="r", mode="edit", prompt="abc", images=["x", "y"])
    for bad in ([1], [2, 1], [0, 4], [-1, 0]):
        with pytest.raises(ValueError):
            PrefixRequest(**base, image_offsets=bad)
    assert PrefixRequest(**base, image_offsets=[0, 3]).image_offsets == [0, 3]
