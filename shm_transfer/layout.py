"""KVLayout: the geometry of one pool page, shared by producer and consumer."""
from __future__ import annotations

import dataclasses
import json

import torch

# Bump when the page layout or the handle schema changes incompatibly.
LAYOUT_VERSION = 2  # 2: claimer columns + slot table in the page table; handle transport fields

# The dtypes a pool page may hold, by torch's own names (torch.<name>): the engines' DTYPES
# (services/model/choices.py, which this package does not import: it sits below services/) and float64 for tests.
KV_DTYPES = ("float32", "float16", "bfloat16", "float64")


def dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; one of {sorted(KV_DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """A page holds `[num_layers, 2, page_tokens, num_kv_heads, head_dim]` (index 0 = K, 1 = V).

    `dtype` is stored as its name ("bfloat16", ...) so the layout is JSON-able and hashable.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_tokens: int

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for field in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_tokens

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a contiguous per-request KV tensor `[L, 2, T, Hkv, D]`."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"KVLayout dict must have exactly the keys {sorted(names)}, got {d!r}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
