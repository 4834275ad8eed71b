"""The trainers' only way into the serving stack: its public HTTP API (docs/rl.md), so a trainer works the same
against a local stack or a remote cluster. Errors come back as `RLAPIError` with the server's OpenAI-style
message."""
from __future__ import annotations

import base64
import json
import os
from typing import Optional

import httpx
import torch
from safetensors.torch import load as load_safetensors

DEFAULT_TIMEOUT_S = 600.0


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
    def __init__(self, base: str, api_key: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S):
        base = base.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)

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

    def trajectory_bytes(self, trajectory_id: str) -> bytes:
        return self._check(self.http.get(f"/v1/rl/trajectories/{trajectory_id}")).content

    def trajectory(self, trajectory_id: str) -> Trajectory:
        raw = self.trajectory_bytes(trajectory_id)
        return Trajectory(load_safetensors(raw), _metadata(raw))

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
        return self._check(self.http.post("/v1/rl/weights", json=body)).json()

    def upload_weights(self, file_path: str, version: Optional[str] = None) -> dict:
        """The same update with the file as the body (a remote stack that cannot read our disk)."""
        params = {"version": version} if version is not None else {}
        with open(file_path, "rb") as f:
            data = f.read()
        return self._check(self.http.post("/v1/rl/weights/upload", params=params, content=data,
                                          headers={"Content-Type": "application/octet-stream"})).json()

    # ------------------------------------------------------------------------------------------- plain images
    def images(self, body: dict) -> dict:
        return self._check(self.http.post("/v1/images/generations", json=body)).json()


def _metadata(raw: bytes) -> dict:
    """The safetensors header's __metadata__ (JSON strings decoded where they are JSON)."""
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n]).get("__metadata__", {}) or {}
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


__all__ = ["RLClient", "RLAPIError", "Trajectory", "b64_image_to_tensor"]
