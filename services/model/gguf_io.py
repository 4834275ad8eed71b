"""GGUF checkpoints (the `gguf` package, optional extra `u1serve[gguf]`): written by `u1serve convert --to
gguf[:TYPE]`, dequantised to the serving dtype at load.

Layout of a converted checkpoint: a directory with `model.gguf`, `config.json` and the tokenizer files. In the
GGUF file:
- tensor names are the official safetensors keys, one to one (`language_model.model.layers.3.self_attn.
  q_proj_mot_gen.weight`, ...): the GGUF name convention (`blk.N.attn_q.weight`) is llama.cpp's per-architecture
  table, and no llama.cpp architecture describes this model (two weight copies per layer, the fm head), so
  nothing would read renamed tensors; names longer than ggml's 64-byte limit are therefore fine here.
- metadata: `general.architecture` = "neo_chat" (config.json's model_type), `u1serve.config_json` = the whole
  config.json (the file is self-describing), `u1serve.gguf_type` = the requested type (or per-layer mix).
- a per-layer mix (`--to gguf:q8_0:0-17,q4_k:18-`, LayerTypes) gives each decoder layer's targets their own type
  (a layer no range names, or named `bf16`, keeps the source precision); the loader needs nothing new, it
  dequantises tensor by tensor whatever each one's type.
- which tensors are quantised: the dense Linear layers of both branches, the same policy as fp8 / int8
  (`quant_checkpoint.is_target`: q/k/v/o and dense gate/up/down, understanding and `_mot_gen` each with its
  own block scales); everything else (embeddings, norms, the fm head, MoE experts and routers, the vision and
  time embedders) keeps its source precision (BF16 / F16 / F32 GGUF tensors, bit-exact).
- a target whose rows are not a multiple of the type's block (Q4_K: 256, Q8_0: 32) is stored as rows of
  exactly one block's width when its element count allows (its blocks then span output channels; the
  loader reshapes by the config's geometry), else in the fallback type (Q8_0, then its source precision):
  the 8B geometry (4096 / 12288 wide) never needs either; the tiny test model (64 / 128 wide) does.

Why dequantise on load (to the serving dtype) rather than in-kernel: the served GEMMs then stay the bf16 (or
fp8 / int8, `--quantization`) ones, exact and fast at the row counts generation runs (thousands of image
tokens per step: compute-bound, where a dequantising GEMM saves nothing); the cost is memory: GPU weight memory
equals bf16's (disk and download are what shrink: Q8_0 ~53%, Q4_K ~28% of bf16 for the quantised layers).
In-kernel dequantisation pays off for memory-bound decode on small GPUs, which is not this server's target.
Q4_K has no quantiser in the gguf package (it only dequantises K-quants): `quantize_q4_k` is ours (min-max
sub-block scales refined by least squares, then the 6-bit scale/min packing); its bytes are read back by
gguf's own dequantiser.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

GGUF_FILE = "model.gguf"
ARCH = "neo_chat"
CONFIG_KEY = "u1serve.config_json"
TYPE_KEY = "u1serve.gguf_type"
DEFAULT_TYPE = "q8_0"
QK_K = 256


class GGUFError(ValueError):
    """A GGUF file or type this server does not read or write; the message names it."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF checkpoints need the gguf package: pip install 'u1serve[gguf]'") from None
    return gguf


def write_types() -> dict:
    """Type name (`--to gguf:NAME`) -> GGMLQuantizationType."""
    T = _gguf().GGMLQuantizationType
    return {"q8_0": T.Q8_0, "q4_k": T.Q4_K}


def read_types() -> set:
    """The GGUF tensor types the loader dequantises (what convert writes, plus F16)."""
    T = _gguf().GGMLQuantizationType
    return {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K}


def parse_type(name: str) -> str:
    name = (name or DEFAULT_TYPE).lower()
    types = write_types()
    if name not in types:
        raise GGUFError(f"unsupported GGUF type {name!r}: u1serve writes {', '.join(sorted(types))}")
    return name


SOURCE = "bf16"       # in a per-layer mix: the layer keeps the source precision


@dataclass(frozen=True)
class LayerTypes:
    """The GGUF type of each decoder layer's quantised Linear layers (both branches): one type for every layer
    (`--to gguf:q4_k`) or a per-layer mix (`--to gguf:q8_0:0-17,q4_k:18-`: TYPE:RANGE items, RANGE `a-b`, `a-`
    or `a`; a layer no range names keeps the source precision, as does TYPE bf16)."""
    ranges: tuple = ()                 # (first, last or None, type)
    default: str | None = None         # the type of the layers no range names (None: source precision)

    def type_for(self, layer: int) -> str | None:
        for first, last, typ in self.ranges:
            if first <= layer and (last is None or layer <= last):
                return None if typ == SOURCE else typ
        return self.default

    def per_layer(self, num_layers: int) -> dict[int, str]:
        """{layer: type} (SOURCE for the source precision), what memory_plan prices a file by."""
        return {i: self.type_for(i) or SOURCE for i in range(num_layers)}

    @property
    def text(self) -> str:
        if not self.ranges:
            return self.default or SOURCE
        return ",".join(f"{t}:{a}-{'' if b is None else b}" for a, b, t in self.ranges)


def parse_layer_types(text: str) -> LayerTypes:
    """`q8_0` | `q4_k` | `TYPE:RANGE[,TYPE:RANGE...]` (LayerTypes) -> LayerTypes; GGUFError names what is wrong."""
    text = (text or "").strip().lower()
    if ":" not in text:
        return LayerTypes(default=parse_type(text))
    ranges = []
    for item in text.split(","):
        typ, _, span = item.strip().partition(":")
        if typ != SOURCE:
            parse_type(typ)
        first, dash, last = span.partition("-")
        try:
            a = int(first)
            b = (int(last) if last else None) if dash else a
        except ValueError:
            raise GGUFError(f"layer range {span!r} of {item!r}: write TYPE:FIRST-LAST, TYPE:FIRST- or TYPE:N") from None
        if a < 0 or (b is not None and b < a):
            raise GGUFError(f"layer range {span!r} of {item!r} is empty or negative")
        end = float("inf") if b is None else b
        for a2, b2, _ in ranges:
            if a <= (float("inf") if b2 is None else b2) and a2 <= end:
                raise GGUFError(f"layer range {span!r} overlaps another one in {text!r}")
        ranges.append((a, b, typ))
    return LayerTypes(tuple(ranges), None)


# ----------------------------------------------------------------------------- Q4_K
def quantize_q4_k(x, device=None) -> np.ndarray:
    """x float32 [rows, 256 k] -> Q4_K blocks uint8 [rows, 144 k] (ggml's block_q4_K: f16 d, f16 dmin, 12 bytes of
    6-bit sub-block scales and mins, 128 bytes of 4-bit values; value = d * sc_j * q - dmin * m_j). Torch ops
    (multi-threaded; on `device`, e.g. a GPU, when given): an 8B checkpoint's ~17 G weights in minutes."""
    t = torch.as_tensor(x, dtype=torch.float32, device=device)
    rows = t.shape[0]
    b = t.reshape(-1, 8, 32)                                  # super-blocks x 8 sub-blocks x 32
    lo, hi = b.amin(-1).clamp_max(0.0), b.amax(-1)
    scale, mn = (hi - lo) / 15.0, -lo
    for _ in range(3):                                        # least-squares refit of (scale, min) given q
        q = _q4(b, scale, mn)
        sq, sqq, sx, sqx = q.sum(-1), (q * q).sum(-1), b.sum(-1), (q * b).sum(-1)
        det = 32.0 * sqq - sq * sq
        s_new, m_new = (32.0 * sqx - sq * sx) / det, -(sqq * sx - sq * sqx) / det
        ok = (det > 0) & (s_new > 0)
        with_min, no_min = ok & (m_new >= 0), ok & (m_new < 0) & (sqq > 0)
        scale = torch.where(with_min, s_new, torch.where(no_min, sqx / sqq, scale))
        mn = torch.where(with_min, m_new, torch.where(no_min, torch.zeros_like(mn), mn))
    d, dmin = (scale.amax(-1) / 63.0).half(), (mn.amax(-1) / 63.0).half()
    df, dminf = d.float()[:, None], dmin.float()[:, None]
    sc = torch.where(df > 0, (scale / df).round().clamp(0, 63), 0.0).to(torch.uint8)
    m = torch.where(dminf > 0, (mn / dminf).round().clamp(0, 63), 0.0).to(torch.uint8)
    q = _q4(b, df * sc, dminf * m).to(torch.uint8)            # with the scales as stored
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], dim=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)   # chunk c: sub-block 2c low nibble, 2c+1 high
    out = torch.cat([d.reshape(-1, 1).view(torch.uint8), dmin.reshape(-1, 1).view(torch.uint8), scales, qs], 1)
    return out.reshape(rows, -1).cpu().numpy()


def _q4(b: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    q = ((b + mn[..., None]) / scale[..., None]).round()
    return torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0).clamp(0, 15)


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    gguf = _gguf()
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(x, "cuda" if torch.cuda.is_available() else None)   # a GPU when there is one
    return gguf.quants.quantize(x, qtype)


# ----------------------------------------------------------------------------- write
def _source_type(t: torch.Tensor):
    T = _gguf().GGMLQuantizationType
    types = {torch.bfloat16: T.BF16, torch.float16: T.F16, torch.float32: T.F32}
    if t.dtype not in types:
        raise GGUFError(f"cannot write a {t.dtype} tensor to GGUF: convert from a float checkpoint")
    return types[t.dtype]


def _encode(t: torch.Tensor, qtype) -> tuple[np.ndarray, object]:
    """(array for GGUFWriter.add_tensor, its GGUF type): `qtype` (rows reshaped to one block if needed) or
    the fallback (module doc)."""
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    if qtype is not None:
        for typ in (qtype, T.Q8_0):
            block = gguf.GGML_QUANT_SIZES[typ][0]
            x = t.float().numpy().reshape(t.shape[0], -1)
            if x.shape[1] % block and x.size % block == 0:
                x = x.reshape(-1, block)
            if x.shape[1] % block == 0:
                return quantize(x, typ), typ
    typ = _source_type(t)
    if typ == T.BF16:
        return t.view(torch.int16).numpy().view(np.uint8).reshape(t.shape[0], -1), typ
    return t.numpy(), typ


def write_gguf(src_dir: str, out_dir: str, types: LayerTypes | str = DEFAULT_TYPE, progress=None) -> str:
    """The checkpoint at `src_dir` (safetensors, official schema) as `out_dir/model.gguf` (+ config.json and the
    tokenizer files copied), its targets in `types` (a LayerTypes or its text); `progress` as convert.Progress
    (None: nothing shown). Returns out_dir."""
    from safetensors import safe_open

    from .checkpoint_files import weight_map
    from .quant_checkpoint import is_target
    gguf = _gguf()
    types = types if isinstance(types, LayerTypes) else parse_layer_types(types)
    by_name = write_types()
    with open(os.path.join(src_dir, "config.json")) as f:
        config_text = f.read()
    num_layers = int(json.loads(config_text)["llm_config"]["num_hidden_layers"])
    past = [a for a, _, _ in types.ranges if a >= num_layers]
    if past:
        raise GGUFError(f"layer range from {past[0]} in {types.text!r}: the model has layers 0-{num_layers - 1}")
    os.makedirs(out_dir, exist_ok=True)
    # use_temp_file: each tensor's bytes go to a (spilling) temp file as it is encoded, so an 8B checkpoint
    # converts without holding the whole file in memory
    w = gguf.GGUFWriter(os.path.join(out_dir, GGUF_FILE), ARCH, use_temp_file=True)
    w.add_name(os.path.basename(os.path.normpath(src_dir)))
    w.add_string(CONFIG_KEY, config_text)
    w.add_string(TYPE_KEY, types.text)
    wm = weight_map(src_dir)
    shards = sorted(set(wm.values()))
    for path in progress(shards, f"convert to gguf:{types.text}") if progress else shards:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key)
                target = key.endswith(".weight") and t.dim() == 2 and is_target(key[: -len(".weight")])
                name = types.type_for(int(key.split(".")[3])) if target else None   # targets: layers.N.*
                data, typ = _encode(t, by_name[name] if name else None)
                w.add_tensor(key, data, raw_dtype=typ)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_dir


# ----------------------------------------------------------------------------- read
def find_gguf(model_dir: str) -> str | None:
    """The directory's GGUF file, None when it has none."""
    if not os.path.isdir(model_dir):
        return None
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".gguf"))
    if not names:
        return None
    from .checkpoint_files import LoadError
    if len(names) > 1:
        raise LoadError(f"{model_dir} holds several GGUF files ({', '.join(names)}); keep one")
    if any(n.endswith(".safetensors") for n in os.listdir(model_dir)):
        raise LoadError(f"{model_dir} holds both {names[0]} and safetensors files: which checkpoint is meant?")
    return os.path.join(model_dir, names[0])


def read_gguf_state(path: str, needed: dict, full_shapes: dict, tp, device, dtype: torch.dtype) -> dict:
    """{key: tensor in `dtype` on `device` (this TP rank's shard)} for every key of `needed`, dequantised.
    Raises LoadError for a missing / unexpected / misshapen tensor or a tensor type outside `read_types`."""
    from .checkpoint_files import LoadError
    from .parallel import shard, shard_dim
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise LoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    unexpected = sorted(set(tensors) - set(full_shapes))
    if unexpected:
        raise LoadError(f"unexpected tensor {unexpected[0]!r} in {path}"
                        + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = sorted(k for k in needed if k not in tensors)
    if missing:
        raise LoadError(f"missing tensor {missing[0]!r} in {path}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    ok = read_types()
    bad = sorted((k, tensors[k].tensor_type.name) for k in needed if tensors[k].tensor_type not in ok)
    if bad:
        raise LoadError(f"tensor {bad[0][0]!r} in {path} is GGUF type {bad[0][1]}, which u1serve does not read "
                        f"(it reads {', '.join(sorted(t.name for t in ok))}; convert with `u1serve convert "
                        f"--to gguf:q8_0` or `gguf:q4_k`)")
    state = {}
    for key in needed:
        t = tensors[key]
        x = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
        want = full_shapes[key]
        if x.numel() != want.numel():
            raise LoadError(f"tensor {key!r} in {path} has {x.numel()} values, expected shape {tuple(want)}")
        x = shard(x.reshape(want), shard_dim(key), tp)
        state[key] = x.to(device=device, dtype=dtype)
    return state
