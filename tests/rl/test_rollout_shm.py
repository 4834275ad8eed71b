"""Rollouts recording into shared memory (services/generation/shared_trajectory.py), in process on the tiny
checkpoint: an engine whose rank 0 has trajectory segments (as served) gives results that name a segment instead of
carrying the array, and the array the HTTP side maps is bit for bit the one recorded without segments; a job
aborted mid-rollout (and one whose admission fails after its segment was made) leaves no segment behind.

The segments are made (and pinned) on a side thread: while it is behind, the states wait on the device and the loop
goes on (it waits only past rollout.WAITING_BYTES, all rollouts' states together, or at the end), with the same
bits; a segment the side thread cannot make fails that rollout alone (503); an abort or a stop while it is behind
leaves nothing. CPU by default; on a CUDA device too where one is present (the segment pinned, the copies on the
copy stream)."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from services.generation import rollout
from services.generation.protocol import JobFailed
from services.generation.shared_trajectory import TrajectorySegments, adopt, segment_prefix
from shm_transfer.segment import SHM_DIR
from tests.rl.test_rollout_batching import GROUPS, admit, engines_of, rollout_spec, setup  # noqa: F401 (fixture)


@pytest.fixture()
def segments():
    pool = f"u1test-rollout-{os.getpid()}"
    segs = TrajectorySegments(pool)
    yield segs
    segs.close()
    left = [e for e in os.listdir(SHM_DIR) if e.startswith(segment_prefix(pool))]
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, left


def live(segs: TrajectorySegments) -> list[str]:
    return [e for e in os.listdir(SHM_DIR) if e.startswith(segs.prefix)]


def started(model, pre, segs=None):
    """An engine set (recording into `segs` when given) with every group admitted: (engines, their jobs)."""
    engines = engines_of(model)
    engines.primary.trajectory_segments = segs
    return engines, [admit(engines, rollout_spec(rid, pre), pre) for rid in GROUPS]


def finish(engines) -> dict:
    """Step until nothing runs: {request_id: what the emitter would send for the job}."""
    out = {}
    while engines.running:
        finished, _ = engines.step()
        for job in finished:
            out[job.request_id] = job.rl.results(job)
            job.free()
    return out


def rollouts(model, pre, segs=None) -> dict:
    return finish(started(model, pre, segs)[0])


def hold(segs: TrajectorySegments) -> threading.Event:
    """Keep the segments' side thread busy until the returned event is set: what is asked of it meanwhile waits."""
    gate = threading.Event()
    segs._side.submit(gate.wait)
    return gate


def same_as_recorded(got: dict, want: dict, segs: TrajectorySegments) -> None:
    """Each result names a segment holding bit for bit the trajectory recorded without segments (then released)."""
    for rid, res in got.items():
        assert res.pixels is None and res.segment is not None      # the message carries no bytes
        name = res.segment.name
        mapped = adopt(res, wanted=True)
        segs.held(name)
        assert mapped.logprobs == want[rid].logprobs
        assert mapped.pixels.dtype == np.float32 and np.array_equal(mapped.pixels, want[rid].pixels)
        mapped.mapping.release()


def test_the_mapped_trajectory_is_the_recorded_one_bit_for_bit(setup, segments):
    model, pre = setup
    want = rollouts(model, pre)
    got = rollouts(model, pre, segments)
    assert len(live(segments)) == len(GROUPS)                       # handed over: the HTTP side's now
    same_as_recorded(got, want, segments)
    assert live(segments) == []


def test_an_aborted_rollout_and_a_failed_admission_unlink_their_segment(setup, segments):
    model, pre = setup
    engines = engines_of(model)
    engines.primary.trajectory_segments = segments
    rid = next(iter(GROUPS))
    admit(engines, rollout_spec(rid, pre), pre)
    engines.step()
    segments.settle()
    assert len(live(segments)) == 1                                 # asked for at admission, made on the side thread
    engines.abort(rid)
    segments.settle()                                               # (unlinked there too)
    assert live(segments) == []
    spec = rollout_spec(rid, pre)
    with pytest.raises(RuntimeError):                              # its KV buffer cannot be allocated (PiBs)
        engines.primary._new_job(spec, {b: 1 << 40 for b in spec.handles}, {b: 0 for b in spec.handles})
    segments.settle()
    assert live(segments) == []


def test_states_wait_on_the_device_while_the_side_thread_is_behind_with_the_same_bits(setup, segments):
    model, pre = setup
    want = rollouts(model, pre)
    gate = hold(segments)
    engines, jobs = started(model, pre, segments)
    engines.step()
    assert live(segments) == []                                     # none made yet: the loop did not wait for them
    assert [[k for k, _ in job.rl.trajectory.waiting] for job in jobs] == [[0, 1]] * len(jobs)
    gate.set()
    got = finish(engines)                                            # the waiting states go to their segments
    assert all(job.rl.trajectory is None for job in jobs)
    same_as_recorded(got, want, segments)
    segments.settle()
    assert live(segments) == []


def test_past_the_engines_device_budget_the_loop_waits_for_the_side_thread(setup, segments, monkeypatch):
    """The budget is the engine's, every rollout's waiting states together (the memory plan counts it once): with
    it at what the admitted rollouts' first states hold, no rollout alone is over it, yet the next state waits."""
    model, pre = setup
    want = rollouts(model, pre)
    gate = hold(segments)
    engines, jobs = started(model, pre, segments)
    assert all(len(job.rl.trajectory.waiting) == 1 for job in jobs) and len(jobs) > 1  # state 0, from admission
    held = segments.waiting_bytes
    assert held == sum(x.nbytes for job in jobs for _, x in job.rl.trajectory.waiting)
    monkeypatch.setattr(rollout, "WAITING_BYTES", held)
    threading.Timer(0.5, gate.set).start()
    t0 = time.monotonic()
    engines.step()                                                   # a state 1 waits for its segment
    assert time.monotonic() - t0 >= 0.45
    assert segments.waiting_bytes <= held
    same_as_recorded(finish(engines), want, segments)
    assert segments.waiting_bytes == 0


def test_a_segment_the_side_thread_cannot_make_fails_that_rollout_alone(setup, segments):
    model, pre = setup
    want = rollouts(model, pre)
    gate = hold(segments)
    engines, jobs = started(model, pre, segments)
    taken = os.path.join(SHM_DIR, jobs[0].rl.trajectory.shared.name)
    open(taken, "x").close()                                         # its name is taken meanwhile: Segment.create fails
    try:
        gate.set()
        got = finish(engines)
    finally:
        os.unlink(taken)
    failed = got.pop(jobs[0].request_id)
    assert isinstance(failed, JobFailed) and failed.error["status"] == 503
    assert failed.error["error"]["code"] == "trajectory_shm_full"
    same_as_recorded(got, {rid: want[rid] for rid in got}, segments)     # the others are whole
    segments.settle()
    assert live(segments) == [] and segments.waiting_bytes == 0      # the failed one's states let go too


def test_an_abort_and_a_stop_while_the_side_thread_is_behind_leave_nothing(setup, segments):
    model, pre = setup
    gate = hold(segments)
    engines, jobs = started(model, pre, segments)
    engines.step()
    held = segments.waiting_bytes
    engines.abort(jobs[0].request_id)                                # its segment is not made yet
    assert live(segments) == []
    assert segments.waiting_bytes < held                              # its waiting states are let go
    threading.Timer(0.2, gate.set).start()
    segments.close()                       # the engine stops with the others running: made, then unlinked, once
    assert live(segments) == []            # the side thread has done what was asked of it
