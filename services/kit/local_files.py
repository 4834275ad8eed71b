"""Which local files an engine may read for a runtime adapter load or a weight update (issue 37).

Only from the directories the operator allows (`u1serve up --allowed-local-dirs`, `--lora-allowed-dirs`,
`--weights-allowed-dirs`: knobs ALLOWED_LOCAL_DIRS, LORA_ALLOWED_DIRS, WEIGHTS_ALLOWED_DIRS; weight updates also
from the stack's upload directory, WEIGHTS_UPLOAD_DIR), resolved (no `..`, no symlink that leads out), and only
regular files (a FIFO or a device would block the engine that opens it). Checked in the engine's HTTP process,
off the event loop and under a timeout, before the op reaches the engine's step loop. A path outside the allowed
places gets the same answer whether it exists or not.
"""
from __future__ import annotations

import asyncio
import os
import stat

from services import knobs

from .errors import APIError

CHECK_TIMEOUT_S = 10.0
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
        for entry in os.scandir(real):
            if entry.name.endswith(READ_SUFFIXES):
                inner = os.path.realpath(entry.path)
                if not _inside(inner, dirs) or not stat.S_ISREG(os.stat(inner).st_mode):
                    raise _refused(entry.path, kind, dirs)
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
