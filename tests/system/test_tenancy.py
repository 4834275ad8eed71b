"""Tenants and the operator (issue 37) through a real `u1serve up` stack (tiny checkpoint, CPU) with two tenant
keys and one operator key: each key works only on its own routes, trajectories belong to the key that made them
(any other key gets the 404 of an id never stored, for read, Range, score and delete), adapters and weights load
only from the allowed directories and only regular files (a FIFO is refused at once, the engines keep serving),
sizes are refused before any job, a huge Range number is a 416, a gateway without --enable-rl /
--enable-runtime-lora serves neither. No answer is a 5xx."""
import json
import os
import re
import struct
import time

import httpx
import pytest

from services.model.tiny_lora import write_tiny_lora

TENANT_A, TENANT_B, OPERATOR = "sk-tenant-a", "sk-tenant-b", "sk-operator"
BODY = {"prompts": [{"prompt": "a red cat"}], "group_size": 1, "size": "64x64", "num_inference_steps": 2,
        "guidance_scale": 2.0, "seed": 3}
MAX_PIXEL_STEPS = 64 * 64 * 2 * 8           # 8 samples of BODY's size and steps


@pytest.fixture(scope="module")
def tenancy_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import ONE_THREAD, RunningStack
    d = tmp_path_factory.mktemp("tenancy")
    allowed = d / "allowed"
    allowed.mkdir()
    tiny = tiny_checkpoint("u1")
    (d / "keys").write_text(f"# the tenants\n{TENANT_A}\n\n{TENANT_B}\n")
    (d / "admin").write_text(f"# the operator\n{OPERATOR}\n")
    s = RunningStack(tiny, "colocate", str(d), extra=[
        "--api-key-file", str(d / "keys"), "--admin-api-key-file", str(d / "admin"), "--enable-rl",
        "--enable-runtime-lora", "--max-loras", "1", "--max-lora-rank", "8", "--allowed-local-dirs", str(allowed),
        "--gateway-args", f"--rl-max-pixel-steps {MAX_PIXEL_STEPS} --rl-max-trajectory-mb 1"],
        env=ONE_THREAD).wait_ready()                     # compared only with itself
    s.allowed, s.outside, s.tiny = allowed, d, tiny
    yield s
    s.stop_clean()
    answers = "".join(open(os.path.join(d, "logs", name)).read() for name in os.listdir(d / "logs"))
    assert not re.findall(r".*-> 5\d\d .*", answers), "a 5xx answer"
    assert "Traceback" not in answers


def client(stack, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=stack.base, timeout=180, headers=headers)


@pytest.fixture(scope="module")
def clients(tenancy_stack):
    cs = {k: client(tenancy_stack, k) for k in (TENANT_A, TENANT_B, OPERATOR, None)}
    yield cs
    for c in cs.values():
        c.close()


def error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status and r.json()["error"]["code"] == code, (r.status_code, r.text)


def test_each_key_works_only_on_its_own_routes(clients):
    a, op, anon = clients[TENANT_A], clients[OPERATOR], clients[None]
    upd = {"path": "/nonexistent", "version": "v9"}
    error(anon.post("/v1/rl/weights", json=upd), 401, "invalid_api_key")
    error(a.post("/v1/rl/weights", json=upd), 403, "operator_key_required")
    error(a.post("/v1/rl/weights/upload", content=b"x" * 64), 403, "operator_key_required")
    error(a.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}), 403, "operator_key_required")
    error(a.post("/v1/unload_lora_adapter", json={"lora_name": "x"}), 403, "operator_key_required")
    chat = {"model": "sensenova-u1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    error(op.post("/v1/chat/completions", json=chat), 403, "tenant_key_required")
    error(op.post("/v1/rl/rollout", json=BODY), 403, "tenant_key_required")
    error(op.get("/v1/rl/trajectories/traj-x"), 403, "tenant_key_required")
    assert op.get("/v1/models").status_code == 200 and op.get("/v1/rl/weights").status_code == 200
    assert a.post("/v1/chat/completions", json=chat).status_code == 200
    assert a.get("/v1/rl/weights").json()["weights_version"] == "0"      # nothing changed


def test_a_trajectory_is_its_owners_alone(clients):
    a, b = clients[TENANT_A], clients[TENANT_B]
    r = a.post("/v1/rl/rollout", json=BODY)
    assert r.status_code == 200, r.text
    tid = r.json()["trajectory_id"]
    whole = a.get(f"/v1/rl/trajectories/{tid}")
    assert whole.status_code == 200 and len(whole.content) > 8
    for attempt in (b.get(f"/v1/rl/trajectories/{tid}"),
                    b.get(f"/v1/rl/trajectories/{tid}", headers={"Range": "bytes=0-7"}),
                    b.post("/v1/rl/score", json={**BODY, "trajectory_id": tid}),
                    b.delete(f"/v1/rl/trajectories/{tid}")):
        error(attempt, 404, "trajectory_not_found")
        assert tid in attempt.json()["error"]["message"] and "owner" not in attempt.json()["error"]["message"]
    never = b.get("/v1/rl/trajectories/traj-0000")                 # the same answer as for an id never stored
    assert never.json()["error"]["message"].replace("traj-0000", tid) == \
        b.get(f"/v1/rl/trajectories/{tid}").json()["error"]["message"]
    part = a.get(f"/v1/rl/trajectories/{tid}", headers={"Range": "bytes=0-7"})
    assert part.status_code == 206 and part.content == whole.content[:8]
    huge = a.get(f"/v1/rl/trajectories/{tid}", headers={"Range": "bytes=" + "9" * 4300 + "-"})
    error(huge, 416, "range_not_satisfiable")
    assert a.get(f"/v1/rl/trajectories/{tid}", headers={"Range": "bytes=0-" + "9" * 4300}).content == whole.content
    assert a.post("/v1/rl/score", json={**BODY, "trajectory_id": tid}).status_code == 200   # B took nothing
    assert a.delete(f"/v1/rl/trajectories/{tid}").status_code == 200
    error(a.get(f"/v1/rl/trajectories/{tid}"), 404, "trajectory_not_found")


def test_sizes_are_refused_before_any_job(tenancy_stack, clients):
    a = clients[TENANT_A]
    started = time.monotonic()
    r = a.post("/v1/rl/rollout", json={**BODY, "group_size": 16})
    error(r, 413, "rl_compute_too_large")
    assert "--rl-max-pixel-steps" in r.json()["error"]["message"]
    r = a.post("/v1/rl/rollout", json={**BODY, "group_size": 8, "size": "64x64"})     # 8 x 3 x 3 x 64 x 64 x 4 > 1 MB
    error(r, 413, "trajectory_too_large")
    assert "--rl-max-trajectory-mb" in r.json()["error"]["message"]
    assert time.monotonic() - started < 10
    gen = httpx.get(f"http://127.0.0.1:{tenancy_stack.gen_port}/health", timeout=5).json()
    assert gen["rl_trajectories"]["trajectories"] == 0


def test_adapters_and_weights_load_only_from_allowed_regular_files(tenancy_stack, clients):
    op = clients[OPERATOR]
    inside = write_tiny_lora(str(tenancy_stack.allowed / "good"), tenancy_stack.tiny, seed=5, rank=4)
    outside = write_tiny_lora(str(tenancy_stack.outside / "outside"), tenancy_stack.tiny, seed=6, rank=4)
    os.symlink(outside, tenancy_stack.allowed / "link-out")
    fifo = tenancy_stack.allowed / "fifo.safetensors"
    os.mkfifo(fifo)
    answers = {}
    for name, path in (("outside", outside), ("missing-outside", "/etc/u1serve-nothing-here"),
                       ("etc", "/etc/passwd"), ("symlink", str(tenancy_stack.allowed / "link-out")),
                       ("dotdot", str(tenancy_stack.allowed / ".." / "outside")), ("fifo", str(fifo))):
        started = time.monotonic()
        r = op.post("/v1/load_lora_adapter", json={"lora_name": f"x-{name}", "lora_path": path})
        error(r, 400, "path_not_allowed")
        assert time.monotonic() - started < 15, name                     # a FIFO never blocks an engine
        answers[name] = r.json()["error"]["message"].replace(path[:200], "P")
    assert len(set(answers.values())) == 1, answers                      # nothing tells what exists outside
    r = op.post("/v1/rl/weights", json={"path": "/etc"})
    error(r, 400, "path_not_allowed")
    (tenancy_stack.outside / "w.safetensors").write_bytes(b"outside")
    for name, shard in (("index-out", str(tenancy_stack.outside / "w.safetensors")), ("index-fifo", "w.bin")):
        indexed = tenancy_stack.allowed / name     # a safetensors index naming a shard outside, or a FIFO
        indexed.mkdir()
        if shard == "w.bin":
            os.mkfifo(indexed / shard)
        (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"k": shard}}))
        started = time.monotonic()
        error(op.post("/v1/rl/weights", json={"path": str(indexed)}), 400, "path_not_allowed")
        assert time.monotonic() - started < 15, name
    r = op.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": inside})
    assert r.status_code == 200, r.text
    assert op.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
    chat = {"model": "sensenova-u1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert clients[TENANT_B].post("/v1/chat/completions", json=chat).status_code == 200


def upload(op, blob: bytes, **params) -> httpx.Response:
    return op.post("/v1/rl/weights/upload", content=blob, params=params,
                   headers={"content-type": "application/octet-stream"})


def test_weight_uploads_check_the_header_first(clients):
    op = clients[OPERATOR]
    error(upload(op, b""), 400, "invalid_weights")
    error(upload(op, struct.pack("<Q", 1 << 40) + b"{}"), 400, "invalid_weights")
    declares_too_much = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,' + str(1 << 50).encode() + b']}}'
    error(upload(op, struct.pack("<Q", len(declares_too_much)) + declares_too_much), 413, "request_too_large")
    short = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    error(upload(op, struct.pack("<Q", len(short)) + short + b"\0" * 4), 400, "invalid_weights")
    assert op.get("/v1/rl/weights").json()["weights_version"] == "0"


def test_lora_factors_are_checked_before_any_product(tenancy_stack, clients):
    """A rank-0 adapter and a delta whose factors do not fit the weight are 400s (loaded or as an update)."""
    import torch
    from safetensors.torch import load_file, save_file
    official = write_tiny_lora(str(tenancy_stack.allowed / "base.safetensors"), tenancy_stack.tiny, seed=7, rank=4,
                               layout="official")
    tensors = load_file(official)
    module = next(k for k in tensors if k.endswith(".lora_down.weight"))[: -len(".lora_down.weight")]
    down, up = tensors[module + ".lora_down.weight"], tensors[module + ".lora_up.weight"]
    bad = {"rank0": {module + ".lora_down.weight": torch.zeros(0, down.shape[1]),
                     module + ".lora_up.weight": torch.zeros(up.shape[0], 0)},
           "wide": {module + ".lora_down.weight": torch.zeros(4, down.shape[1] + 512),
                    module + ".lora_up.weight": torch.zeros(up.shape[0] + 512, 4)}}
    op = clients[OPERATOR]
    for name, t in bad.items():
        path = str(tenancy_stack.allowed / f"{name}.safetensors")
        save_file(t, path)
        r = op.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 400, r.text
        r = op.post("/v1/rl/weights", json={"lora": path})
        error(r, 400, "invalid_weights")
        with open(path, "rb") as f:
            error(upload(op, f.read(), kind="lora"), 400, "invalid_weights")
    assert op.get("/v1/rl/weights").json()["weights_version"] == "0"


def test_a_gateway_without_the_switches_serves_neither(tenancy_stack, side_gateway, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(TENANT_A + "\n")
    g = side_gateway(f"http://127.0.0.1:{tenancy_stack.und_port}", f"http://127.0.0.1:{tenancy_stack.gen_port}",
                     "--api-key-file", str(keys), env={"U1SERVE_INTERNAL_TOKEN": tenancy_stack.token})
    with httpx.Client(base_url=g.base, timeout=30, headers={"Authorization": f"Bearer {TENANT_A}"}) as c:
        error(c.post("/v1/rl/rollout", json=BODY), 404, "rl_disabled")
        error(c.get("/v1/rl/trajectories/traj-x"), 404, "rl_disabled")
        error(c.post("/v1/rl/weights", json={"path": "/x"}), 404, "rl_disabled")
        error(c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}), 404,
              "runtime_lora_disabled")


def tenant_a_gateway(stack, side_gateway, tmp_path, *flags):
    """A gateway of its own in front of the stack's engines: tenant A's key only, RL on, `flags` (one limit)."""
    keys = tmp_path / "keys"
    keys.write_text(TENANT_A + "\n")
    return side_gateway(f"http://127.0.0.1:{stack.und_port}", f"http://127.0.0.1:{stack.gen_port}",
                        "--api-key-file", str(keys), "--enable-rl", *flags,
                        env={"U1SERVE_INTERNAL_TOKEN": stack.token})


def test_rl_routes_count_against_admission(tenancy_stack, side_gateway, tmp_path):
    """A rollout holds an admission slot as an image does: with one slot, a second RL request meanwhile is a 429."""
    import threading
    g = tenant_a_gateway(tenancy_stack, side_gateway, tmp_path, "--max-concurrent-requests", "1")
    with httpx.Client(base_url=g.base, timeout=180, headers={"Authorization": f"Bearer {TENANT_A}"}) as c:
        for _ in range(3):          # a probe can take the one slot before the rollout's request arrives: again
            first = {}
            t = threading.Thread(target=lambda: first.update(r=c.post("/v1/rl/rollout", json={
                **BODY, "num_inference_steps": 40, "return_trajectory": False})))
            t.start()
            time.sleep(0.2)
            deadline = time.monotonic() + 60
            second = None
            while time.monotonic() < deadline and t.is_alive():
                second = c.post("/v1/rl/score", json={**BODY, "trajectory_id": "traj-none"})
                if second.status_code == 429:
                    break
                time.sleep(0.05)
            t.join(180)
            if first["r"].status_code != 429:
                break
        assert first["r"].status_code == 200, first["r"].text
        assert second is not None and second.status_code == 429, second.text if second is not None else None


def test_the_score_body_limit_is_what_generation_takes():
    from services.contract.rl import MAX_SCORE_BODY_BYTES, MAX_TRAJECTORY_UPLOAD_BYTES
    from services.gateway.bodies import body_rules
    from services.gateway.config import GatewayConfig
    from services.generation.routers.rl import MAX_UPLOAD_BYTES
    limit = body_rules(GatewayConfig()).rule("/v1/rl/score").max_bytes
    assert MAX_UPLOAD_BYTES == MAX_TRAJECTORY_UPLOAD_BYTES and limit == MAX_SCORE_BODY_BYTES
    assert MAX_UPLOAD_BYTES * 4 / 3 < limit < MAX_UPLOAD_BYTES * 4 / 3 + (8 << 20)


def test_trajectory_fetches_are_bounded(tenancy_stack, side_gateway, tmp_path):
    """With one relay allowed, a fetch whose client reads nothing holds it: a second fetch is a 429 meanwhile, and
    is served once the first client goes away."""
    import socket
    g = tenant_a_gateway(tenancy_stack, side_gateway, tmp_path, "--rl-max-trajectory-fetches", "1")
    with httpx.Client(base_url=g.base, timeout=300, headers={"Authorization": f"Bearer {TENANT_A}"}) as c:
        r = c.post("/v1/rl/rollout", json={**BODY, "size": "256x256", "num_inference_steps": 4, "group_size": 8,
                                            "return_images": False})
        assert r.status_code == 200, r.text
        tid = r.json()["trajectory_id"]                  # 8 x 5 x 3 x 256 x 256 x 4 bytes: ~31 MB
        held = socket.create_connection(("127.0.0.1", g.port))
        held.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        held.sendall(f"GET /v1/rl/trajectories/{tid} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {TENANT_A}\r\n\r\n".encode())
        assert held.recv(12).startswith(b"HTTP/1.1 200")
        try:
            error(c.get(f"/v1/rl/trajectories/{tid}"), 429, "overloaded")
        finally:
            held.close()
        deadline = time.monotonic() + 30
        while (got := c.get(f"/v1/rl/trajectories/{tid}")).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got.status_code == 200 and len(got.content) > 30_000_000
        assert c.delete(f"/v1/rl/trajectories/{tid}").status_code == 200
