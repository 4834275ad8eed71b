"""Which local files an engine may read for a runtime adapter load or a weight update (issue 37).

Only from the directories the operator allows (`u1serve up --allowed-local-dirs`, `--lora-allowed-dirs`,
`--weights-allowed-dirs`: knobs ALLOWED_LOCAL_DIRS, LORA_ALLOWED_DIRS, WEIGHTS_ALLOWED_DIRS; weight updates also
from the stack's upload directory, WEIGHTS_UPLOAD_DIR), resolved (no `..`, no symlink that leads out), and only
regular files (a FIFO or a device would block the engine that opens it). Checked in the engine's HTTP process,
off the event loop and under a timeout, before the op reaches the engine's step loop. A path outside the allowed
places gets the same answer whether it exists or not. A directory's files are its *.safetensors and *.json and
every file its safetensors index names (an index may name a shard anywhere, by any name).

An adapter (small: MBs) is also read here, off the step loop and under the same timeout, into a private copy on
local disk that the engine ranks then read (`private_copy`): a slow mount stalls this thread, never a step.
Weights (GBs) are read by the ranks from the checked regular files themselves, each in a thread off its step
loop under WEIGHTS_READ_TIMEOUT_S (services/model/weights_io.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import tempfile

from services.base import knobs
from services.base.checkpoint_names import INDEX_FILE

from .errors import APIError

CHECK_TIMEOUT_S = 10.0
COPY_TIMEOUT_S = 120.0
MAX_INDEX_BYTES = 64 << 20                      # a safetensors index (8B's: ~100 KB)
MAX_ADAPTER_BYTES = 4 << 30                     # an adapter copied for the ranks (rank 64 at 8B is ~0.7 GB)
READ_SUFFIXES = (".safetensors", ".json")      # what a loader opens in a directory (weights, PEFT adapter)


def allowed_dirs(kind: str) -> list[str]:
    """The resolved directories `kind` ("lora" or "weights") may load from."""
    own = knobs.LORA_ALLOWED_DIRS if kind == "lora" else knobs.WEIGHTS_ALLOWED_DIRS
    texts = [knobs.ALLOWED_LOCAL_DIRS.text(), own.text()]
    if kind == "weights":
        texts.append(knobs.WEIGHTS_UPLOAD_DIR.text())
    return [os.path.realpath(d.strip()) for t in texts for d in t.split(",") if d.strip()]


def _inside(path: str, dirs: list[str]) -> bool:
    return any(os.path.commonpath([path, d]) == d for d in dirs)


def _refused(path: str, kind: str, dirs: list[str]) -> APIError:
    where = "the directories this stack allows" if dirs else "any directory (this stack allows none)"
    return APIError(400, f"{kind} path {path[:200]!r} is not a regular file or directory under {where}: the "
                    "operator names them with u1serve up --allowed-local-dirs (or --lora-allowed-dirs / "
                    "--weights-allowed-dirs)", param="path", code="path_not_allowed")


def _index_shards(directory: str) -> list[str]:
    """The files a directory's safetensors index names (any name, any place: each is checked as the directory's
    own files are); none when there is no index or it does not parse (the loader then says so)."""
    index = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(index) or os.path.getsize(index) > MAX_INDEX_BYTES:
        return []
    try:
        with open(index) as f:
            shards = json.load(f).get("weight_map", {}).values()
    except (ValueError, AttributeError):
        return []
    return [os.path.join(directory, s) for s in set(shards) if isinstance(s, str)]


def _check(path: str, kind: str) -> str:
    dirs = allowed_dirs(kind)
    real = os.path.realpath(path)
    if not dirs or not _inside(real, dirs):
        raise _refused(path, kind, dirs)
    try:
        st = os.stat(real)
    except OSError:
        return real                    # inside the allowed places: the loader says it does not exist
    if stat.S_ISDIR(st.st_mode):
        inner = [e.path for e in os.scandir(real) if e.name.endswith(READ_SUFFIXES)] + _index_shards(real)
        for path in inner:
            resolved = os.path.realpath(path)
            if not _inside(resolved, dirs) or not stat.S_ISREG(os.stat(resolved).st_mode):
                raise _refused(path, kind, dirs)
    elif not stat.S_ISREG(st.st_mode):
        raise _refused(path, kind, dirs)
    return real


async def checked_path(path: str, kind: str) -> str:
    """`path` resolved, once it is an allowed regular file (or a directory of them); else a 400 that tells
    nothing of what lies outside the allowed places. Runs in a thread with a timeout (a hung mount)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(_check, path, kind), CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(504, f"checking the {kind} path took longer than {CHECK_TIMEOUT_S:g} s",
                       code="path_check_timeout") from None
    except OSError:
        raise _refused(path, kind, allowed_dirs(kind)) from None


def _copy(real: str, kind: str) -> tuple[str, str]:
    """A private copy of the adapter at `real` (a file, or a PEFT directory's safetensors and JSON files):
    (the copy's directory, the path to load)."""
    is_dir = os.path.isdir(real)
    files = [e.path for e in os.scandir(real) if e.name.endswith(READ_SUFFIXES)] if is_dir else [real]
    if sum(os.stat(f).st_size for f in files) > MAX_ADAPTER_BYTES:
        raise APIError(413, f"the {kind} adapter is larger than {MAX_ADAPTER_BYTES} bytes", param="path",
                       code="adapter_too_large")
    out = tempfile.mkdtemp(prefix="u1serve-adapter-")
    try:
        for f in files:
            shutil.copyfile(f, os.path.join(out, os.path.basename(f)))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out, out if is_dir else os.path.join(out, os.path.basename(real))


def _remove_when_done(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        shutil.rmtree(task.result()[0], ignore_errors=True)


@contextlib.asynccontextmanager
async def private_copy(path: str, kind: str):
    """The checked adapter at `path` copied to a private directory (read in a thread, under COPY_TIMEOUT_S), its
    path yielded (the resolved path itself when nothing exists there inside the allowed places: the loader says
    so) and removed afterwards (the ranks hold the tensors by then)."""
    real = await checked_path(path, kind)
    if not os.path.exists(real):
        yield real
        return
    task = asyncio.ensure_future(asyncio.to_thread(_copy, real, kind))
    try:
        out, copy = await asyncio.wait_for(asyncio.shield(task), COPY_TIMEOUT_S)
    except asyncio.TimeoutError:
        task.add_done_callback(_remove_when_done)       # the thread ends when its read does
        raise APIError(504, f"reading the {kind} adapter took longer than {COPY_TIMEOUT_S:g} s",
                       code="path_read_timeout") from None
    except OSError:
        raise _refused(path, kind, allowed_dirs(kind)) from None
    try:
        yield copy
    finally:
        shutil.rmtree(out, ignore_errors=True)
