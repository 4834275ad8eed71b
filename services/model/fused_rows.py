"""Several Linear layers of one input as one weight: q|k|v of an attention, gate|up of a SwiGLU (of the und
branch, whose decode steps run them with a few rows; the gen branch's forwards have hundreds).

A decode step reads every weight once; separate q / k / v GEMMs read the small k / v weights at half the
bandwidth of the large ones (a [1024 x 4096] weight cannot fill the GPU: docs/benchmarks/kernels.md) and cost a
launch each. `FusedRows` copies the layers' weights into one contiguous [sum(out), in] tensor and makes each
layer's Parameter a view of its rows (`param.data = fused[r0:r1]`): the Parameters keep their identity and names
(checkpoint keys, LoRA targets, optimisers), everything that writes them in place (weight updates `copy_`,
merges, optimiser steps) lands in the fused weight, and memory is not doubled (the separate storages are freed).

The fused GEMM runs where it is safe and pays: no autograd (the trainer's differentiable forward keeps the
layers), at most `kernels.SKINNY_MAX_ROWS` rows (decode; prefill keeps the separate GEMMs: one launch saved of
a long step, not measured), no forward hooks on the layers (multi-LoRA's
hooks add per-layer products: those steps run the layers), and while every layer's weight still is its view
(`intact`: something that replaced a Parameter falls back, and the owner's `_apply` / load hook re-fuse).
Its outputs are column views of one [rows, sum(out)] result (row stride sum(out)): the consumers (q/k norm +
RoPE, the KV write, decode / prefill attention, silu*mul) take row-strided inputs.

Where: CUDA by default (`fusion_wanted`); on the CPU the separate GEMMs keep today's bits (MKL's result for a
column can depend on the matrix width). U1SERVE_FUSED_PROJ=0 turns it off, =1 fuses on any device (tests).
Quantised layers (model/quant.py) are not plain Linear layers and keep their own layouts (fp8 / int8 already run
one k|v and one gate|up GEMM); GGUF weights are dequantised to plain layers at load and fuse like any.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from services.base import knobs

FUSED_PROJ_VALUES = ("auto", "0", "1")


def fusion_wanted(device) -> bool:
    """Whether the projections of a model on `device` run fused (U1SERVE_FUSED_PROJ: auto = CUDA only)."""
    mode = knobs.FUSED_PROJ.get().strip().lower()
    if mode not in FUSED_PROJ_VALUES:
        raise ValueError(f"{knobs.FUSED_PROJ.name} must be one of {FUSED_PROJ_VALUES}, got {mode!r}")
    return mode == "1" or (mode == "auto" and torch.device(device).type == "cuda")


def fusable(linears) -> bool:
    """Plain bias-free Linear layers of one input width, dtype and device (quantised layers are not)."""
    ws = [getattr(lin, "weight", None) for lin in linears]
    return (all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears)
            and all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type != "meta" for w in ws)
            and len({(w.shape[1], w.dtype, w.device) for w in ws}) == 1)


def hooked(module: nn.Module) -> bool:
    """A module with forward hooks (multi-LoRA's): it must run its own forward."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


class FusedRows:
    """The weights of `linears` as one tensor `weight` (rows in order), each layer's weight a view of its rows."""

    def __init__(self, linears):
        self.linears = tuple(linears)
        self.splits = tuple(lin.weight.shape[0] for lin in self.linears)
        self.skinny = all(getattr(lin, "skinny", False) for lin in self.linears)
        w0 = self.linears[0].weight
        self.weight = torch.empty((sum(self.splits), w0.shape[1]), dtype=w0.dtype, device=w0.device)
        r0 = 0
        with torch.no_grad():
            for lin, rows in zip(self.linears, self.splits):
                view = self.weight[r0:r0 + rows]
                view.copy_(lin.weight)
                lin.weight.data = view        # same Parameter, now aliasing the fused rows
                r0 += rows
        self._ptrs = tuple(lin.weight.data_ptr() for lin in self.linears)

    def intact(self) -> bool:
        """Every layer's weight still is its view of `weight` (nothing replaced a Parameter since)."""
        return all(lin.weight.data_ptr() == p for lin, p in zip(self.linears, self._ptrs))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The layers' outputs of x from one GEMM (column views of one result), or None where the layers must
        run one by one (module doc)."""
        y = self.output(x)
        return None if y is None else y.split(self.splits, dim=1)

    def output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The one GEMM's [rows, sum(splits)] result, or None (see __call__)."""
        if (torch.is_grad_enabled() or x.dim() != 2 or x.shape[0] > kernels.SKINNY_MAX_ROWS
                or any(hooked(lin) for lin in self.linears) or not self.intact()):
            return None
        return kernels.skinny_linear(x, self.weight) if self.skinny and x.is_cuda else F.linear(x, self.weight)

    def split(self) -> None:
        """Give every layer its own storage again (the fused weight is dropped; for comparing)."""
        with torch.no_grad():
            for lin in self.linears:
                lin.weight.data = lin.weight.detach().clone()
        self.weight = None


class RowFusion:
    """Mixin of a module some of whose Linear layers may run as one (`fuse_rows`): keeps `self.fused`
    {key: FusedRows} true when the Parameters are replaced (`.to()` and friends, `load_state_dict(assign=True)`):
    re-fused where fusion is wanted on the new device, else dropped."""

    def fused_groups(self) -> dict[str, list[str]]:
        """{key: names of the Linear attributes that run as one}: the owner's layout."""
        raise NotImplementedError

    def init_row_fusion(self) -> None:
        self.fused: dict[str, FusedRows] = {}
        self.register_load_state_dict_post_hook(_refresh_after_load)

    def fuse_rows(self, on: bool = True) -> int:
        """Fuse every fusable group (`on`), or split every fused one. Returns the groups fused now."""
        for key in list(self.fused):
            self.fused.pop(key).split()
        if not on:
            return 0
        for key, names in self.fused_groups().items():
            linears = [getattr(self, n, None) for n in names]
            if fusable(linears):
                self.fused[key] = FusedRows(linears)
        return len(self.fused)

    def fused_call(self, key: str, x: torch.Tensor):
        rows = self.fused.get(key)
        return None if rows is None else rows(x)

    def refresh_fusion(self) -> None:
        for key, rows in list(self.fused.items()):
            if rows.intact():
                continue
            del self.fused[key]
            if fusable(rows.linears) and fusion_wanted(rows.linears[0].weight.device):
                self.fused[key] = FusedRows(rows.linears)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.refresh_fusion()
        return out


def _refresh_after_load(module: RowFusion, _incompatible_keys) -> None:
    module.refresh_fusion()       # a module-level function, not a lambda: the model stays picklable


def fuse_projections(model: nn.Module, on: bool | None = None) -> int:
    """Fuse q|k|v and gate|up of every layer of `model` (`on` None: where `fusion_wanted` on its device; False:
    split them again). Returns the groups fused."""
    if on is None:
        p = next(model.parameters(), None)
        on = p is not None and fusion_wanted(p.device)
    return sum(m.fuse_rows(on) for m in model.modules() if isinstance(m, RowFusion))


def fused_bytes(model: nn.Module) -> int:
    """Bytes of the fused weights (each also counted by its layers' Parameters, which are views of it)."""
    return sum(r.weight.numel() * r.weight.element_size()
               for m in model.modules() if isinstance(m, RowFusion) for r in m.fused.values())
