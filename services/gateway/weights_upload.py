"""A weight upload's body (POST /v1/rl/weights/upload) streamed into a file on the gateway's host: its
safetensors header read and checked first (a body that is no safetensors file, or one larger than
UPLOAD_MAX_BYTES, is refused before the rest is read), each piece within UPLOAD_READ_TIMEOUT_S, and exactly the
bytes the header declares."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from typing import AsyncIterator, Optional

from fastapi import Request

from services.base import knobs
from services.kit.errors import APIError

UPLOAD_MAX_BYTES = 64 << 30          # a whole 8B checkpoint; the route's own limit (the gateway's table: bodies.py)
UPLOAD_READ_TIMEOUT_S = 60.0         # between two pieces of an upload's body: a stalled body is cut (408)
MAX_HEADER_BYTES = 100 << 20         # safetensors' own bound on its JSON header


@contextlib.asynccontextmanager
async def received_upload(request: Request) -> AsyncIterator[str]:
    """The path of the request's body saved in a temporary directory (under knob WEIGHTS_UPLOAD_DIR), removed
    when the block ends."""
    tmp = tempfile.mkdtemp(prefix="u1serve-weights-", dir=knobs.WEIGHTS_UPLOAD_DIR.text() or None)
    try:
        path = os.path.join(tmp, "update.safetensors")
        await save_upload(request, path)
        yield path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _invalid(why: str) -> APIError:
    return APIError(400, f"the body must be a safetensors file: {why}", code="invalid_weights")


def _declared_size(header_len: int, raw: bytes) -> int:
    """The file size a safetensors header declares (8 + header + the tensors' bytes); 400 when it is not one."""
    try:
        header = json.loads(raw)
    except ValueError:
        raise _invalid("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _invalid("its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _invalid("a tensor's data_offsets are not two ordered byte offsets")
        end = max(end, offsets[1])
    return 8 + header_len + end


async def save_upload(request: Request, path: str) -> int:
    """Stream the body into `path`: its header read and checked first (a body that is no safetensors file, or
    one larger than UPLOAD_MAX_BYTES, is refused before the rest is read), each piece within
    UPLOAD_READ_TIMEOUT_S, and exactly the bytes the header declares. Returns the size."""
    pieces = request.stream().__aiter__()

    async def piece() -> Optional[bytes]:
        try:
            return await asyncio.wait_for(pieces.__anext__(), UPLOAD_READ_TIMEOUT_S)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise APIError(408, f"the upload sent nothing for {UPLOAD_READ_TIMEOUT_S:g} s", code="upload_timeout") \
                from None
    head = bytearray()
    while len(head) < 8 or len(head) < 8 + int.from_bytes(head[:8], "little"):
        if len(head) >= 8 and not 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER_BYTES:
            raise _invalid("its header length is out of bounds")
        chunk = await piece()
        if chunk is None:
            raise _invalid("the body ends inside its header")
        head += chunk
    n = int.from_bytes(head[:8], "little")
    total = _declared_size(n, bytes(head[8:8 + n]))
    if total > UPLOAD_MAX_BYTES:
        raise APIError(413, f"the file's header declares {total} bytes; uploads take at most {UPLOAD_MAX_BYTES}",
                       code="request_too_large")
    size = len(head)
    with open(path, "wb") as f:
        f.write(head)
        while size <= total:
            chunk = await piece()
            if chunk is None:
                break
            size += len(chunk)
            if size > total:
                break
            await asyncio.to_thread(f.write, chunk)
    if size != total:
        raise _invalid(f"its header declares {total} bytes, the body has {'more' if size > total else size}")
    return size
