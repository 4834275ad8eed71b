"""Tenant-on-tenant attempts for bench_load's hostile mix (issue 37): with two tenant keys (A, B) and an operator
key, tenant A makes a rollout that keeps its trajectory; hostile clients then act as tenant B against the stack and
A's trajectory. The contract (docs/deployment.md "Tenants and the operator"):

    tenant B pushes weights (JSON or upload), loads or unloads an adapter  -> 403 (operator routes)
    tenant B reads, fetches with Range, scores or deletes A's trajectory   -> 404 (as if it did not exist)
    the operator key on A's trajectory (a tenant route)                      -> 403 or 404, never the bytes
    the operator loads an adapter from a path it may not read                -> a 4xx other than 401 / 403 (it may)
    tenant A reads its own trajectory after all of it                        -> 200 (B deleted nothing)

Every attempt is an Outcome of its own kind (bench_load reports counts per kind); `tenant_problems` names any
5xx, anything of A that B or the operator could see or change, and any status off the contract.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import httpx

ATTEMPTS = ("b_push_weights", "b_upload_weights", "b_load_adapter", "b_unload_adapter", "b_read_trajectory",
            "b_range_trajectory", "b_score_trajectory", "b_delete_trajectory", "operator_read_trajectory",
            "operator_load_adapter")
CHECKS = ("a_rollout", "a_reads_own")          # tenant A's own calls around the attempts
TENANT_KINDS = ATTEMPTS + CHECKS
EXPECTED = {**{k: {403} for k in ("b_push_weights", "b_upload_weights", "b_load_adapter", "b_unload_adapter")},
            **{k: {404} for k in ("b_read_trajectory", "b_range_trajectory", "b_score_trajectory",
                                  "b_delete_trajectory")},
            "operator_read_trajectory": {403, 404}, "a_rollout": {200}, "a_reads_own": {200}}
# a tiny rollout that keeps its trajectory (the CPU smoke's geometry; the score request repeats it)
SAMPLING = {"prompts": [{"prompt": "a red cat"}], "group_size": 1, "size": "64x64", "num_inference_steps": 2,
            "guidance_scale": 2.0, "timestep_shift": 3.0}
ROLLOUT = {**SAMPLING, "seed": 5, "return_trajectory": True, "return_images": False}


@dataclass(frozen=True)
class TenantKeys:
    a: str                 # the victim: makes the trajectory
    b: str                 # the hostile tenant
    operator: str


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def make_trajectory(http: httpx.AsyncClient, keys: TenantKeys) -> tuple[int, Optional[str]]:
    """Tenant A's rollout: (status, trajectory id or None)."""
    r = await http.post("/v1/rl/rollout", json=ROLLOUT, headers=_auth(keys.a))
    return r.status_code, (r.json().get("trajectory_id") if r.status_code == 200 else None)


def next_attempt():
    """An endless round of the attempts (every kind runs before one repeats)."""
    return itertools.cycle(ATTEMPTS).__next__


async def attempt(http: httpx.AsyncClient, keys: TenantKeys, kind: str, tid: str) -> httpx.Response:
    """One attempt of `kind` against tenant A's trajectory `tid`."""
    b, op = _auth(keys.b), _auth(keys.operator)
    traj = f"/v1/rl/trajectories/{tid}"
    if kind == "b_push_weights":
        return await http.post("/v1/rl/weights", json={"path": "/tmp/poisoned-norm", "version": "evil-1"}, headers=b)
    if kind == "b_upload_weights":
        return await http.post("/v1/rl/weights/upload", content=b"\0" * 4096,
                               headers={**b, "content-type": "application/octet-stream"})
    if kind == "b_load_adapter":
        return await http.post("/v1/load_lora_adapter", json={"lora_name": "b-evil", "lora_path": "/etc"}, headers=b)
    if kind == "b_unload_adapter":
        return await http.post("/v1/unload_lora_adapter", json={"lora_name": "a-adapter"}, headers=b)
    if kind == "b_read_trajectory":
        return await http.get(traj, headers=b)
    if kind == "b_range_trajectory":
        return await http.get(traj, headers={**b, "range": "bytes=0-63"})
    if kind == "b_score_trajectory":
        return await http.post("/v1/rl/score", json={**SAMPLING, "trajectory_id": tid}, headers=b)
    if kind == "b_delete_trajectory":
        return await http.delete(traj, headers=b)
    if kind == "operator_read_trajectory":
        return await http.get(traj, headers=op)
    if kind == "operator_load_adapter":
        return await http.post("/v1/load_lora_adapter", json={"lora_name": "op-check", "lora_path": "/nonexistent/x"},
                               headers=op)
    if kind == "a_reads_own":
        return await http.get(traj, headers={**_auth(keys.a), "range": "bytes=0-63"})
    raise ValueError(f"unknown tenant attempt {kind!r}")


def allowed(kind: str, status: int) -> bool:
    """The status is what the contract gives this kind (a 206 of A's own Range read counts as its 200; a 429, the
    stack refusing for load, shows nothing either)."""
    if status == 429 and kind in ATTEMPTS:
        return True
    if kind == "operator_load_adapter":
        return 400 <= status < 500 and status not in (401, 403)
    if kind == "a_reads_own":
        return status in (200, 206)
    return status in EXPECTED[kind]


def tenant_problems(summary_hostile: dict) -> list[str]:
    """From bench_load's per-kind hostile summary: 5xx, anything of A another key saw or changed, a status off the
    contract, an attempt kind that never ran."""
    out = []
    for kind in TENANT_KINDS:
        k = summary_hostile.get(kind)
        if not k:
            out.append(f"no tenant attempt {kind} ran")
            continue
        for status, n in k["statuses"].items():
            s = int(status)
            if s >= 500:
                out.append(f"{kind}: {n} x {s}")
            elif kind.startswith(("b_", "operator_read")) and 200 <= s < 300:
                out.append(f"{kind}: {n} x {s}: tenant A's trajectory or the stack's weights/adapters were "
                           "reachable with another key")
            elif not allowed(kind, s):
                out.append(f"{kind}: {n} x {s}, expected {sorted(EXPECTED.get(kind, {'4xx but 401/403'}))}")
    return out
