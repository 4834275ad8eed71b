"""A loaded model <-> tensors under the checkpoint's own key names, both ways: export (trainers save what they
trained so the serving stack can load it) and live updates (read, validate, then copy into the running model).

The model's parameter names are the checkpoint keys (modules.py), except where serving changed the layout:
- fp8 (model/quant.py): q|k|v of a layer live in `qkv_proj{sfx}` (a q GEMM and one k|v GEMM), gate|up in
  `mlp{sfx}.gate_up_proj`, as e4m3 rows with one fp32 scale per row (and the model-dtype rows when kept);
  a key maps to a row range of such a layer, and an update requantises only those rows (row-wise scales);
- A3B experts (model/moe.py): stacked per MoE block; a per-expert key is a view of its rows there;
- tensor parallel (understanding): each rank holds its shard of the column / row-parallel weights
  (parallel.shard_dim) and reads only that shard, as the loader does.

An update is staged first (`stage_update`): every tensor is read and checked (known key, shape, a float
dtype, finite after the cast to the model dtype) and converted to exactly what the model holds, before
anything changes; a bad update raises UpdateError naming the keys. `StagedUpdate.commit` then only copies
into the existing storage (`copy_`), so CUDA graphs and fp8 buffers stay valid.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.base import knobs
from services.base.checkpoint_names import INDEX_FILE

from .checkpoint_files import FP8_SCALE_SUFFIX, LoadError, weight_map
from .loader import FP8_DTYPE, lora_deltas, name_list
from .model import NeoModel
from .skeleton import skeleton
from .moe import checkpoint_views
from .parallel import shard, shard_dim

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_SHARD_BYTES = 4 << 30


class UpdateError(LoadError):
    """A weight update that does not fit the model; the message names the keys. Nothing was changed."""


def key_branch(key: str) -> str:
    """'gen' for the generation branch's keys (`*_mot_gen*`, `fm_modules.*`), else 'und'."""
    return "gen" if "_mot_gen" in key or key.startswith("fm_modules.") else "und"


def _in_branch(key: str, branch: str | None) -> bool:
    return branch in (None, "both") or key_branch(key) == branch


def checkpoint_shapes(model: NeoModel) -> dict[str, torch.Size]:
    """Every key of the full checkpoint (both branches) -> its full (unsharded) shape."""
    shapes = getattr(model, "_checkpoint_shapes", None)
    if shapes is None:
        full = skeleton(model.cfg, "both")
        shapes = {k: p.shape for k, p in checkpoint_views(full.named_parameters())}
        model._checkpoint_shapes = shapes
    return shapes


# ----------------------------------------------------------------------------- where each key lives
@dataclass
class _Target:
    """One checkpoint key in the model: a parameter, or rows [r0, r1) of an fp8 layer."""
    param: torch.Tensor | None = None
    fp8: object = None          # quant.Fp8Linear
    r0: int = 0
    r1: int = 0

    @property
    def shape(self) -> torch.Size:
        if self.param is not None:
            return self.param.shape
        return torch.Size((self.r1 - self.r0, self.fp8.in_features))

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The model's current value of this key (this rank's shard), in `dtype`."""
        if self.param is not None:
            return self.param.detach().to(dtype)
        hp = self.fp8.weight_hp
        w = hp[self.r0:self.r1] if hp is not None else self.fp8.dequantized_weight()[self.r0:self.r1]
        return w.to(dtype)


def _fp8_keys(path: str, splits) -> list[str]:
    """Checkpoint module names of the fp8 layer at module path `path` (quant.quantize_model's layout)."""
    parent, leaf = path.rsplit(".", 1)
    if ".qkv_proj" in parent:                       # ...self_attn.qkv_proj{sfx}.{q_proj | kv_proj}
        attn, sfx = parent.rsplit(".qkv_proj", 1)
        names = ["q_proj"] if leaf == "q_proj" else ["k_proj", "v_proj"]
        return [f"{attn}.{n}{sfx}" for n in names]
    if leaf == "gate_up_proj":                      # ...mlp{sfx}.gate_up_proj
        return [f"{parent}.gate_proj", f"{parent}.up_proj"]
    return [path]                                   # o_proj{sfx}, mlp{sfx}.down_proj


def targets(model: NeoModel) -> dict[str, _Target]:
    """Checkpoint key -> where its values live in `model` (this rank's shard)."""
    from .quant import Fp8Linear
    out = {name: _Target(param=p) for name, p in checkpoint_views(model.named_parameters())}
    for path, mod in model.named_modules():
        if not isinstance(mod, Fp8Linear):
            continue
        splits = mod.splits or (mod.out_features,)
        r0 = 0
        for name, rows in zip(_fp8_keys(path, splits), splits):
            out[name + ".weight"] = _Target(fp8=mod, r0=r0, r1=r0 + rows)
            r0 += rows
    return out


# ----------------------------------------------------------------------------- export
def checkpoint_state(model: NeoModel, branch: str | None = None, dtype: torch.dtype | None = None
                     ) -> dict[str, torch.Tensor]:
    """{checkpoint key: full tensor} of the model's `branch` ('gen', 'und', 'both' / None: all it holds), on the
    CPU, in `dtype` (default: the model's). A tensor-parallel model gathers its shards (every rank must call
    this); an fp8 model gives its model-dtype rows where kept, else the dequantised ones. Tensors may share
    storage with the model's parameters (no copy of a CPU model): clone before changing either."""
    dtype = dtype or model.dtype
    tp = model.tp
    out = {}
    for key, t in sorted(targets(model).items()):
        if not _in_branch(key, branch):
            continue
        value = t.read(dtype)
        dim = shard_dim(key)
        if tp is not None and tp.world_size > 1 and dim is not None:
            value = tp.all_gather_heads(value, dim)
        out[key] = value.detach().cpu().contiguous()
    return out


def write_checkpoint_weights(model: NeoModel, out_dir: str, branch: str | None = None,
                             dtype: torch.dtype | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Save `checkpoint_state(model, branch, dtype)` under `out_dir` as the loader reads it: `model.safetensors`,
    or shards plus `model.safetensors.index.json` above `max_shard_bytes`. Returns `out_dir`."""
    return write_tensors(checkpoint_state(model, branch, dtype), out_dir, max_shard_bytes)


def write_tensors(state: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    os.makedirs(out_dir, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(state):
        n = state[key].numel() * state[key].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    if len(shards) == 1:
        save_file({k: state[k].contiguous() for k in shards[0]}, os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        return out_dir
    wmap = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys}, os.path.join(out_dir, name), metadata={"format": "pt"})
        wmap.update({k: name for k in keys})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
    return out_dir


# ----------------------------------------------------------------------------- live updates
@dataclass
class StagedUpdate:
    """Validated tensors, exactly as the model will hold them; `commit` copies them in."""
    params: list = field(default_factory=list)   # (parameter, value)
    fp8: list = field(default_factory=list)      # (Fp8Linear, r0, r1, q, scale, value or None)
    keys: list = field(default_factory=list)     # the checkpoint keys it changes
    skipped: list = field(default_factory=list)  # keys of the other branch (another engine's)
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.keys)

    @torch.no_grad()
    def commit(self) -> int:
        """Copy every staged tensor into the model's own storage. Returns the keys changed."""
        for p, v in self.params:
            p.copy_(v)
        for lin, r0, r1, q, s, hp in self.fp8:
            lin.weight[r0:r1].copy_(q)
            lin.weight_scale[0, r0:r1].copy_(s.reshape(-1))
            if hp is not None:
                lin.weight_hp[r0:r1].copy_(hp)
        return len(self.keys)


def update_files(source: str) -> dict[str, str]:
    """key -> safetensors file of an update: a file, or a directory (with an index, or its *.safetensors)."""
    if os.path.isfile(source):
        paths = [source]
    elif os.path.isdir(source):
        if os.path.exists(os.path.join(source, INDEX_FILE)):
            return weight_map(source)
        paths = sorted(os.path.join(source, n) for n in os.listdir(source) if n.endswith(".safetensors"))
        if not paths:
            raise UpdateError(f"no *.safetensors file in {source}")
    else:
        raise UpdateError(f"weights path {source} does not exist (it must be readable by every engine process)")
    out: dict[str, str] = {}
    for path in paths:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as e:
            raise UpdateError(f"corrupt or unreadable safetensors file {path}: {e}") from None
        for k in keys:
            if k in out:
                raise UpdateError(f"tensor {k!r} is in both {out[k]} and {path}")
            out[k] = path
    return out


def _names(keys: Iterable[str], limit: int = 5) -> str:
    return name_list(keys, limit)


def stage_update(model: NeoModel, source: str | None = None, lora: str | None = None, lora_strength: float = 1.0,
                 device: torch.device | str | None = None) -> StagedUpdate:
    """Read and validate an update for `model` (this rank's shard): the tensors of `source` (checkpoint key
    names; a subset is a partial update; keys of the other branch are skipped), then the LoRA delta of `lora`
    applied to the weights as they will be (the current ones, or the update's). Staged on `device` (default:
    the model's). Raises UpdateError naming every bad key; nothing in the model changes."""
    if source is None and lora is None:
        raise UpdateError("an update needs weights (path) or a LoRA adapter (lora)")
    device = torch.device(device) if device is not None else model.device
    dtype, tp = model.dtype, model.tp
    shapes = checkpoint_shapes(model)
    where = targets(model)
    values: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    if source is not None:
        files = update_files(source)
        scales = {k for k in files if k.endswith(FP8_SCALE_SUFFIX)}
        unknown = [k for k in files if k not in shapes and not (
            k in scales and k[: -len(FP8_SCALE_SUFFIX)] + ".weight" in files)]
        if unknown:
            raise UpdateError(f"unknown tensor(s) {_names(unknown)}: not keys of this model's checkpoint")
        bad_shape, bad_dtype, not_finite = [], [], []
        handles: dict[str, object] = {}
        try:
            for key in sorted(set(files) - scales):
                if key not in where:
                    skipped.append(key)
                    continue
                path = files[key]
                f = handles.get(path) or handles.setdefault(path, safe_open(path, framework="pt", device="cpu"))
                sl = f.get_slice(key)
                shape = torch.Size(sl.get_shape())
                if shape != shapes[key]:
                    bad_shape.append(f"{key!r} {tuple(shape)} (expected {tuple(shapes[key])})")
                    continue
                t = shard(f.get_tensor(key), shard_dim(key), tp) if tp is not None and tp.world_size > 1 \
                    else f.get_tensor(key)
                if t.dtype == FP8_DTYPE:
                    skey = key[: -len(".weight")] + FP8_SCALE_SUFFIX
                    if skey not in files:
                        bad_dtype.append(f"{key!r} fp8 without {skey!r}")
                        continue
                    s = _open_get(handles, files[skey], skey).float().reshape(-1)
                    if s.numel() != shape[0]:
                        bad_shape.append(f"{skey!r} {s.numel()} values for {shape[0]} rows")
                        continue
                    s = shard(s, 0, tp) if shard_dim(key) == 0 else s
                    t = t.float() * s.view(-1, 1)
                elif t.dtype not in FLOAT_DTYPES:
                    bad_dtype.append(f"{key!r} {str(t.dtype).removeprefix('torch.')}")
                    continue
                t = t.to(device=device, dtype=dtype)
                if not bool(torch.isfinite(t).all()):
                    not_finite.append(key)
                    continue
                values[key] = t
        finally:
            handles.clear()
        problems = []
        if bad_shape:
            problems.append(f"wrong shape: {'; '.join(sorted(bad_shape)[:5])}"
                            + (f" (and {len(bad_shape) - 5} more)" if len(bad_shape) > 5 else ""))
        if bad_dtype:
            problems.append(f"not a float dtype: {'; '.join(sorted(bad_dtype)[:5])}")
        if not_finite:
            problems.append(f"NaN or Inf values (after the cast to {str(dtype).removeprefix('torch.')}) in "
                            f"{_names(not_finite)}")
        if problems:
            raise UpdateError("weight update refused: " + "; ".join(problems))
    if lora is not None:
        current = {k: t.shape for k, t in where.items()}
        not_finite = []
        for key, delta in lora_deltas(lora, {k: _Shape(s) for k, s in current.items()}, lora_strength, tp,
                                      cfg=model.cfg):
            base = values[key] if key in values else where[key].read(dtype).to(device)
            v = (base.float() + delta.to(device)).to(dtype)
            if not bool(torch.isfinite(v).all()):
                not_finite.append(key)
            values[key] = v
        if not_finite:
            raise UpdateError(f"weight update refused: the LoRA delta makes {_names(not_finite)} non-finite")
        if not values:
            raise UpdateError(f"LoRA adapter {lora} names no weight of this model (branch {model.branch!r})")
    return _stage(where, values, skipped)


class _Shape:
    """Stands in for a tensor where only `.shape` is read (lora_deltas' shape check)."""
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


def _open_get(handles: dict, path: str, key: str) -> torch.Tensor:
    f = handles.get(path) or handles.setdefault(path, safe_open(path, framework="pt", device="cpu"))
    return f.get_tensor(key)


def _stage(where: dict[str, _Target], values: dict[str, torch.Tensor], skipped: list[str]) -> StagedUpdate:
    staged = StagedUpdate(skipped=sorted(skipped))
    for key in sorted(values):
        t, v = where[key], values[key]
        if v.shape != t.shape:      # the TP shard of a correct full tensor always fits; a guard
            raise UpdateError(f"weight update refused: {key!r} has shape {tuple(v.shape)} here, "
                              f"the model holds {tuple(t.shape)}")
        if t.param is not None:
            staged.params.append((t.param, v))
        else:                       # as quant.Fp8Linear.from_linears quantises at load: rows of the model dtype
            q, s = t.fp8.quantize_rows(v.to(t.fp8.weight.device))   # its scheme's: fp8 or int8
            hp = v if t.fp8.weight_hp is not None else None
            staged.fp8.append((t.fp8, t.r0, t.r1, q, s, hp))
        staged.keys.append(key)
        staged.nbytes += v.numel() * v.element_size()
    return staged


# ----------------------------------------------------------------------------- one rank's update state
DEFAULT_VERSION = "0"
POLL_S = 0.05        # how often rank 0 asks the ranks how a stage's read goes (one all-gather; between steps)


class _Reading:
    """A stage op's files read and validated in a thread of this rank (off its step loop), under a deadline."""

    def __init__(self, op: dict, read, device: torch.device):
        self.op = op
        self.timeout_s = knobs.WEIGHTS_READ_TIMEOUT_S.get()
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout_s
        self.staged: StagedUpdate | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(read, device), name="weights-stage", daemon=True).start()

    def _run(self, read, device: torch.device) -> None:
        try:
            if device.type == "cuda":  # a new thread starts on device 0, and without the loop's grad mode
                torch.cuda.set_device(device)
            delay = knobs.FAULT_WEIGHTS_READ_S.get()
            if delay:                  # the test-only stand-in for a slow mount
                time.sleep(delay)
            with torch.no_grad():
                self.staged = read()
        except BaseException as e:     # reported by the step loop's next poll
            self.error = e
        finally:
            self.done.set()

    def outcome(self) -> dict:
        """This rank's part of a poll: {"state": "reading"}, {"state": "done"} or {"state": "error", "error": ...}."""
        if self.done.is_set():
            return {"state": "done"} if self.error is None else {"state": "error", "error": error_reply(self.error)}
        if time.monotonic() > self.deadline:   # the thread ends when its read does; its result is dropped
            return {"state": "error", "error": {
                "status": 504, "code": "weights_read_timeout",
                "message": f"reading the weight update's files took longer than {self.timeout_s:g} s "
                           f"({knobs.WEIGHTS_READ_TIMEOUT_S.name})"}}
        return {"state": "reading"}


class LiveWeights:
    """One engine rank's side of the two-phase update: `stage` (read + validate into a staged copy), then
    `commit` (copy in, new version) or `abort` (drop the copy). The engine decides when commit may run
    (between jobs); every rank of an engine runs the same calls in the same order.

    Through `run`, a stage reads its files in a thread (`_Reading`): the step loop goes on, and the engine's rank
    0 sends a `stage_poll` op between steps (`poll_op`) until every rank has its copy in memory (or one failed or
    ran past WEIGHTS_READ_TIMEOUT_S); only then does the stage answer. A commit copies tensors already in memory."""

    def __init__(self, model: NeoModel, version: str = DEFAULT_VERSION):
        self.model = model
        self.version = version
        self.staged: StagedUpdate | None = None
        self.staged_version: str | None = None
        self.reading: _Reading | None = None
        self._polled = 0.0

    def poll_op(self) -> dict | None:
        """Rank 0: the op that asks every rank how its read goes, at most every POLL_S while one runs (None:
        no read, or polled a moment ago). Other ops wait until the stage answered."""
        if self.reading is None or time.monotonic() - self._polled < POLL_S:
            return None
        self._polled = time.monotonic()
        return {"op": "stage_poll", "id": self.reading.op["id"]}

    def stage(self, version: str, path: str | None = None, lora: str | None = None,
              lora_strength: float = 1.0) -> StagedUpdate:
        """Raises UpdateError (or LoadError for an unreadable file); on success the previous staged copy is
        replaced."""
        self.abort()
        staged = stage_update(self.model, path, lora, lora_strength, self._staging_device(path, lora))
        self.staged, self.staged_version = staged, version
        return staged

    def commit(self) -> int:
        if self.staged is None:
            raise UpdateError("no staged weight update to commit")
        n = self.staged.commit()
        self.version = self.staged_version
        self.abort()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return n

    def abort(self) -> None:
        self.staged, self.staged_version, self.reading = None, None, None

    def run(self, op: dict, all_gather) -> dict:
        """Run one op of the engines' weights API ({"op": "stage" | "commit" | "abort", "id", ...}) on this
        rank, agree with the engine's other ranks (`all_gather(obj) -> [obj of each rank]`), and return the
        reply rank 0 sends: {"id", "ok", "version", "seconds", "updated"?, "skipped"?, "error"?}. A stage
        that failed on any rank is dropped on every rank."""
        if op["op"] in LORA_OPS:      # resident adapters (lora_registry.py), not the weights
            return lora_op(self.model, op, all_gather)
        if op["op"] == "stage":
            self.abort()
            self.reading = _Reading(op, lambda: stage_update(
                self.model, op.get("path"), op.get("lora"), float(op.get("lora_strength", 1.0)),
                self._staging_device(op.get("path"), op.get("lora"))), self.model.device)
            self._polled = time.monotonic()
            return None
        if op["op"] == "stage_poll":
            return self._poll(all_gather)
        t0 = time.perf_counter()
        reply: dict = {"id": op["id"], "ok": True}
        err = None
        try:
            if op["op"] == "commit":
                reply.update(updated=self.commit(), drain_seconds=op.get("drain_seconds"))
            else:
                self.abort()
        except Exception as e:
            err = error_reply(e)
        errors = [e for e in all_gather(err) if e is not None]
        if errors:
            reply = {"id": op["id"], "ok": False, "error": errors[0]}
        reply.update(version=self.version, seconds=time.perf_counter() - t0)
        return reply

    def _poll(self, all_gather) -> dict | None:
        """Every rank's read agreed on: None while one still reads, else the stage's reply (a failure on any rank
        drops the copies of all)."""
        reading = self.reading
        parts = all_gather(reading.outcome())
        errors = [p["error"] for p in parts if p["state"] == "error"]
        if not errors and any(p["state"] == "reading" for p in parts):
            return None
        self.reading = None
        op = reading.op
        reply = {"id": op["id"], "ok": not errors, "seconds": time.monotonic() - reading.started}
        if errors:
            reply["error"] = errors[0]
        else:
            self.staged, self.staged_version = reading.staged, op["version"]
            reply.update(updated=len(reading.staged), skipped=len(reading.staged.skipped))
        reply["version"] = self.version
        return reply

    def _staging_device(self, path: str | None, lora: str | None) -> torch.device:
        """The model's device when the staged copy fits there with room to spare, else the CPU (commit then
        copies host -> device)."""
        dev = self.model.device
        if dev.type != "cuda":
            return dev
        files = update_files(path) if path else {}
        size = sum(os.path.getsize(p) for p in set(files.values()))
        if lora:
            size += sum(p.numel() * p.element_size() for p in self.model.parameters())   # worst case: every weight
        free, _ = torch.cuda.mem_get_info(dev)
        return dev if 2 * size < free else torch.device("cpu")


LORA_OPS = ("lora_load", "lora_unload")


def lora_op(model: NeoModel, op: dict, all_gather) -> dict:
    reg = getattr(model, "lora", None)
    if reg is None:
        all_gather(None)          # the ranks still meet once, as for any op
        return {"id": op["id"], "ok": False, "error": {
            "status": 400, "code": "lora_disabled",
            "message": "this engine serves no LoRA adapters (start it with --max-loras N or --lora-modules)"}}
    return reg.run(op, all_gather)


def error_reply(exc: BaseException) -> dict:
    """A rank's failure of a weights op as the reply's `error`: a refused update is the caller's (400)."""
    if isinstance(exc, LoadError):
        return {"status": 400, "message": str(exc), "code": "invalid_weights"}
    return {"status": 500, "message": f"{type(exc).__name__}: {exc}", "code": "weights_error"}
