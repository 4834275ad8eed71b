"""The resident LoRA adapters of one engine rank, served unmerged (per request; docs/lora.md).

Every target linear (q/k/v/o and gate/up/down of both branches: TARGET) gets two stacked tables, A [S, R, in]
and B [S, out, R] (S = max resident adapters, R = max rank padded for the kernel), allocated once, and a forward
hook (lora_batched.LoraHook). Loading an adapter reads the file (loader.read_lora: the official and the PEFT
layouts, one implementation with the load-time merge), checks that every module it names binds to a target of
this model with the right shape (else it is refused, naming the modules), and copies this rank's shard of its
factors into a free slot (the scale alpha/r times the strength folded into B). An adapter that names nothing of
this rank's branch takes no slot: its requests run the base weights here.

Requests hold their adapter (`acquire` / `release`): `unload` removes the name at once (new requests: 404) and
frees the slot only when the last request that uses it ends, so its tables are never overwritten under a
running request. Load and unload run as ops of the engines' weights channel (weights_io.LiveWeights.run), on
every rank in the same order; rank 0, which holds the request counts, picks the slot.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from services.base import knobs

from kernels.lora import padded_rank

from .checkpoint_files import LoadError
from .loader import name_list, read_lora
from .lora_batched import LoraHook
from .lora_spec import parse_lora_spec
from .parallel import shard, shard_dim

TARGET = re.compile(r"^language_model\.model\.layers\.\d+\."
                    r"(self_attn\.[qkvo]_proj(_mot_gen)?|mlp(_mot_gen)?\.(gate|up|down)_proj)$")
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_RANK = 16


class LoraError(LoadError):
    """An adapter op refused; `status` / `code` are the HTTP answer's."""
    status, code = 400, "invalid_lora"

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status or type(self).status
        self.code = code or type(self).code


class AdapterNotFound(LoraError):
    status, code = 404, "model_not_found"


@dataclass
class Adapter:
    name: str
    path: str
    uid: str                      # unique per load: the prefix-cache domain of its requests
    slot: int                     # -1: names nothing of this branch (its requests run the base weights here)
    modules: int = 0
    refs: int = 0
    retired: bool = False
    registry: "LoraRegistry | None" = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """A request that held this adapter ended (once per `acquire`)."""
        self.registry.release(self)


@dataclass
class Staged:
    """A read and checked adapter, as this rank will hold it: {module: (A [r, in_local], B [out_local, r])}."""
    name: str
    path: str
    factors: dict = field(default_factory=dict)


def parse_modules(text: str) -> list[tuple[str, str, float]]:
    """'name=path[:strength],name=path' -> [(name, path, strength)] (`--lora-modules`, $U1SERVE_LORA_MODULES)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, spec = item.partition("=")
        if not sep or not name.strip() or not spec.strip():
            raise ValueError(f"LoRA module {item!r}: expected NAME=PATH")
        path, strength = parse_lora_spec(spec.strip())
        out.append((name.strip(), path, strength))
    return out


def target_names(model) -> dict[str, nn.Module]:
    """Target module name -> its nn.Linear in `model` (this rank's shard)."""
    return {n: m for n, m in model.named_modules() if TARGET.match(n) and isinstance(m, nn.Linear)}


class LoraRegistry:
    def __init__(self, model, max_loras: int, max_rank: int):
        from .weights_io import checkpoint_shapes
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be >= 1")
        modules = target_names(model)
        if any(TARGET.match(n) and n not in modules for n, _ in model.named_modules()):
            raise LoadError("multi-LoRA needs the model's plain Linear layers (it does not run on fp8-quantised "
                            "layers yet: drop --quantization fp8 or merge the adapter with --lora)")
        self.tp = model.tp
        self.device, self.dtype = model.device, model.dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.R = padded_rank(max_rank)
        self.shapes = {k[: -len(".weight")]: s for k, s in checkpoint_shapes(model).items()
                       if TARGET.match(k[: -len(".weight")])}
        self.hooks: dict[str, LoraHook] = {}
        for name, lin in modules.items():
            a = torch.zeros(max_loras, self.R, lin.in_features, device=self.device, dtype=self.dtype)
            b = torch.zeros(max_loras, lin.out_features, self.R, device=self.device, dtype=self.dtype)
            hook = LoraHook(self, name, a, b)
            lin.register_forward_hook(hook)
            self.hooks[name] = hook
        self.adapters: dict[str, Adapter] = {}
        self.retired: dict[str, Adapter] = {}      # unloaded, tables intact until their slot is reused (unload)
        self.slots: list[Adapter | None] = [None] * max_loras
        self.batch = None           # lora_batched.LoraBatch of the forward running now
        self._loads = 0

    # ---- reading an adapter ----------------------------------------------------------------------
    def stage(self, name: str, path: str, strength: float = 1.0) -> Staged:
        """Read and check the adapter at `path` (nothing changes here). Raises LoraError / LoadError."""
        if name in self.adapters:
            raise LoraError(f"The lora adapter {name!r} has already been loaded.", code="lora_already_loaded")
        if not os.path.exists(path):
            raise LoraError(f"LoRA adapter {name!r}: {path} does not exist (it must be readable by every engine "
                            "process)", code="lora_not_found")
        factors = read_lora(path)
        if not factors:
            raise LoraError(f"LoRA adapter {name!r} ({path}) has no LoRA factors (official X.lora_down.weight / "
                            "X.lora_up.weight, or PEFT's lora_A / lora_B)")
        unbound = [m for m in factors if m not in self.shapes]
        if unbound:
            bound = len(factors) - len(unbound)
            raise LoraError(f"LoRA adapter {name!r}: {len(unbound)} of its {len(factors)} modules do not bind to "
                            f"this model ({bound} do): {name_list(unbound)}; the targets are the decoder layers' "
                            "q/k/v/o_proj and mlp gate/up/down_proj of both branches (`_mot_gen`)",
                            code="lora_modules_unbound")
        bad, too_wide = [], []
        for m, (down, up, _) in factors.items():
            out_f, in_f = self.shapes[m]
            r = down.shape[0]
            if down.dim() != 2 or up.dim() != 2 or down.shape[1] != in_f or up.shape != (out_f, r):
                bad.append(f"{m!r} down {tuple(down.shape)} up {tuple(up.shape)} (weight {out_f}x{in_f})")
            elif r > self.max_rank:
                too_wide.append(f"{m!r} rank {r}")
        if bad:
            raise LoraError(f"LoRA adapter {name!r}: wrong shapes: {'; '.join(sorted(bad)[:5])}",
                            code="lora_modules_unbound")
        if too_wide:
            raise LoraError(f"LoRA adapter {name!r}: rank above --max-lora-rank {self.max_rank}: "
                            f"{'; '.join(sorted(too_wide)[:5])}", code="lora_rank_too_large")
        staged = Staged(name, path)
        for m, (down, up, scale) in factors.items():
            if m not in self.hooks:            # the other branch's module: another engine's
                continue
            key = m + ".weight"
            a = down.float()
            b = up.float() * (scale * strength)
            dim = shard_dim(key)
            if dim == 1:                       # row-parallel: the input features are sharded
                a = shard(a, 1, self.tp)
            elif dim == 0:
                b = shard(b, 0, self.tp)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise LoraError(f"LoRA adapter {name!r}: NaN or Inf in {m!r}")
            staged.factors[m] = (a, b)
        return staged

    # ---- resident set ----------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [i for i, a in enumerate(self.slots) if a is None]

    def install(self, staged: Staged, slot: int | None) -> Adapter:
        """Copy a staged adapter into `slot` (None: it needs none, or the first free one)."""
        if staged.factors and slot is None:
            free = self.free_slots()
            if not free:
                raise self.slots_full()
            slot = free[0]
        self._loads += 1
        adapter = Adapter(staged.name, staged.path, f"lora:{staged.name}#{self._loads}",
                          slot if staged.factors else -1, len(staged.factors), registry=self)
        if staged.factors:
            with torch.no_grad():
                for name, hook in self.hooks.items():
                    hook.a[slot].zero_()
                    hook.b[slot].zero_()
                    if name in staged.factors:
                        a, b = staged.factors[name]
                        hook.a[slot, : a.shape[0]].copy_(a.to(self.device, self.dtype))
                        hook.b[slot, :, : b.shape[1]].copy_(b.to(self.device, self.dtype))
            self.slots[slot] = adapter
        self.retired = {n: a for n, a in self.retired.items()     # their tables are gone (or the name is back)
                        if n != staged.name and (a.slot < 0 or a.slot != slot)}
        self.adapters[staged.name] = adapter
        return adapter

    def slots_full(self) -> LoraError:
        busy = [a.name + (" (unloaded, in use)" if a.retired else "") for a in self.slots if a is not None]
        return LoraError(f"all {self.max_loras} LoRA slots (--max-loras) are taken: {', '.join(busy)}; unload an "
                         "adapter (or wait for the requests of an unloaded one to end)", status=409,
                         code="lora_slots_full")

    def load(self, name: str, path: str, strength: float = 1.0, slot: int | None = None) -> Adapter:
        return self.install(self.stage(name, path, strength), slot)

    def unload(self, name: str) -> Adapter:
        """The name is no longer loaded; its slot is freed once no request holds it. Until a load reuses that slot
        the adapter stays resolvable (`retired`) for requests already under way elsewhere in the stack (an image
        whose prefix understanding computed with it, not yet admitted here): the gateway refuses new ones."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(f"The lora adapter {name!r} cannot be found.")
        adapter.retired = True
        self.retired[name] = adapter
        self._free_if_idle(adapter)
        return adapter

    def acquire(self, name: str) -> Adapter:
        adapter = self.adapters.get(name) or self.retired.get(name)
        if adapter is None:
            raise AdapterNotFound(f"The model {name!r} does not exist (not the served model nor a loaded LoRA "
                                  "adapter: GET /v1/models lists them)")
        if adapter.retired and adapter.slot >= 0:
            self.slots[adapter.slot] = adapter       # held again: no load may take its slot meanwhile
        adapter.refs += 1
        return adapter

    def release(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        adapter.refs -= 1
        self._free_if_idle(adapter)

    def _free_if_idle(self, adapter: Adapter) -> None:
        if adapter.retired and adapter.refs <= 0 and adapter.slot >= 0 and self.slots[adapter.slot] is adapter:
            self.slots[adapter.slot] = None

    def listing(self) -> list[dict]:
        return [{"name": a.name, "path": a.path, "slot": a.slot, "modules": a.modules, "requests": a.refs}
                for a in self.adapters.values()]

    # ---- the weights channel ---------------------------------------------------------------------
    def run(self, op: dict, all_gather) -> dict:
        """One lora op ({"op": "lora_load", "id", "name", "path", "strength"?} | {"op": "lora_unload", "id",
        "name"}) on this rank, agreed with the others: every rank stages and reports; the slot is rank 0's
        first free one (rank 0 holds the request counts). Returns the reply rank 0 sends."""
        t0 = time.perf_counter()
        staged, err = None, None
        try:
            if op["op"] == "lora_load":
                staged = self.stage(op["name"], op["path"], float(op.get("strength", 1.0)))
            elif op["name"] not in self.adapters:
                raise AdapterNotFound(f"The lora adapter {op['name']!r} cannot be found.")
        except Exception as e:
            err = error_reply(e)
        views = all_gather((err, self.free_slots()))
        errors = [e for e, _ in views if e is not None]
        reply: dict = {"id": op["id"], "ok": not errors}
        if errors:
            reply["error"] = errors[0]
        elif op["op"] == "lora_load":
            free = views[0][1]
            if staged.factors and not free:
                reply = {"id": op["id"], "ok": False, "error": error_reply(self.slots_full())}
            else:
                a = self.install(staged, free[0] if staged.factors else None)
                reply.update(name=a.name, slot=a.slot, modules=a.modules)
        else:
            a = self.unload(op["name"])
            reply.update(name=a.name, requests=a.refs)
        reply["seconds"] = time.perf_counter() - t0
        return reply


def acquire_adapter(model, name: str | None) -> Adapter | None:
    """The adapter a request names, held until `Adapter.release` (None: the base weights, also when the model
    serves no adapters: then every `model` name means the base). Raises AdapterNotFound."""
    reg = getattr(model, "lora", None)
    if name is None or reg is None:
        return None
    return reg.acquire(name)


def slot_of(adapter: Adapter | None) -> int:
    return adapter.slot if adapter is not None else -1


def error_reply(exc: BaseException) -> dict:
    if isinstance(exc, LoraError):
        return {"status": exc.status, "message": str(exc), "code": exc.code}
    if isinstance(exc, LoadError):
        return {"status": 400, "message": str(exc), "code": "invalid_lora"}
    return {"status": 500, "message": f"{type(exc).__name__}: {exc}", "code": "lora_error"}


def attach_lora(model, max_loras: int | None = None, max_rank: int | None = None,
                modules: list[tuple[str, str, float]] | None = None) -> LoraRegistry | None:
    """Give `model` its adapter registry (`model.lora`) and load `modules`. None arguments: the environment
    ($U1SERVE_MAX_LORAS, $U1SERVE_MAX_LORA_RANK, $U1SERVE_LORA_MODULES). Off (None) when no slot is asked
    for and no module given."""
    if modules is None:
        modules = parse_modules(knobs.LORA_MODULES.get())
    if max_loras is None:
        max_loras = knobs.MAX_LORAS.get()
        if max_loras is None:
            max_loras = max(DEFAULT_MAX_LORAS, len(modules)) if modules else 0
    if max_loras <= 0:
        if modules:
            raise LoadError(f"{len(modules)} LoRA module(s) given with max_loras 0")
        return None
    if max_rank is None:
        max_rank = knobs.MAX_LORA_RANK.get(default=DEFAULT_MAX_RANK)
    reg = LoraRegistry(model, max_loras, max_rank)
    for name, path, strength in modules:
        reg.load(name, path, strength)
    model.lora = reg
    return reg
