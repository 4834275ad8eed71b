"""Quantise while loading: each decoder layer is assigned, merged with its LoRAs and quantised as soon as its last
weight is in place, so the device holds the quantised weights plus at most ONE layer's float weights of the layers
being quantised (issue 42: `--quantization int8` from a bf16 checkpoint under a 24 GiB cap ran out of memory when
every float weight came onto the GPU before quantize_model ran).

Same tensors, same swap (quant.quantize_layer is quantize_model's, layer by layer), same LoRA merge per weight: the
quantised weights are bit-identical to quantising after the whole load (tests/model/test_layerwise_load.py).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

LAYER_PREFIX = "language_model.model.layers."


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter or checkpoint key belongs to (None: outside the decoder layers)."""
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])


class LayerwiseQuantizer:
    """Told each weight as it is placed (`placed(name, state)`: `state` {param name: tensor} holds the placed weights
    not yet in the model), it moves a complete layer's weights into the model, merges the LoRAs into them (`merge`:
    {checkpoint key: tensor} -> None) and quantises it (`scheme` None: keeps it as it is), then hands it to `done(layer)`
    (weight streaming: moves it to host memory). `names`: every name that will be placed."""

    def __init__(self, model, names, branches, scheme, device, prequantized: dict | None = None,
                 merge: Callable[[dict], None] | None = None, done: Callable | None = None):
        from .quant_schemes import scheme as scheme_by_name
        self.model, self.branches, self.done = model, branches, done
        self.scheme = scheme_by_name(scheme) if isinstance(scheme, str) else scheme
        self.policy = self.scheme.policy(torch.device(device)) if self.scheme is not None else None
        self.prequantized, self.merge = {} if prequantized is None else prequantized, merge
        self.pending = Counter(i for i in map(layer_of, names) if i is not None)
        self.quantized = 0          # Linear layers now running quantised

    def placed(self, name: str, state: dict) -> None:
        i = layer_of(name)
        if i is None:
            return
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._finish_layer(i, state)

    def _finish_layer(self, i: int, state: dict) -> None:
        from .moe import checkpoint_views
        from .quant import quantize_layer
        prefix = f"{LAYER_PREFIX}{i}."
        layer = self.model.language_model.model.layers[i]
        mine = {k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
        _assign(layer, mine, prefix)
        mine.clear()        # the layer holds them now: quantising frees each float weight it replaces
        unset = [n for n, p in layer.named_parameters() if p.is_meta]
        if unset:
            raise RuntimeError(f"layer {i} is complete but {prefix}{unset[0]} was never placed")
        if self.merge is not None:
            self.merge(dict(checkpoint_views((prefix + n, p) for n, p in layer.named_parameters())))
        if self.scheme is not None:
            self.quantized += quantize_layer(layer, i, self.branches, self.prequantized, self.policy, self.scheme)
        for k in [k for k in self.prequantized if k.startswith(prefix)]:
            del self.prequantized[k]     # now the layer's own buffers
        if self.done is not None:
            self.done(layer)

    def finish(self, state: dict) -> None:
        """Assign the weights outside the decoder layers; every parameter of the model must be placed by now."""
        left = [i for i, n in self.pending.items() if n]
        if left:
            raise RuntimeError(f"decoder layer {left[0]} is missing weights")
        _assign(self.model, state)
        state.clear()
        unset = [n for n, p in self.model.named_parameters() if p.is_meta]
        if unset:
            raise RuntimeError(f"{unset[0]} was never placed")


def _assign(module, state: dict, prefix: str = "") -> None:
    unexpected = module.load_state_dict(state, strict=False, assign=True).unexpected_keys
    if unexpected:
        raise RuntimeError(f"{prefix}{unexpected[0]} is no parameter of the model")
