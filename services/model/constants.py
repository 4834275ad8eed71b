"""The model's constants that the engines' configs read, declared once and importable without torch (a config
module reads them; the code that uses them imports them from here): the weight dtypes, the quantization schemes,
the pixel bounds chat images are resized to. `torch_dtype` is the one map from a dtype name to torch's dtype."""
from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")      # weights and KV of both engines
QUANTIZATIONS = ("none", "fp8", "int8")          # the schemes by name: services/model/quant_schemes.py
VQA_MIN_PIXELS, VQA_MAX_PIXELS = 65536, 4194304  # chat images are resized into these bounds (images.preprocess)


def torch_dtype(name: str):
    """The torch dtype of a DTYPES name (ValueError for any other)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    import torch        # here: the names above stay importable without torch
    return getattr(torch, name)
