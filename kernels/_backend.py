"""Backend choice shared by every op: Triton on CUDA, torch reference elsewhere.

`U1SERVE_KERNELS=ref|triton|auto` (default auto) overrides the choice.
Triton kernels are JIT-wrapped lazily (see `lazy_jit`) because triton decides
at decoration time whether a kernel is interpreted (`TRITON_INTERPRET=1`):
building on first use lets tests switch the interpreter on for their own
process section without affecting modules imported earlier.
"""
from __future__ import annotations

import os

import torch

try:  # triton is optional: CPU-only installs use the references
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False

MODES = ("auto", "ref", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("U1SERVE_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"U1SERVE_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def use_triton(t: torch.Tensor, supported: bool = True) -> bool:
    """True when the op should run its Triton kernel on tensor `t`."""
    mode = kernel_mode()
    if mode == "ref":
        return False
    if mode == "triton":
        if not HAS_TRITON:
            raise RuntimeError("U1SERVE_KERNELS=triton but triton is not importable")
        if not supported:
            raise ValueError("U1SERVE_KERNELS=triton: this shape/dtype is not supported by the Triton kernel")
        if not t.is_cuda and not interpreting():
            raise RuntimeError("U1SERVE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return HAS_TRITON and supported and t.is_cuda


class lazy_jit:
    """`triton.jit` applied on first launch, once per interpreter setting."""

    def __init__(self, fn, helpers=None):
        """`helpers`: {global name: plain function} of `@triton.jit` helpers the kernel calls (directly or
        through each other); they are jitted with the kernel (same interpreter setting) and bound into its
        module and the helpers' own modules (a helper's calls resolve in the module that defines it)."""
        self.fn = fn
        self.helpers = dict(helpers or {})
        self._built: dict[bool, object] = {}
        self._bound = None

    def _get(self):
        key = interpreting()
        k = self._built.get(key)
        if k is None:
            if not HAS_TRITON:
                raise RuntimeError("triton is not importable")
            if key:
                _patch_interpreter_index()
            k = (triton.jit(self.fn), {n: triton.jit(f) for n, f in self.helpers.items()})
            self._built[key] = k
        if self._bound is not key:  # (re)bind the helpers of this interpreter setting
            modules = {id(f.__globals__): f.__globals__ for f in (self.fn, *self.helpers.values())}
            for module_globals in modules.values():
                module_globals.update(k[1])
            self._bound = key
        return k[0]

    def __getitem__(self, grid):
        return self._get()[grid]


def triton_cdiv(a: int, b: int) -> int:
    """Launch-grid ceil division (host ints)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_INDEX_PATCHED = False


def _patch_interpreter_index() -> None:
    """Let the triton interpreter use loaded scalars as loop bounds under numpy >= 2.4.

    The interpreter keeps scalars as shape-(1,) arrays and converts them with
    `int(array)`, which numpy 2.4 rejects; data-dependent `range()` bounds
    (every varlen kernel here) then fail. Only touches interpreter mode.
    """
    global _INDEX_PATCHED
    if _INDEX_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _INDEX_PATCHED = True
