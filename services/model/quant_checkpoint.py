"""What a quantised safetensors checkpoint declares: config.json's `quantization_config` (one declaration,
read by the loader and written by `u1serve convert`).

The convention is compressed-tensors' (the format llm-compressor writes and vLLM / transformers read) for
W8A8 with per-channel weights and dynamic per-token activations, which is exactly our scheme:
  "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized" | "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": [TARGET_REGEX],
        "weights": {"num_bits": 8, "type": "float" | "int", "symmetric": true, "strategy": "channel",
                    "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float" | "int", "symmetric": true, "strategy": "token",
                              "dynamic": true}}},
    "ignore": [module names matched by the targets but left unquantised (dims not multiples of 16)]}
Tensors: `X.weight` (float8_e4m3fn or int8, [out, in]) and `X.weight_scale` (fp32, [out, 1]); each branch's
layer (understanding `X`, generation `X_mot_gen`) has its own scales. The targets are the dense Linear layers
of both branches that `quant.quantize_model` swaps (attention q/k/v/o, dense MLP gate/up/down); MoE experts
and routers, embedders, heads are never targets.
"""
from __future__ import annotations

import re

import torch

SCALE_SUFFIX = ".weight_scale"
TARGET_REGEX = (r"re:^language_model\.model\.layers\.\d+\."
                r"(self_attn\.[qkvo]_proj(_mot_gen)?|mlp(_mot_gen)?\.(gate|up|down)_proj)$")
SCHEME_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_TYPES = {"fp8": ("float", "float-quantized"), "int8": ("int", "int-quantized")}


class QuantConfigError(ValueError):
    """config.json's quantization_config is not one this server reads, or disagrees with the tensors."""


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    kind, fmt = _TYPES[scheme]
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": [TARGET_REGEX],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token",
                                  "dynamic": True}}},
        "ignore": sorted(ignore),
    }


def checkpoint_scheme(raw_config: dict) -> str | None:
    """"fp8" / "int8" for a config declaring our scheme, None for an unquantised one; QuantConfigError for any
    other quantization_config (named, so the user knows what the server does not read)."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise QuantConfigError(f"config.json quantization_config: quant_method {method!r} is not supported "
                               f"(u1serve reads compressed-tensors W8A8 checkpoints written by `u1serve convert`)")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantConfigError(f"config.json quantization_config: expected one config group, got {len(groups)}")
    g = groups[0]
    w, a = g.get("weights") or {}, g.get("input_activations") or {}
    for scheme, (kind, fmt) in _TYPES.items():
        want_w = {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True}
        want_a = {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True}
        if w.get("type") == kind:
            bad = [f"weights.{k}={w.get(k)!r}" for k, v in want_w.items() if w.get(k) != v]
            bad += [f"input_activations.{k}={a.get(k)!r}" for k, v in want_a.items() if a.get(k) != v]
            if bad or g.get("targets") != [TARGET_REGEX]:
                raise QuantConfigError(
                    f"config.json quantization_config: {', '.join(bad) or 'targets ' + repr(g.get('targets'))} "
                    f"is not u1serve's {scheme} W8A8 scheme (per-channel weights, dynamic per-token activations, "
                    f"the dense Linear layers of both branches)")
            return scheme
    raise QuantConfigError(f"config.json quantization_config: weights type {w.get('type')!r} is not supported "
                           f"(float: fp8, int: int8)")


def is_target(module: str, ignore=()) -> bool:
    """Whether a module name (a checkpoint key without `.weight`) is quantised in such a checkpoint."""
    return re.match(TARGET_REGEX[3:], module) is not None and module not in ignore


def check_tensors(raw_config: dict, quantized: dict[str, torch.dtype], weight_keys) -> str | None:
    """The checkpoint's scheme after checking config and tensors agree: `quantized` {key: dtype} of every
    fp8 / int8 weight, `weight_keys` every `.weight` key. Raises QuantConfigError naming the first disagreement."""
    scheme = checkpoint_scheme(raw_config)
    if scheme is None:
        if quantized:
            key, dt = sorted(quantized.items())[0]
            raise QuantConfigError(f"tensor {key!r} is {dt} but config.json declares no quantization_config "
                                   f"(convert the checkpoint with `u1serve convert`, which writes both)")
        return None
    ignore = set(raw_config["quantization_config"].get("ignore") or ())
    want = SCHEME_DTYPES[scheme]
    for key in sorted(weight_keys):
        module = key[: -len(".weight")]
        target = is_target(module, ignore)
        dt = quantized.get(key)
        if target and dt != want:
            raise QuantConfigError(f"config.json declares {scheme} for {module!r} but its weight is "
                                   f"{dt or 'not quantised'}")
        if not target and dt is not None:
            raise QuantConfigError(f"tensor {key!r} is {dt} but config.json's quantization_config does not "
                                   f"target {module!r}")
    return scheme
