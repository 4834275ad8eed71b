"""The checkpoint's files: the safetensors index or single file, and the names fp8 checkpoints add. Read by the
loader, the fp8 converter (quant.py) and the weights API (weights_io.py); imports no model code."""
from __future__ import annotations

import json
import os

from safetensors import safe_open

from services.base.checkpoint_names import INDEX_FILE, SINGLE_FILE

FP8_SCALE_SUFFIX = ".weight_scale"   # fp8 / int8 checkpoints: per-output-channel fp32 scale of `X.weight`


class LoadError(ValueError):
    """The checkpoint does not match the model; the message names the file or key."""


def weight_map(model_dir: str) -> dict[str, str]:
    """key -> shard file path."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoadError(f"{index} is not a valid safetensors index: {e}") from None
        for shard_file in set(wm.values()):
            if not os.path.exists(os.path.join(model_dir, shard_file)):
                raise LoadError(f"shard {shard_file} named in {INDEX_FILE} is missing")
        return {k: os.path.join(model_dir, v) for k, v in wm.items()}
    single = os.path.join(model_dir, SINGLE_FILE)
    if not os.path.exists(single):
        raise LoadError(f"no {INDEX_FILE} or {SINGLE_FILE} in {model_dir}")
    with open_safetensors(single) as f:
        return {k: single for k in f.keys()}


def open_safetensors(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise LoadError(f"corrupt or unreadable safetensors file {path}: {e}") from None
