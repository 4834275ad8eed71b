"""Request builders and reference helpers shared by the understanding tests."""
from __future__ import annotations

import base64
import io
import random

import numpy as np
from PIL import Image

from .conftest import IMG_MAX, IMG_MIN


def make_image(seed: int, w: int, h: int, fmt: str = "PNG") -> tuple[Image.Image, str]:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return img, "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mixed_requests(n: int, seed: int, with_images: bool = True) -> list[dict]:
    """n chat requests of mixed lengths; every other one carries an image when with_images."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 90)))
        max_tokens = rng.randint(4, 24)
        if with_images and i % 2 == 1:
            pil, url = make_image(seed * 100 + i, rng.choice([48, 96, 130]), rng.choice([40, 64, 120]))
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
            ref_content = [{"type": "image", "image": pil}, {"type": "text", "text": text}]
        else:
            content = ref_content = text
        out.append({"messages": [{"role": "user", "content": content}],
                    "ref_messages": [{"role": "user", "content": ref_content}], "max_tokens": max_tokens})
    return out


def reference_ids(ref, req: dict) -> list[int]:
    from services.model import prompts as PR
    from services.model import reference as R
    model, tok = ref
    inp = PR.chat_input(tok, req["ref_messages"], None, IMG_MIN, IMG_MAX)   # the official prompt (no think block)
    return R.generate_text(model, tok, inp, max_new_tokens=req["max_tokens"], keep_stop=True)   # as token_ids


def chat_body(req: dict, **kw) -> dict:
    body = {"model": "tiny", "messages": req["messages"], "max_tokens": req["max_tokens"], "temperature": 0.0,
            "return_token_ids": True}
    body.update(kw)
    return body
