"""Message content in part order, as text runs around images: one rule for the request contract (where each
image stands in a chat message) and the model's prompts (where each image goes in the template)."""
from __future__ import annotations

from typing import Iterable, TypeVar, Union

T = TypeVar("T")


def text_runs(items: Iterable[Union[str, T]], sep: str = "") -> tuple[list[str], list[T]]:
    """Content in part order -> (runs, images): a str item is text, anything else an image; the runs are the text
    before, between and after the images (n images give n + 1 runs, empty where two parts touch), text items next
    to each other joined by `sep`. Where each image stands among the text is the parts' order, nothing else: text
    is text (a literal `<image>` in it is no placeholder)."""
    runs: list[list[str]] = [[]]
    images: list[T] = []
    for item in items:
        if isinstance(item, str):
            runs[-1].append(item)
        else:
            images.append(item)
            runs.append([])
    return [sep.join(r) for r in runs], images
