"""Weight streaming: a list of layers whose tensors live in (pinned) host memory, each brought to the device into one
of K fixed slots just before its forward, the next ones prefetched on a side stream while it computes.

Why: on a 24 GiB card the generation branch's decoder layers (7.7 GiB in int8 for the 8B model) leave too little
room for the activations of a 2048² step; a step there computes longer (~0.3 s) than copying every layer over PCIe
(~0.15 s), so the copies can hide behind compute (issue 42; bench/bench_weight_streaming.py measures it).

How (every parameter and buffer of a layer, whatever its format: bf16 Linear, int8 W8A8 buffers and scales, norms):
- at rest each layer's tensors ARE its host copies (the module's parameters point at them), so anything reading or
  updating the weights between forwards (the live weight update's in-place copies, state dicts) sees the one true
  copy; `invalidate()` forgets what the slots hold after such an update;
- K slots on the device, each shaped like one layer (the streamed layers must share one layout);
- a forward pre-hook makes sure the layer is in a slot (loads it now where no prefetch did: a forward that stopped
  early and restarts at layer 0, an out-of-order call), makes the compute stream wait for the copy's event, points
  the layer's tensors at the slot, then starts copying the next K-1 layers (wrapping to layer 0 for the next
  forward) on the side stream into the slots no wanted layer holds;
- a forward post-hook records an event on the compute stream: the side stream waits on it before it overwrites that
  slot, so a slot is reused only after the kernels that read it; the layer's tensors point back at the host copies.
On the CPU the same code runs with plain host memory and synchronous copies into the slot tensors.

Why our own (checked 2026-12-06; none of these is a dependency here): accelerate's `cpu_offload` (AlignDevicesHook)
copies a module's weights to the device in its pre-forward hook on the current stream (non_blocking since its PR 607)
and drops them after: no prefetch, no side stream. diffusers' group offloading (`apply_group_offloading`, block level,
`use_stream=True`) does prefetch the next group on a side stream, but into fresh allocations each onload (kept alive
with `record_stream`), chained in the order its first forward ran the groups (as we read it): a forward that stops
after layer 0 (our step cache) does not follow one fixed order. vLLM's prefetch offloader (static buffers, event-forked copy stream) lives inside
vLLM's model executor. torch itself offloads weights only in FSDP2 (CPUOffloadPolicy: sharded, all-gathers per
module); `save_on_cpu` is for activations. What we need is small: a fixed ring of K slots (no allocation per step,
so the memory plan's K x one layer is exact), prefetch driven by the layer index (any order, early stops, restarts),
and the layers pointing at their host copies at rest (live weight updates copy into them).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass
class _Ref:
    """One tensor of a layer: the module holding it, its attribute name, and whether it is a parameter."""
    module: nn.Module
    name: str
    param: bool

    def point(self, tensor: torch.Tensor) -> None:
        if self.param:
            self.module._parameters[self.name].data = tensor
        else:
            self.module._buffers[self.name] = tensor

    def get(self) -> torch.Tensor:
        return (self.module._parameters if self.param else self.module._buffers)[self.name]


def layer_refs(layer: nn.Module) -> list[_Ref]:
    """Every parameter and buffer of the layer (None buffers skipped), in a fixed order."""
    refs = []
    for _, mod in layer.named_modules():
        refs += [_Ref(mod, n, True) for n, p in mod._parameters.items() if p is not None]
        refs += [_Ref(mod, n, False) for n, b in mod._buffers.items() if b is not None]
    return refs


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """`t` in host memory (pinned with `pin`, so copies from it run asynchronously); itself where it already is."""
    t = t.detach()
    if t.device.type == "cpu" and (t.is_pinned() or not pin):
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    h.copy_(t)
    return h


def layer_to_host(layer: nn.Module, pin: bool) -> list[torch.Tensor]:
    """Point every tensor of the layer at a host copy (the loader calls it as each layer completes, so the device
    never holds more than one layer of the streamed ones). Returns the host tensors in layer_refs' order."""
    out = []
    for r in layer_refs(layer):
        h = host_copy(r.get(), pin)
        r.point(h)
        out.append(h)
    return out


def layout(refs: list[_Ref]) -> list[tuple]:
    return [(r.name, tuple(r.get().shape), r.get().dtype) for r in refs]


class WeightStreamer:
    """Streams `layers` (all of one layout) through `slots` device slots. `device`: where the layers compute."""

    def __init__(self, layers: Sequence[nn.Module], slots: int, device: torch.device | str):
        if slots < 1:
            raise ValueError(f"weight streaming needs at least 1 device slot, got {slots}")
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("weight streaming: no layers to stream")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.refs = [layer_refs(layer) for layer in self.layers]
        shape = layout(self.refs[0])
        for i, refs in enumerate(self.refs[1:], 1):
            if layout(refs) != shape:
                raise ValueError(f"weight streaming needs every decoder layer in one layout (one format): layer {i} "
                                 f"differs from layer 0 (a per-layer format mix cannot share device slots)")
        self.slots_n = min(slots, len(self.layers))
        self.host = [layer_to_host(layer, self.cuda) for layer in self.layers]   # the layers now point at these
        if self.cuda:
            torch.cuda.empty_cache()             # the device copies are gone: give their memory back
        first = self.host[0]
        self.slots = [[torch.empty_like(t, device=self.device) for t in first] for _ in range(self.slots_n)]
        self.owner: list[int | None] = [None] * self.slots_n     # the layer each slot holds
        self.used = [0] * self.slots_n                           # when each slot was last wanted (LRU)
        self.clock = 0
        self.active: tuple[int, int] | None = None               # (layer, slot) between its pre- and post-hook
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready = [torch.cuda.Event() if self.cuda else None for _ in range(self.slots_n)]
        self.free = [None] * self.slots_n                        # the last compute use's event, per slot
        self.loads = {"prefetched": 0, "on_demand": 0}
        self.handles = []
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, args, i=i: self.before(i)))
            self.handles.append(layer.register_forward_hook(lambda m, args, out, i=i: self.after(i)))

    # -- the hooks -------------------------------------------------------------------------------
    def before(self, i: int) -> None:
        if self.active is not None:       # the last forward raised between the hooks: that layer is done
            self.after(self.active[0])
        slot = self._slot_of(i)
        if slot is None:
            slot = self._load(i, keep={i})
            self.loads["on_demand"] += 1
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        for r, t in zip(self.refs[i], self.slots[slot]):
            r.point(t)
        self.active = (i, slot)
        self._touch(slot)
        ahead = [(i + d) % len(self.layers) for d in range(1, self.slots_n)]
        keep = {i, *ahead}
        for j in ahead:
            if self._slot_of(j) is None and self._load(j, keep) is not None:
                self.loads["prefetched"] += 1

    def after(self, i: int) -> None:
        if self.active is None or self.active[0] != i:
            return
        _, slot = self.active
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.free[slot] = ev
        for r, t in zip(self.refs[i], self.host[i]):
            r.point(t)
        self.active = None

    # -- the slots -------------------------------------------------------------------------------
    def _slot_of(self, i: int) -> int | None:
        return next((s for s, o in enumerate(self.owner) if o == i), None)

    def _touch(self, slot: int) -> None:
        self.clock += 1
        self.used[slot] = self.clock

    def _load(self, i: int, keep: set) -> int | None:
        """Copy layer i into the least recently used slot that holds no layer of `keep` and is not computing (None:
        no such slot)."""
        busy = self.active[1] if self.active is not None else None
        free = [s for s in range(self.slots_n) if s != busy and self.owner[s] not in keep]
        if not free:
            return None
        slot = min(free, key=lambda s: self.used[s])
        self.owner[slot] = i
        self._touch(slot)
        if not self.cuda:
            for d, h in zip(self.slots[slot], self.host[i]):
                d.copy_(h)
            return slot
        with torch.cuda.stream(self.stream):
            if self.free[slot] is not None:
                self.stream.wait_event(self.free[slot])    # the slot's last reader has finished
            for d, h in zip(self.slots[slot], self.host[i]):
                d.copy_(h, non_blocking=True)
            self.ready[slot].record(self.stream)
        return slot

    # -- outside the forwards --------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, i: int):
        """Layer i on the device for work outside a forward (the start-up GEMM check of its shapes)."""
        self.before(i)
        try:
            yield self.layers[i]
        finally:
            self.after(i)

    def invalidate(self) -> None:
        """The host copies changed (a weight update): every layer is copied again when next wanted. The side stream
        copies in order, so a stale copy still in flight finishes before any new one into its slot."""
        self.owner = [None] * self.slots_n

    def detach(self) -> None:
        """Remove the hooks and bring every layer back to the device (resident again)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for refs, host in zip(self.refs, self.host):
            for r, h in zip(refs, host):
                r.point(h.to(self.device))
        self.slots, self.host = [], []

    def report(self) -> dict:
        """What /health and the plan's test read: slots, bytes on each side, how the loads went."""
        one = sum(t.numel() * t.element_size() for t in self.host[0]) if self.host else 0
        return {"layers": len(self.layers), "device_slots": self.slots_n, "layer_bytes": one,
                "device_bytes": one * self.slots_n, "host_bytes": one * len(self.layers),
                "pinned": self.cuda, "loads": dict(self.loads)}


def stream_decoder_layers(model, slots: int) -> WeightStreamer:
    """Stream the model's decoder layers through `slots` device slots; embeddings, norms and heads stay resident
    (their device is the model's). The layers may be on the host already (load_model(layers_to_host=True)). The
    streamer is kept on the model (`model.weight_streamer`) for the weight-update path."""
    streamer = WeightStreamer(model.language_model.model.layers, slots, model.device)
    model.weight_streamer = streamer
    return streamer
