"""Rollouts recording into shared memory (services/generation/shared_trajectory.py), in process on the tiny
checkpoint: an engine whose rank 0 has trajectory segments (as served) gives results that name a segment instead of
carrying the array, and the array the HTTP side maps is bit for bit the one recorded without segments; a job
aborted mid-rollout (and one whose admission fails after its segment was made) leaves no segment behind. CPU by
default; on a CUDA device too where one is present (the segment pinned, the copies on the copy stream)."""
from __future__ import annotations

import os

import numpy as np
import pytest

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


def rollouts(model, pre, segs=None) -> dict:
    engines = engines_of(model)
    engines.primary.trajectory_segments = segs
    for rid in GROUPS:
        admit(engines, rollout_spec(rid, pre), pre)
    out = {}
    while engines.running:
        finished, _ = engines.step()
        for job in finished:
            out[job.request_id] = job.rl.results(job)
            job.free()
    return out


def test_the_mapped_trajectory_is_the_recorded_one_bit_for_bit(setup, segments):
    model, pre = setup
    want = rollouts(model, pre)
    got = rollouts(model, pre, segments)
    assert len(live(segments)) == len(GROUPS)                       # handed over: the HTTP side's now
    for rid, res in got.items():
        assert res.pixels is None and res.segment is not None      # the message carries no bytes
        name = res.segment.name
        mapped = adopt(res, wanted=True)
        segments.held(name)
        assert mapped.logprobs == want[rid].logprobs
        assert mapped.pixels.dtype == np.float32 and np.array_equal(mapped.pixels, want[rid].pixels)
        mapped.mapping.release()
    assert live(segments) == []


def test_an_aborted_rollout_and_a_failed_admission_unlink_their_segment(setup, segments):
    model, pre = setup
    engines = engines_of(model)
    engines.primary.trajectory_segments = segments
    rid = next(iter(GROUPS))
    admit(engines, rollout_spec(rid, pre), pre)
    engines.step()
    assert len(live(segments)) == 1                                 # made at admission, the states written into it
    engines.abort(rid)
    assert live(segments) == []
    spec = rollout_spec(rid, pre)
    with pytest.raises(RuntimeError):                              # its KV buffer cannot be allocated (PiBs)
        engines.primary._new_job(spec, {b: 1 << 40 for b in spec.handles}, {b: 0 for b in spec.handles})
    assert live(segments) == []
