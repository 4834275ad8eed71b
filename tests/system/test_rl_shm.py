"""RL trajectories in shared memory through a real `u1serve up` stack (tiny checkpoint, CPU; a 24 MB trajectory store
so one 15.7 MB part fits and two do not): while a rollout runs its trajectory is a /dev/shm segment of the
generation server, and afterwards /dev/shm holds exactly the segments of the trajectories the store holds: none left
after a delete, an eviction, a trajectory the store refuses, a rollout whose client goes away, a server stop; and the
segments of a generation server killed with SIGKILL mid-rollout are reclaimed by its next start."""
import json
import os
import signal
import socket

import httpx
import pytest

from services.generation.shared_trajectory import segment_prefix
from shm_transfer.segment import SHM_DIR
from tests.waiting import wait_until

# 1 prompt x 4 samples x 20 states of 128²: 15.7 MB, one part
PART = {"prompts": [{"prompt": "a red cat"}], "group_size": 4, "size": "128x128", "num_inference_steps": 19,
        "guidance_scale": 2.0, "timestep_shift": 3.0, "seed": 5, "sde": {"kind": "flow", "steps": [0]},
        "return_images": False}
# 1 sample x 101 states of 128²: 19.9 MB, long enough to be cut or killed while it runs
LONG = {**PART, "group_size": 1, "num_inference_steps": 100}


@pytest.fixture(scope="module")
def shm_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import RunningStack
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("rl-shm")),
                     extra=["--enable-rl", "--gen-args", "--rl-trajectory-store-mb 24"])
    s.wait_ready()
    yield s
    if s.proc.poll() is None:
        s.stop_clean()        # no segment of the pool's prefix left either (stackproc's leak check)


def segments(stack) -> list[str]:
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(segment_prefix(stack.pool)))


def gen_health(stack) -> dict:
    return httpx.get(stack.gen + "/health", timeout=10).json()


def rollout(stack, body: dict) -> httpx.Response:
    return httpx.post(stack.base + "/v1/rl/rollout", json=body, timeout=300)


def stored(stack) -> int:
    return gen_health(stack)["rl_trajectories"]["trajectories"]


def test_delete_and_eviction_leave_exactly_the_stored_segments(shm_stack):
    a = rollout(shm_stack, PART)
    assert a.status_code == 200, a.text
    assert len(segments(shm_stack)) == 1 and stored(shm_stack) == 1
    b = rollout(shm_stack, {**PART, "seed": 6})                     # the store holds one: "a" is evicted
    assert b.status_code == 200, b.text
    assert len(segments(shm_stack)) == 1 and stored(shm_stack) == 1
    tid_a, tid_b = a.json()["trajectory_id"], b.json()["trajectory_id"]
    assert httpx.get(f"{shm_stack.base}/v1/rl/trajectories/{tid_a}", timeout=30).status_code == 404
    got = httpx.get(f"{shm_stack.base}/v1/rl/trajectories/{tid_b}", timeout=60)
    assert got.status_code == 200 and len(got.content) > 15 * (1 << 20)
    assert httpx.delete(f"{shm_stack.base}/v1/rl/trajectories/{tid_b}", timeout=30).status_code == 200
    assert segments(shm_stack) == [] and stored(shm_stack) == 0


def test_a_refused_trajectory_leaves_no_segment(shm_stack):
    r = rollout(shm_stack, {**PART, "prompts": [{"prompt": "a red cat"}, {"prompt": "a blue dog"}]})
    assert r.status_code == 413, r.text                              # its second part does not fit the store
    assert r.json()["error"]["code"] == "trajectory_too_large"
    assert wait_until(lambda: segments(shm_stack) == [] and stored(shm_stack) == 0, 30), segments(shm_stack)


def _start_long(stack) -> socket.socket:
    """A long rollout on a raw connection (closing it is a client going away); returns once it denoises."""
    body = json.dumps(LONG).encode()
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
    sock.sendall(b"POST /v1/rl/rollout HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_until(lambda: gen_health(stack)["running"] > 0, 120, interval=0.05)
    return sock


def test_an_aborted_rollout_leaves_no_segment(shm_stack):
    sock = _start_long(shm_stack)
    assert wait_until(lambda: len(segments(shm_stack)) == 1, 30)   # asked for at admission, made on a side thread
    sock.close()                                                    # the client goes away
    assert wait_until(lambda: gen_health(shm_stack)["running"] == 0 and segments(shm_stack) == [], 60, interval=0.1)
    assert stored(shm_stack) == 0


def test_a_killed_servers_segments_are_reclaimed_by_its_next_start(shm_stack):
    gen_pid = shm_stack.service_pids()["gen"]
    sock = _start_long(shm_stack)
    assert wait_until(lambda: len(segments(shm_stack)) == 1, 30)
    left = segments(shm_stack)
    os.killpg(gen_pid, signal.SIGKILL)                              # the HTTP process and its engine rank
    assert wait_until(lambda: gen_health_ok(shm_stack) and shm_stack.service_pids()["gen"] != gen_pid, 180), \
        shm_stack.output()
    shm_stack.pids = shm_stack.service_pids()
    sock.close()
    assert segments(shm_stack) == []                                # the new server's start unlinked it
    log = open(os.path.join(shm_stack.run_dir, "logs", "gen.log")).read()
    assert "reclaimed 1 RL trajectory segment(s) of dead processes" in log
    r = rollout(shm_stack, PART)                                    # and it serves rollouts
    assert r.status_code == 200, r.text
    assert len(segments(shm_stack)) == 1


def gen_health_ok(stack) -> bool:
    try:
        return httpx.get(stack.base + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stopped_server_leaves_no_segment(shm_stack):
    if not segments(shm_stack):
        assert rollout(shm_stack, PART).status_code == 200
    assert len(segments(shm_stack)) == 1                             # a stored trajectory at the stop
    shm_stack.stop_clean()
    assert segments(shm_stack) == []
