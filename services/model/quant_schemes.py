"""The 8-bit schemes by name (`--quantization`, `u1serve convert --to`): fp8 (quant.py) and int8 (quant_int8.py,
whose layers subclass the fp8 ones). Kept apart from both so neither imports the other's users."""
from __future__ import annotations

from .quant import FP8_SCHEME, Scheme
from .quant_int8 import INT8_SCHEME

SCHEMES: dict[str, Scheme] = {"fp8": FP8_SCHEME, "int8": INT8_SCHEME}


def scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"no 8-bit scheme {name!r} ({', '.join(SCHEMES)})") from None
