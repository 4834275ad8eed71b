"""`u1serve convert SRC DST --to fp8|int8|gguf[:TYPE]|gguf:TYPE:LAYERS,...`: a float safetensors checkpoint (official schema) as a
quantised one that the server loads without requantising.

- fp8 / int8: safetensors with the dense Linear layers of both branches (understanding `X` and generation
  `X_mot_gen`, each with its own per-output-channel scales) as `X.weight` (e4m3 / int8) + `X.weight_scale`
  (fp32 [out, 1]), computed by the same quantiser the server runs at load (so serving a converted checkpoint
  gives the bits of `--quantization` on the float one), and config.json's `quantization_config`
  (compressed-tensors, services/model/quant_checkpoint.py). Other tensors are copied bit for bit.
- gguf[:q8_0|q4_k]: services/model/gguf_io.py (dequantised at load); gguf:TYPE:LAYERS,... a per-layer mix
  (`gguf:q8_0:0-17,q4_k:18-`: 8-bit for the first layers, 4-bit after; unnamed layers stay in the source precision).
The other files of SRC (tokenizer, ...) are copied.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Iterable

from services.base.checkpoint_names import INDEX_FILE

from .quant_checkpoint import SCALE_SUFFIX, is_target, quantization_config

FORMATS = ("fp8", "int8", "gguf")


class ConvertError(ValueError):
    """The source cannot be converted as asked; the message says why."""


# How a conversion reports its progress: it hands over the shard paths it will write and a description, and
# iterates what it gets back. The model layer draws nothing; `u1serve convert` passes its progress bar.
Progress = Callable[[Iterable[str], str], Iterable[str]]


def quietly(shards: Iterable[str], desc: str) -> Iterable[str]:
    """The default Progress: the shards as they are, nothing shown."""
    return shards


def parse_target(to: str):
    """"fp8" | "int8" | "gguf[:TYPE]" | "gguf:TYPE:LAYERS[,TYPE:LAYERS...]" -> (format, gguf_io.LayerTypes or
    None)."""
    fmt, _, typ = (to or "").strip().lower().partition(":")
    if fmt not in FORMATS or (typ and fmt != "gguf"):
        raise ConvertError(f"--to must be fp8, int8, gguf[:TYPE] or gguf:TYPE:LAYERS,..., got {to!r}")
    if fmt == "gguf":
        from .gguf_io import GGUFError, parse_layer_types
        try:
            return fmt, parse_layer_types(typ)
        except GGUFError as e:
            raise ConvertError(str(e)) from None
    return fmt, None


def convert_checkpoint(src: str, dst: str, to: str, progress: Progress = quietly) -> str:
    fmt, gguf_type = parse_target(to)
    from .checkpoint_files import LoadError, weight_map
    try:
        wm = weight_map(src)
    except LoadError as e:
        raise ConvertError(f"{src}: {e}") from None
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ConvertError(f"{src} is already quantised (config.json has quantization_config): convert from the "
                           f"float checkpoint")
    if os.path.exists(dst) and os.listdir(dst):
        raise ConvertError(f"{dst} exists and is not empty")
    os.makedirs(dst, exist_ok=True)
    if fmt == "gguf":
        from .gguf_io import GGUFError, write_gguf
        try:
            write_gguf(src, dst, gguf_type, progress)
        except GGUFError as e:
            raise ConvertError(str(e)) from None
    else:
        ignore = _write_quantized(wm, dst, fmt, progress)
        config["quantization_config"] = quantization_config(fmt, ignore)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if (os.path.isfile(path) and not name.endswith(".safetensors") and name != INDEX_FILE
                and not os.path.exists(os.path.join(dst, name))):
            shutil.copy(path, os.path.join(dst, name))
    return dst


def _write_quantized(wm: dict[str, str], dst: str, scheme: str, progress: Progress) -> list[str]:
    """Each shard of `wm` rewritten into `dst` with its targets quantised. Returns the targets left in float
    (dims not multiples of 16, as the loader's policy leaves them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .loader import QUANT_DTYPES
    from .quant_schemes import scheme as quant_scheme
    quantize_rows = quant_scheme(scheme).linear.quantize_rows
    new_map, ignore = {}, []
    for path in progress(sorted(set(wm.values())), f"convert to {scheme}"):
        out = {}
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.dtype in QUANT_DTYPES:
                    raise ConvertError(f"tensor {key!r} is already {t.dtype}: convert from the float checkpoint")
                module = key[: -len(".weight")]
                if key.endswith(".weight") and t.dim() == 2 and is_target(module):
                    if t.shape[0] % 16 or t.shape[1] % 16:
                        ignore.append(module)
                    else:
                        q, s = quantize_rows(t.float())
                        out[key], out[module + SCALE_SUFFIX] = q, s.reshape(-1, 1).contiguous()
                        continue
                out[key] = t
        name = os.path.basename(path)
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        new_map.update({k: name for k in out})
    total = sum(os.path.getsize(os.path.join(dst, n)) for n in set(new_map.values()))
    with open(os.path.join(dst, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": new_map}, f, indent=2)
    return ignore

