"""Prompt construction: the neo1_0 chat template and the CFG-branch prefixes for T2I and editing."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

from services.base.content import text_runs

from .constants import VQA_MAX_PIXELS, VQA_MIN_PIXELS
from .images import (EDIT_MIN_PIXELS, ImageTensor, edit_max_pixels,
                     generation_input, preprocess)
from .tokenizer import IM_END, IM_START, IMG_CONTEXT, IMG_START, NeoTokenizer

IMAGE_PLACEHOLDER = "<image>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
THINK_OPEN = "<think>\n"
THINK_TAIL = "\n\n" + IMG_START  # appended after a think block, as a causal block


def think_excluded_ids(tok: NeoTokenizer) -> tuple[int, ...]:
    """Tokens a *sampled* think block never contains: the image-span markers. Re-prefilling the block (RL scoring,
    the trainer's recomputation) would read them as an image run; sampling gives them probability 0 instead."""
    return (tok.img_start_id, tok.img_end_id, tok.img_context_id)
GEN_SYSTEM_MESSAGE_FILE = "gen_system_message.txt"
# the system prompt of the official interleave driver (think / non-think protocol); interleave_spec §1.1
INTERLEAVE_SYSTEM_MESSAGE_FILE = "interleave_system_message.txt"


@dataclass
class PromptInput:
    input_ids: list[int]
    images: list[ImageTensor] = field(default_factory=list)

    @property
    def grids(self):
        return [im.grid_hw for im in self.images]


def default_gen_system_message() -> str:
    return _system_message(GEN_SYSTEM_MESSAGE_FILE, None, None)


def _system_message(name: str, model_dir: str | None, override: str | None) -> str:
    """option > the checkpoint's file > our data file."""
    if override is not None:
        return override
    if model_dir:
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
    return resources.files("services.model").joinpath("data", name).read_text()


def gen_system_message(model_dir: str | None = None, override: str | None = None) -> str:
    """The generation system message the checkpoint was trained with: option > checkpoint file > data file."""
    return _system_message(GEN_SYSTEM_MESSAGE_FILE, model_dir, override)


def interleave_system_message(model_dir: str | None = None, override: str | None = None) -> str:
    """The system prompt of interleaved answers: option > checkpoint file > the official driver's."""
    return _system_message(INTERLEAVE_SYSTEM_MESSAGE_FILE, model_dir, override)


Parts = list[tuple[str, bool]]      # (text, is client text): a prompt whose client text is tokenised as text
Content = str | list[str]           # a turn's text, or its text runs around its images (base.content.text_runs)


def place_images(runs: list[str], labels: bool = False) -> list[str]:
    """A user turn's text runs with each image where its content part stands; when all the images come first (no
    text before the last one), the official template's own placement instead, as for a question that names no
    image: `<image>\\n` before the text, one per image (chat, interleave_gen), or for several images of an edit
    prompt (`labels`) `Image-k:<image>\\n` each (it2i_generate). The runs of the result sit around the images."""
    n = len(runs) - 1
    if n == 0 or any(runs[:-1]):
        return list(runs)
    if labels and n > 1:
        return ["Image-1:"] + [f"\nImage-{k + 1}:" for k in range(1, n)] + ["\n" + runs[-1]]
    return [""] + ["\n"] * (n - 1) + ["\n" + runs[-1]]


def neo1_0_parts(turns: list[tuple[str, Content]], system: str = "", generation_prompt: bool = True,
                 client_system: bool = True) -> Parts:
    """MPT-style template: optional system block, one block per turn, then `<|im_start|>assistant\\n`. Each turn's
    role line and content is client text, the system block too unless it is the server's own (`client_system`
    False: the generation system messages, which spell out <think>); a content given as text runs has an image
    placeholder between each two runs (a part of its own: client text never holds one). The parts split at the
    template's special tokens and the images, so tokenising them one by one gives the ids of the whole string
    (for text without special-token strings)."""
    out: Parts = []
    blocks = ([("system", system, client_system)] if system else []) + [(r, c, True) for r, c in turns]
    for role, content, client in blocks:
        runs = [content] if isinstance(content, str) else content
        out += [(IM_START, False), (f"{role}\n{runs[0]}", client)]
        for run in runs[1:]:
            out += [(IMAGE_PLACEHOLDER, False), (run, client)]
        out.append((IM_END + "\n", False))
    if generation_prompt:
        out.append((IM_START + "assistant\n", False))
    return out


def neo1_0(turns: list[tuple[str, Content]], system: str = "", generation_prompt: bool = True) -> str:
    return "".join(text for text, _ in neo1_0_parts(turns, system, generation_prompt))


def encode_parts(tok: NeoTokenizer, parts: Parts, images: list[ImageTensor]) -> PromptInput:
    """Tokenise the parts (client text as plain text: tok.encode_text, a literal <image> in it included), each
    <image> of the server's parts replaced by the span of the next image (<img> + <IMG_CONTEXT> x tokens +
    </img>)."""
    placeholders = sum(text.count(IMAGE_PLACEHOLDER) for text, client in parts if not client)
    if placeholders != len(images):
        raise ValueError(f"{placeholders} <image> placeholders for {len(images)} images")
    ids: list[int] = []
    it = iter(images)
    for text, client in parts:
        if client:
            if IMG_CONTEXT in text:       # as before: an image-token injection is refused
                raise ValueError(f"text may not contain the image placeholder token {IMG_CONTEXT}")
            ids += tok.encode_text(text) if text else []
            continue
        for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if k:
                ids += image_span_ids(tok, next(it))
            if piece:
                ids += tok.encode(piece)
    return PromptInput(ids, list(images))


def expand_images(tok: NeoTokenizer, text: str, images: list[ImageTensor]) -> PromptInput:
    """Replace each <image> by <img> + <IMG_CONTEXT> x tokens + </img> and tokenise (all of `text` is trusted)."""
    return encode_parts(tok, [(text, False)], images)


def chat_input(tok: NeoTokenizer, messages: list[dict], enable_thinking: bool | None = None,
               min_pixels: int = VQA_MIN_PIXELS, max_pixels: int = VQA_MAX_PIXELS,
               server_system: str = "") -> PromptInput:
    """OpenAI-like messages -> PromptInput. Content is a string or a list of text / image parts
    ({"type": "image", "image": PIL}); each image sits where its part stands among the text parts, or, when a
    turn's images all come first, as upstream's chat puts them (`<image>\\n` before the text, one per image:
    place_images). Message text is client text (tokenised as text, `<image>` too); `server_system`, used when
    the messages have no system message, is the server's."""
    system = ""
    turns: list[tuple[str, Content]] = []
    images: list[ImageTensor] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unknown role {role!r}")
        runs, pics = text_runs(_part_items(content))
        if pics:
            images.extend(preprocess(p, min_pixels, max_pixels) for p in pics)
        runs = place_images(runs)
        if role == "system":
            system = runs[0]
        else:
            turns.append((role, runs if pics else runs[0]))
    # the messages' own system message is the client's; without one, the server's (`server_system`) is used
    own = any(m.get("role") == "system" for m in messages)
    parts = neo1_0_parts(turns, system if own else server_system, client_system=own)
    if enable_thinking is True:
        parts.append((THINK_OPEN, False))
    elif enable_thinking is False:
        parts.append((EMPTY_THINK, False))
    return encode_parts(tok, parts, images)


def _part_items(content) -> list:
    """chat_input's content -> text_runs' items (a str per text part, the PIL image of an image part)."""
    if isinstance(content, str) or content is None:
        return [content or ""]
    items = []
    for part in content:
        if part.get("type") == "text":
            items.append(part.get("text", ""))
        elif part.get("type") == "image":
            items.append(part["image"])
        else:
            raise ValueError(f"unknown content part type {part.get('type')!r}")
    return items


UNCOND_TEXT = neo1_0([("user", "")]) + IMG_START  # the fixed 9-token prefix (no system, no think)


def t2i_inputs(tok: NeoTokenizer, prompt: str, branches: Sequence[str], think: bool = False,
               system_message: str | None = None) -> dict[str, PromptInput]:
    system = default_gen_system_message() if system_message is None else system_message
    head = neo1_0_parts([("user", prompt)], system, client_system=False)
    out = {"cond": encode_parts(tok, head + [(THINK_OPEN if think else EMPTY_THINK + IMG_START, False)], [])}
    if "uncond" in branches:
        out["uncond"] = PromptInput(tok.encode(UNCOND_TEXT))
    return out


def split_at(text: str, offsets: list[int] | None, n: int) -> list[str]:
    """`text` cut at each image's character offset (non-decreasing, in [0, len(text)]) into the n + 1 text runs
    around n images; no offsets: all n images before the text."""
    offsets = [0] * n if offsets is None else list(offsets)
    if len(offsets) != n or any(b < a for a, b in zip([0] + offsets, offsets + [len(text)])):
        raise ValueError(f"image offsets {offsets} do not place {n} images in order in a {len(text)}-character "
                         "prompt")
    return [text[a:b] for a, b in zip([0] + offsets, offsets + [len(text)])]


def edit_inputs(tok: NeoTokenizer, prompt: str, images: list, branches: Sequence[str], think: bool = False,
                system_message: str | None = None, image_offsets: list[int] | None = None) -> dict[str, PromptInput]:
    """Editing prefixes: cond (system + images + instruction), img_cond (images only), uncond. Image k sits at
    character `image_offsets[k]` of the prompt (the request's content-part order); all at 0 or none given: the
    official placement (place_images with labels). The prompt is client text: a literal <image> is text."""
    if not 1 <= len(images) <= 4:
        raise ValueError("editing takes 1 to 4 input images")
    tensors = [generation_input(preprocess(im, EDIT_MIN_PIXELS, edit_max_pixels(len(images)))) for im in images]
    n = len(images)
    text = place_images(split_at(prompt, image_offsets, n), labels=True)
    system = default_gen_system_message() if system_message is None else system_message
    tail = THINK_OPEN if think else EMPTY_THINK + IMG_START
    out = {"cond": encode_parts(tok, neo1_0_parts([("user", text)], system, client_system=False) + [(tail, False)],
                                tensors)}
    if "img_cond" in branches:
        out["img_cond"] = expand_images(tok, neo1_0([("user", IMAGE_PLACEHOLDER * n)]) + IMG_START, tensors)
    if "uncond" in branches:
        out["uncond"] = PromptInput(tok.encode(UNCOND_TEXT))
    return out


# ---- interleaved text-and-image answers (interleave_spec.md) ---------------------------------------------
def interleave_heads(tok: NeoTokenizer, messages: list[dict], think: bool, system_message: str,
                     images_max_pixels: int | None = None) -> tuple[PromptInput, PromptInput]:
    """The two growing branches of an interleaved answer before its first token (spec §2.1):
    cond = system + the conversation (input images at the edit sizes) + `assistant\\n` (+ the empty think block
    unless think mode: the model then opens <think> itself); tu ("text-uncond") = one user turn holding only the
    input images, no system, no text, no think block. A system message in `messages` wins over `system_message`.
    Input images are bf16-rounded as the official loop feeds them (images.generation_input)."""
    n = sum(1 for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image")
    cond = chat_input(tok, messages, None if think else False, EDIT_MIN_PIXELS,
                      images_max_pixels or edit_max_pixels(max(1, n)), server_system=system_message or "")
    cond = PromptInput(cond.input_ids, [generation_input(im) for im in cond.images])
    return cond, _text_free_head(tok, cond.images)


def _text_free_head(tok: NeoTokenizer, images: list[ImageTensor]) -> PromptInput:
    """tu before the answer: one user turn holding only the input images (spec §2.1)."""
    return expand_images(tok, neo1_0([("user", IMAGE_PLACEHOLDER * len(images))]), images)


def official_interleave_heads(tok: NeoTokenizer, prompt: str, images: list, think: bool,
                              system_message: str) -> tuple[PromptInput, PromptInput]:
    """interleave_gen's own heads, restated from spec §1.1 / §2.1 for tests: `prompt` is its trusted prompt, each
    `<image>` in it the placeholder of the next input image, `<image>\\n` prepended for each image past the
    placeholders; the images at the edit sizes, bf16-rounded; the system block only when non-empty."""
    n = len(images)
    text = (IMAGE_PLACEHOLDER + "\n") * max(0, n - prompt.count(IMAGE_PLACEHOLDER)) + prompt
    tensors = [generation_input(preprocess(im, EDIT_MIN_PIXELS, edit_max_pixels(max(1, n)))) for im in images]
    cond = expand_images(tok, neo1_0([("user", text)], system_message) + ("" if think else EMPTY_THINK), tensors)
    return cond, _text_free_head(tok, tensors)


def image_span_ids(tok: NeoTokenizer, image: ImageTensor) -> list[int]:
    """`<img>` + one `<IMG_CONTEXT>` per token + `</img>`: how an image (input or generated) sits in a prompt."""
    return [tok.img_start_id] + [tok.img_context_id] * image.num_tokens + [tok.img_end_id]


def extend_prompt(tok: NeoTokenizer, head: PromptInput, items: list, with_text: bool = True) -> PromptInput:
    """`head` followed by an answer's transcript: token-id lists (dropped when not `with_text`: the tu branch
    never sees text) and generated images (ImageTensor), each as its image span."""
    ids, images = list(head.input_ids), list(head.images)
    for item in items:
        if isinstance(item, ImageTensor):
            ids += image_span_ids(tok, item)
            images.append(item)
        elif with_text:
            ids += list(item)
    return PromptInput(ids, images)
