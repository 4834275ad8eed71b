"""The model's layout without its memory: `skeleton(cfg, branch)` builds a NeoModel on the meta device (names, shapes,
dtypes) for the loader, the memory plan and the weight updates, skipping its modules' random init.

Why skip it: on meta the init computes nothing, but its first call goes through torch._refs, whose ops are guarded
against torch.compile, and that guard imports torch._dynamo (with sympy and torch.distributed): 2-4 s of every
engine start on a CPU core, for a process that never compiles. The init functions are swapped for ones that skip
only in a thread inside `skeleton` (another thread building real modules meanwhile keeps its init), and restored
when the last such build ends.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from .config import NeoConfig
from .model import NeoModel
from .parallel import TPContext

_INIT = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
         "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_lock = threading.Lock()
_builds = 0                            # skeleton builds in progress (any thread): the swap stays until none is
_originals: dict = {}
_here = threading.local()              # .on: this thread is inside a skeleton build


def _skipping(init):
    def maybe(tensor, *args, **kwargs):
        return tensor if getattr(_here, "on", False) else init(tensor, *args, **kwargs)
    return maybe


@contextlib.contextmanager
def _init_skipped():
    global _builds
    with _lock:
        if _builds == 0:
            for name in _INIT:
                _originals[name] = getattr(nn.init, name)
                setattr(nn.init, name, _skipping(_originals[name]))
        _builds += 1
    _here.on = True
    try:
        yield
    finally:
        _here.on = False
        with _lock:
            _builds -= 1
            if _builds == 0:
                for name, init in _originals.items():
                    setattr(nn.init, name, init)


def skeleton(cfg: NeoConfig, branch: str = "both", tp: TPContext | None = None) -> NeoModel:
    """A NeoModel of `branch` on the meta device, its parameters uninitialised (they take no memory)."""
    with torch.device("meta"), _init_skipped():
        return NeoModel(cfg, branch, tp)
