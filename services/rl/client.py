"""The trainers' only way into the serving stack: its public HTTP API (docs/rl.md), so a trainer works the same
against a local stack or a remote cluster. Errors come back as `RLAPIError` with the server's OpenAI-style
message."""
from __future__ import annotations

import base64
import http.client
import json
import os
import urllib.parse
from typing import Optional

import httpx
import torch

DEFAULT_TIMEOUT_S = 600.0
READ_BYTES = 8 << 20          # one readinto of a trajectory fetch
FETCH_RESUMES = 3              # a trajectory fetch cut mid-way resumes with a Range request this many times


class RLAPIError(RuntimeError):
    def __init__(self, status: int, message: str, body: str = ""):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body


class Trajectory:
    """GET /v1/rl/trajectories/{id}: latents [S, N+1, 3, H, W] f32, timesteps [N+1], logprobs [S, N] (NaN on ODE
    steps), sde_mask [N] uint8, and the rollout parameters (safetensors metadata)."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict):
        self.latents = tensors["latents"]
        self.timesteps = tensors["timesteps"]
        self.logprobs = tensors["logprobs"]
        self.sde_mask = tensors["sde_mask"]
        self.metadata = metadata


class RLClient:
    def __init__(self, base: str, api_key: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 admin_key: Optional[str] = None):
        """`api_key`: the tenant key (rollouts, scores, trajectories); `admin_key`: the operator key the weight
        updates need on a keyed stack (services/gateway/roles.py; default: `api_key`, as on a keyless one)."""
        base = base.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)
        self._headers, self.timeout = headers, timeout
        self._prefix = urllib.parse.urlsplit(self.base).path.rstrip("/")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RLClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise RLAPIError(r.status_code, message, r.text)
        return r

    # ------------------------------------------------------------------------------------------- rollout/score
    def rollout(self, body: dict) -> dict:
        return self._check(self.http.post("/v1/rl/rollout", json=body)).json()

    def score(self, body: dict) -> dict:
        return self._check(self.http.post("/v1/rl/score", json=body)).json()

    def trajectory_buffer(self, trajectory_id: str) -> torch.Tensor:
        """The trajectory's safetensors bytes, read from the socket straight into one preallocated uint8 tensor
        (its Content-Length; http.client's readinto: no intermediate chunk objects, 3x less CPU per byte than
        httpx's 64 KiB chunks). A transfer cut mid-way resumes where it stopped (`Range`), up to
        FETCH_RESUMES times."""
        path = f"/v1/rl/trajectories/{trajectory_id}"
        buf: Optional[torch.Tensor] = None
        pos, resumes = 0, 0
        while True:
            conn = self._connection()
            try:
                conn.request("GET", self._prefix + path, headers={**self._headers, "accept-encoding": "identity",
                                                                  **({} if buf is None else {"range": f"bytes={pos}-"})})
                r = conn.getresponse()
                if r.status >= 400:
                    body = r.read()
                    self._check(httpx.Response(r.status, content=body))
                if buf is None:
                    buf = torch.empty(int(r.headers["content-length"]), dtype=torch.uint8)
                    view = memoryview(buf.numpy())
                elif r.status != 206 or r.headers.get("content-range") != f"bytes {pos}-{len(view) - 1}/{len(view)}":
                    raise RLAPIError(502, f"resuming {path} at byte {pos}: the server answered {r.status} "
                                     f"{r.headers.get('content-range')!r}, not 206 for bytes {pos}-{len(view) - 1}"
                                     f"/{len(view)}")
                while pos < len(view):
                    got = r.readinto(view[pos:pos + READ_BYTES])
                    if not got:
                        break
                    pos += got
            except (OSError, http.client.HTTPException) as exc:
                if buf is None:
                    raise RLAPIError(503, f"fetching {path}: {type(exc).__name__}: {exc}") from None
            finally:
                conn.close()
            if pos == buf.numel():
                return buf
            resumes += 1
            if resumes > FETCH_RESUMES:
                raise RLAPIError(502, f"fetching {path}: the transfer was cut {resumes} times ({FETCH_RESUMES} "
                                 f"resumes), {pos} of {buf.numel()} bytes read")

    def _connection(self) -> http.client.HTTPConnection:
        u = urllib.parse.urlsplit(self.base)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        return cls(u.hostname, u.port, timeout=self.timeout)

    def trajectory_bytes(self, trajectory_id: str) -> bytes:
        return self.trajectory_buffer(trajectory_id).numpy().tobytes()

    def trajectory(self, trajectory_id: str) -> Trajectory:
        """The trajectory's tensors as views of the one fetched buffer (no second copy)."""
        tensors, metadata = parse_safetensors(self.trajectory_buffer(trajectory_id))
        return Trajectory(tensors, metadata)

    def delete_trajectory(self, trajectory_id: str) -> None:
        r = self.http.delete(f"/v1/rl/trajectories/{trajectory_id}")
        if r.status_code != 404:
            self._check(r)

    # ------------------------------------------------------------------------------------------- weights
    def weights(self) -> dict:
        return self._check(self.http.get("/v1/rl/weights")).json()

    def push_weights(self, path: str, version: Optional[str] = None) -> dict:
        """The engines read `path` (a directory of safetensors under the checkpoint's key names) themselves."""
        body = {"path": os.path.abspath(path)}
        if version is not None:
            body["version"] = version
        return self._check(self.http.post("/v1/rl/weights", json=body, headers=self._admin)).json()

    def upload_weights(self, file_path: str, version: Optional[str] = None) -> dict:
        """The same update with the file as the body (a remote stack that cannot read our disk)."""
        params = {"version": version} if version is not None else {}
        with open(file_path, "rb") as f:
            data = f.read()
        return self._check(self.http.post("/v1/rl/weights/upload", params=params, content=data,
                                          headers={"Content-Type": "application/octet-stream", **self._admin})).json()

    # ------------------------------------------------------------------------------------------- plain images
    def images(self, body: dict) -> dict:
        return self._check(self.http.post("/v1/images/generations", json=body)).json()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def parse_safetensors(buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """A safetensors file held in a uint8 tensor -> ({name: tensor viewing `buf`}, decoded metadata). The views
    share `buf`'s memory (safetensors' own loaders copy every tensor out of the bytes); a tensor whose offset is
    not aligned to its dtype (never in the server's layout) is copied."""
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    header = json.loads(buf[8:8 + n].numpy().tobytes())
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        raw = buf[base + a:base + b]
        if (base + a) % raw.new_empty(0, dtype=dtype).element_size():
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape(info["shape"])
    return tensors, _decoded(header.get("__metadata__") or {})


def _decoded(meta: dict) -> dict:
    """The safetensors metadata, JSON strings decoded where they are JSON."""
    out = {}
    for k, v in meta.items():
        try:
            out[k] = json.loads(v)
        except (TypeError, ValueError):
            out[k] = v
    return out


def b64_image_to_tensor(b64: str) -> torch.Tensor:
    """A base64 PNG/WebP/JPEG -> [3, H, W] float in [0, 1]."""
    import io

    import numpy as np
    from PIL import Image
    img = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255.0


__all__ = ["RLClient", "RLAPIError", "Trajectory", "b64_image_to_tensor", "parse_safetensors"]
