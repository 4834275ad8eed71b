"""Load official safetensors checkpoints (sharded or single file) for one branch, plus LoRA merge.

Tensors are read memory-mapped and go straight to the target dtype/device (and TP shard); the model is
built on the meta device first, so nothing is allocated twice.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import torch

from services.base import knobs

from .checkpoint_files import FP8_SCALE_SUFFIX, LoadError, open_safetensors, weight_map
from .config import NeoConfig, load_config
from .fused_rows import fuse_projections
from .layerwise_load import LayerwiseQuantizer, layer_of
from .lora_spec import parse_lora_spec
from .model import BRANCHES, NeoModel
from .moe import checkpoint_views, expert_view, stacked_slot
from .parallel import TPContext, shard, shard_dim
from .quant_checkpoint import SCHEME_DTYPES
from .skeleton import skeleton

FP8_DTYPE = torch.float8_e4m3fn
QUANT_DTYPES = (FP8_DTYPE, torch.int8)
_QUANT_DTYPE_NAMES = {"F8_E4M3": FP8_DTYPE, "I8": torch.int8}   # safetensors' header names


def model_fingerprint(model_dir: str, cfg: NeoConfig | None = None) -> str:
    """Architecture + weight files identity; handles carry it so KV from another model is rejected."""
    cfg = cfg or load_config(model_dir)
    h = hashlib.sha256(cfg.fingerprint.encode())
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".gguf")):
            h.update(f"{name}:{os.path.getsize(os.path.join(model_dir, name))}".encode())
    return h.hexdigest()[:16]


def _expected_shapes(cfg: NeoConfig) -> dict[str, torch.Size]:
    full = skeleton(cfg, "both")
    return {k: p.shape for k, p in checkpoint_views(full.named_parameters())}


def load_model(model_dir: str, branch: str = "both", dtype: torch.dtype = torch.float32, device="cpu",
               lora: str | list | None = None, lora_strength: float = 1.0, tp: TPContext | None = None,
               random_weights: bool | None = None, quantization: str | None = None,
               layers_to_host: bool = False) -> NeoModel:
    """`lora`: one path (with `lora_strength`) or a list of (path, strength); each adapter is merged
    into the loaded branch if it names weights of it (None: the adapters in $U1SERVE_LORA).
    `quantization="fp8"` / `"int8"`: the dense Linear layers of the gen branch (or of the und branch when only
    that one is loaded) run W8A8 (services/model/quant.py, quant_int8.py), after the LoRA merge. A checkpoint
    converted to fp8 / int8 (`u1serve convert`, services/model/quant_checkpoint.py) is served in its format
    with its own scales when `quantization` is None / "none" (or names the same scheme): nothing is
    requantised. A GGUF checkpoint (a directory with one *.gguf) is dequantised to `dtype` at load
    (services/model/gguf_io.py).
    `layers_to_host` (weight streaming, services/model/weight_streaming.py): the decoder layers end in host memory
    (pinned where `device` is CUDA), each moved there as soon as it is complete and quantised, so the device holds at
    most one of them during the load (a GGUF checkpoint: all of them, until the end)."""
    from .constants import QUANTIZATIONS
    quantization = quantization or "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    quant_branches = ("und",) if branch == "und" else ("gen",)
    cfg = load_config(model_dir)
    if random_weights if random_weights is not None else knobs.RANDOM_WEIGHTS.get():   # full-size benchmarks
        from .tiny import build_random_model
        _check_quant_device(quantization, device, dtype)
        model = build_random_model(cfg.raw, branch, dtype, device, tp=tp, quantization=quantization,
                                   quant_branches=quant_branches,
                                   layer_done=_to_host_fn(device) if layers_to_host else None)
        fuse_projections(model)
        _attach_tokenizer(model, model_dir)
        model.fingerprint = model_fingerprint(model_dir, cfg)
        return model
    model = skeleton(cfg, branch, tp)
    from .gguf_io import find_gguf, read_gguf_state
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        _check_quant_device(quantization, device, dtype)
        params = dict(model.named_parameters())
        state = {}
        for key, t in read_gguf_state(gguf_file, dict(checkpoint_views(params.items())), _expected_shapes(cfg),
                                      tp, device, dtype).items():
            _place(state, params, key, t, device, dtype)
        model = _finish_load(model, state, None, LoraMerges(model, lora, lora_strength, tp), quantization,
                             quant_branches, model_dir, cfg)
        return _layers_to_host(model, device) if layers_to_host else model
    wm = weight_map(model_dir)
    ckpt_scheme = _checkpoint_scheme(cfg, wm)
    if quantization == "none" and ckpt_scheme is not None:
        quantization = ckpt_scheme       # served as converted, with the checkpoint's scales
        try:
            _check_quant_device(quantization, device, dtype)
        except RuntimeError as e:
            raise type(e)(f"{model_dir} is a {ckpt_scheme} checkpoint (u1serve convert), which {device} cannot "
                          f"serve: {e}. Serve the float checkpoint, or one converted with another --to.") from e
    else:
        _check_quant_device(quantization, device, dtype)
    full_shapes = _expected_shapes(cfg)
    unexpected = sorted(k for k in set(wm) - set(full_shapes) if not k.endswith(FP8_SCALE_SUFFIX))
    if unexpected:
        raise LoadError(f"unexpected tensor {unexpected[0]!r} in the checkpoint"
                        + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    needed = dict(checkpoint_views(model.named_parameters()))   # checkpoint keys (experts: per expert)
    params = dict(model.named_parameters())                     # meta: the layout to fill
    missing = sorted(k for k in needed if k not in wm)
    if missing:
        raise LoadError(f"missing tensor {missing[0]!r} in the checkpoint"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    handles: dict[str, object] = {}
    state = {}
    prequantized = {}   # fp8 checkpoint: name -> (q, scale) of this rank's shard
    loras = LoraMerges(model, lora, lora_strength, tp)
    layerwise = None    # quantised: each decoder layer as soon as its weights are read (layerwise_load.py)
    if quantization != "none" or layers_to_host:
        # merged adapters change the weights: those are quantised from the merged values, not the checkpoint's
        layerwise = LayerwiseQuantizer(model, needed, quant_branches, None if quantization == "none" else quantization,
                                       device, {} if loras.adapters else prequantized, loras.merge,
                                       done=_to_host_fn(device) if layers_to_host else None)
    for key in needed:
        path = wm[key]
        if path not in handles:
            handles[path] = open_safetensors(path)
        f = handles[path]
        try:
            sl = f.get_slice(key)
            shape = torch.Size(sl.get_shape())
        except Exception as e:
            raise LoadError(f"cannot read tensor {key!r} from {path}: {e}") from None
        if shape != full_shapes[key]:
            raise LoadError(f"tensor {key!r} has shape {tuple(shape)}, expected {tuple(full_shapes[key])}")
        dim = shard_dim(key)
        if tp is not None and tp.world_size > 1 and dim is not None:
            n = shape[dim] // tp.world_size
            index = [slice(None)] * len(shape)
            index[dim] = slice(tp.rank * n, (tp.rank + 1) * n)
            t = sl[tuple(index)]
        else:
            t = f.get_tensor(key)
        slot = stacked_slot(key)
        if t.dtype in QUANT_DTYPES:
            q, s = t, _fp8_scale(handles, wm, key, shape, dim, tp)
            # served in its own format: kept as is (experts are never quantised layers: model/quant.py)
            if slot is None and t.dtype == SCHEME_DTYPES.get(quantization):
                prequantized[key[: -len(".weight")]] = (q.to(device), s.to(device))
            t = q.float() * s.view(-1, 1)
        _place(state, params, key, t, device, dtype)
        del t
        if layerwise is not None:
            layerwise.placed(key, state)
    return _finish_load(model, state, layerwise, loras, quantization, quant_branches, model_dir, cfg)


def _to_host_fn(device):
    from .weight_streaming import layer_to_host
    pin = torch.device(device).type == "cuda"
    return lambda layer: layer_to_host(layer, pin)


def _layers_to_host(model: NeoModel, device) -> NeoModel:
    move = _to_host_fn(device)
    for layer in model.language_model.model.layers:
        move(layer)
    return model


def _place(state: dict, params: dict, key: str, t: torch.Tensor, device, dtype) -> None:
    """Put checkpoint tensor `key` into `state`: as itself, or an expert's weight straight into its stacked
    tensor (model/moe.py), so the experts never exist twice."""
    slot = stacked_slot(key)
    if slot is None:
        state[key] = t.to(device=device, dtype=dtype)
        return
    name, e, proj = slot
    if name not in state:
        state[name] = torch.empty(params[name].shape, dtype=dtype, device=device)
    expert_view(state[name], e, proj).copy_(t)


def _finish_load(model: NeoModel, state: dict, layerwise: LayerwiseQuantizer | None, loras: "LoraMerges",
                 quantization: str, quant_branches, model_dir: str, cfg: NeoConfig) -> NeoModel:
    """Assign the weights, merge the LoRAs, quantise. `layerwise`: the decoder layers are already merged and
    quantised (a safetensors checkpoint); None: all of it here (GGUF, read whole by gguf_io)."""
    from .quant import quantize_model
    from .quant_schemes import scheme
    if layerwise is not None:
        layerwise.finish(state)      # the weights outside the decoder layers
        loras.merge(dict(w for w in checkpoint_views(model.named_parameters()) if layer_of(w[0]) is None))
    else:
        model.load_state_dict(state, strict=True, assign=True)
        state.clear()      # the model holds the tensors now: fusing below frees each one as it is copied
        loras.merge(dict(checkpoint_views(model.named_parameters())))
        if quantization != "none":
            quantize_model(model, quant_branches, scheme=scheme(quantization))
    loras.finish()
    fuse_projections(model)    # q|k|v, gate|up as one weight where wanted (CUDA), after every layout change
    _attach_tokenizer(model, model_dir)
    model.fingerprint = model_fingerprint(model_dir, cfg)
    model.requires_grad_(False)
    return model.eval()


class LoraMerges:
    """The adapters (`lora`, `lora_strength`: load_model's) that name weights of the model's branch, each read once,
    merged into the weights handed to `merge` (all at once, or a decoder layer at a time as they load: each weight
    gets every adapter, in order, exactly once); `finish` refuses an adapter that matched no weight."""

    def __init__(self, model: NeoModel, lora, lora_strength: float, tp):
        self.tp, self.branch, self.adapters = tp, model.branch, []
        for path, strength in lora_list(lora, lora_strength):
            if lora_branches(path) & set(BRANCHES[model.branch]):
                factors = read_lora(path)
                check_bound(path, factors, model.cfg)
                self.adapters.append([path, strength, factors, 0])

    def merge(self, params: dict) -> None:
        """W += strength * scale * up @ down (fp32) for every weight of `params` {checkpoint key: tensor}."""
        for a in self.adapters:
            path, strength, factors, _ = a
            a[3] += add_deltas(params, lora_deltas(path, params, strength, self.tp, factors=factors))

    def finish(self) -> None:
        for path, _, _, merged in self.adapters:
            if merged == 0:
                raise LoadError(f"LoRA file {path} matched no weight of this model (branch {self.branch!r})")


def _check_quant_device(quantization: str, device, dtype: torch.dtype) -> None:
    """Fail before loading where the scheme cannot run on `device`."""
    if quantization == "fp8":
        from .quant import check_fp8_device
        check_fp8_device(torch.device(device), dtype)
    elif quantization == "int8":
        from .quant_int8 import check_int8_device
        check_int8_device(torch.device(device))


def _checkpoint_scheme(cfg: NeoConfig, wm: dict[str, str]) -> str | None:
    """fp8 / int8 for a converted checkpoint (its config and tensor dtypes agree), None for a plain one."""
    from .quant_checkpoint import QuantConfigError, check_tensors
    quantized, handles = {}, {}
    for key, path in wm.items():
        if key.endswith(".weight"):
            f = handles.get(path) or handles.setdefault(path, open_safetensors(path))
            dt = _QUANT_DTYPE_NAMES.get(f.get_slice(key).get_dtype())
            if dt is not None:
                quantized[key] = dt
    try:
        return check_tensors(cfg.raw, quantized, [k for k in wm if k.endswith(".weight")])
    except QuantConfigError as e:
        raise LoadError(str(e)) from None


def _attach_tokenizer(model: NeoModel, model_dir: str) -> None:
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        from .tokenizer import NeoTokenizer
        model.set_image_context_id(NeoTokenizer.from_dir(model_dir).img_context_id)


def merge_lora(model: NeoModel, path: str, strength: float = 1.0, tp: TPContext | None = None) -> int:
    """W += strength * scale * up @ down, in fp32 (`read_lora`: official or PEFT layout). Returns modules merged."""
    params = dict(checkpoint_views(model.named_parameters()))   # experts: views into the stacked tensors
    merged = add_deltas(params, lora_deltas(path, params, strength, tp, cfg=model.cfg))
    if merged == 0:
        raise LoadError(f"LoRA file {path} matched no weight of this model (branch {model.branch!r})")
    return merged


def add_deltas(params: dict, deltas) -> int:
    """W += delta in fp32, rounded once to W's dtype, for each (name, delta) of `deltas`; returns how many."""
    n = 0
    for name, delta in deltas:
        param = params[name]
        param.data.copy_((param.data.float() + delta.to(param.device)).to(param.dtype))
        n += 1
    return n


def check_bound(path: str, factors: dict, cfg: NeoConfig) -> None:
    """Refuse an adapter any module of which is no weight of the checkpoint, either branch (the list of names: an
    adapter that binds to nothing, or only in part, is refused rather than half applied)."""
    unbound = unbound_modules(factors, cfg)
    if unbound:
        raise LoadError(f"LoRA file {path}: {len(unbound)} of its {len(factors)} modules do not bind to this "
                        f"model: {name_list(unbound)}")


def lora_deltas(path: str, weights: dict, strength: float = 1.0, tp: TPContext | None = None,
                cfg: NeoConfig | None = None, factors: dict | None = None):
    """(name, fp32 delta of this TP rank's shard) for every `X.weight` in `weights` ({name: tensor of this rank's
    shape}) that the adapter at `path` names (`factors`: its read_lora when already read). Raises LoadError on a
    shape mismatch, and (given the model's `cfg`) when it does not bind (check_bound)."""
    factors = read_lora(path) if factors is None else factors
    if cfg is not None:
        check_bound(path, factors, cfg)
    for module, (down, up, scale) in factors.items():
        name = module + ".weight"
        if name not in weights:
            continue
        # the product's shape from the factors' before any product (a wrong pair would cost out x in floats)
        full = torch.empty(up.shape[0], down.shape[1], device="meta")
        if shard(full, shard_dim(name), tp).shape != weights[name].shape:
            raise LoadError(f"LoRA for {name!r} has shape {tuple(full.shape)}, weight is "
                            f"{tuple(weights[name].shape)}")
        yield name, shard((scale * strength) * (up.float() @ down.float()), shard_dim(name), tp)


def name_list(names, limit: int = 8) -> str:
    """'a', 'b' (and N more): names in an error message, sorted."""
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def unbound_modules(factors: dict, cfg: NeoConfig) -> list[str]:
    """The adapter's module names that are no `X.weight` of the checkpoint (both branches), sorted."""
    names = {k[: -len(".weight")] for k in _expected_shapes(cfg) if k.endswith(".weight")}
    return sorted(m for m in factors if m not in names)


PEFT_FILE, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def read_lora(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """An adapter -> {module name (checkpoint key without `.weight`): (down [r, in], up [out, r], scale)}.
    Official layout (one file): `X.lora_down.weight`, `X.lora_up.weight`, optional `X.alpha` (scale alpha / r),
    keys optionally prefixed `diffusion_model.`. PEFT layout (a directory with adapter_model.safetensors and
    adapter_config.json, or that file): `base_model.model.X.lora_A.weight` / `lora_B.weight`, scale
    lora_alpha / r (/ sqrt(r) with use_rslora), per-module `rank_pattern` / `alpha_pattern` by key suffix."""
    if os.path.isdir(path):
        path = os.path.join(path, PEFT_FILE)
    out = {}
    with open_safetensors(path) as f:
        keys = set(f.keys())
        if any(".lora_A." in k for k in keys):
            cfg = _peft_config(os.path.dirname(path))
            for k in sorted(keys):
                if ".lora_A." not in k:
                    continue
                up_k = k.replace(".lora_A.", ".lora_B.")
                if up_k not in keys:
                    raise LoadError(f"PEFT adapter {path}: {k!r} has no {up_k!r}")
                module = k.split(".lora_A.")[0].removeprefix("base_model.model.")
                down, up = _pair(path, module, f.get_tensor(k), f.get_tensor(up_k))
                r = down.shape[0]
                alpha = _by_suffix(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r))
                r_cfg = _by_suffix(cfg.get("rank_pattern") or {}, module, cfg.get("r", r))
                scale = float(alpha) / (math.sqrt(r_cfg) if cfg.get("use_rslora") else float(r_cfg))
                out[module] = (down, up, scale)
            return out
        for k in sorted(keys):
            if not k.endswith(".lora_down.weight"):
                continue
            base = k[: -len(".lora_down.weight")]
            if base + ".lora_up.weight" not in keys:
                continue
            down, up = _pair(path, base, f.get_tensor(k), f.get_tensor(base + ".lora_up.weight"))
            rank = down.shape[0]
            alpha = f.get_tensor(base + ".alpha").float().item() if base + ".alpha" in keys else float(rank)
            out[base.removeprefix("diffusion_model.")] = (down, up, alpha / rank)
    return out


def _pair(path: str, module: str, down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """down [r, in], up [out, r] with 1 <= r <= min(out, in); else a LoadError (a rank-0 or mismatched pair)."""
    if (down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]
            or not 1 <= down.shape[0] <= min(up.shape[0], down.shape[1])):
        raise LoadError(f"LoRA file {os.path.basename(path)}: module {module!r} has factors of shapes "
                        f"{tuple(down.shape)} and {tuple(up.shape)}, not down [r, in] and up [out, r] with "
                        "1 <= r <= min(out, in)")
    return down, up


def _peft_config(directory: str) -> dict:
    cfg_path = os.path.join(directory, PEFT_CONFIG)
    if not os.path.exists(cfg_path):
        return {}
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{cfg_path} is not valid JSON: {e}") from None


def _by_suffix(pattern: dict, module: str, default):
    for suffix, value in pattern.items():
        if module == suffix or module.endswith("." + suffix):
            return value
    return default


def _fp8_scale(handles, wm, key: str, shape, dim, tp) -> torch.Tensor:
    """The per-output-channel scale of an fp8 weight, as this TP rank's shard needs it."""
    skey = key[: -len(".weight")] + FP8_SCALE_SUFFIX
    if skey not in wm:
        raise LoadError(f"fp8 tensor {key!r} has no {skey!r} in the checkpoint")
    f = handles.setdefault(wm[skey], open_safetensors(wm[skey]))
    s = f.get_tensor(skey).float().reshape(-1)
    if s.numel() != shape[0]:
        raise LoadError(f"{skey!r} has {s.numel()} values, {key!r} has {shape[0]} rows")
    if dim == 0 and tp is not None and tp.world_size > 1:  # column shard: rows split, scales too
        s = shard(s, 0, tp)
    return s


def lora_list(lora, strength: float = 1.0) -> list[tuple[str, float]]:
    if lora is None:
        env = knobs.LORA.text()
        return [parse_lora_spec(x.strip()) for x in env.split(",") if x.strip()]
    if isinstance(lora, str):
        return [(lora, strength)]
    return [(p, float(s)) for p, s in lora]


def lora_branches(path: str) -> set[str]:
    """The branches an adapter names: gen (`*_mot_gen`, `fm_modules.*`) and/or und (the rest of
    `language_model.*`, `vision_model.*`). Raises LoadError when it names neither."""
    out = set()
    for k in read_lora(path):
        if "_mot_gen" in k or k.startswith("fm_modules."):
            out.add("gen")
        elif k.startswith(("language_model.", "vision_model.")):
            out.add("und")
    if not out:
        raise LoadError(f"LoRA file {path} names no module of this model (official format: "
                        f"X.lora_down.weight / X.lora_up.weight / X.alpha; or PEFT's lora_A / lora_B)")
    return out
