"""A rollout's trajectory in shared memory (services/generation/shared_trajectory.py), on real /dev/shm segments: the
engine's buffer is what the HTTP process maps (no copy), exactly one side unlinks each segment and a live process
holds a lock on it at every moment, the store unlinks what it stops holding (evicted, deleted, refused, replaced,
after the last stream of a deleted one, at close), a segment /dev/shm cannot hold is a 503 when it is asked for,
and the segments of a process killed with SIGKILL (made, handed over, or still to be made on its side thread) are
reclaimed by the next one while a live one's are never touched."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from safetensors.numpy import load

from services.generation.protocol import RlResult
from services.generation.shared_trajectory import SLOTS, TrajectorySegments, adopt, reclaim, segment_prefix
from services.generation.trajectory_store import Part, TrajectoryStore
from services.kit.errors import APIError
from shm_transfer.segment import SHM_DIR, probe

SHAPE = (2, 3, 3, 8, 8)


@pytest.fixture()
def pool(request):
    """A KV pool name of this test's own: its trajectory segments are exactly the /dev/shm names with its prefix."""
    name = f"u1test-traj-{os.getpid()}-{request.node.name[:40]}".replace("[", "-").replace("]", "")
    yield name
    left = segments_of(name)
    for n in left:
        os.unlink(os.path.join(SHM_DIR, n))
    assert not left, left


def segments_of(pool: str) -> list[str]:
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(segment_prefix(pool)))


def alive(name: str) -> bool:
    return probe(name, head=0, slots=SLOTS)[1]


def recorded(segs: TrajectorySegments, value: float, shape=SHAPE):
    """An engine-side buffer filled as the copies fill it, then handed over: the result message."""
    buf = segs.make(shape)
    buf.wait().copy_(torch.arange(np.prod(shape), dtype=torch.float32).view(shape) + value)
    return RlResult("r", [[None]], [1.0, 0.0], [], 1.0, "0", segment=buf.hand_over())


def stored_part(segs: TrajectorySegments, value: float) -> Part:
    msg = adopt(recorded(segs, value), wanted=True)
    segs.held(msg.segment.name)
    lp = np.zeros((SHAPE[0], SHAPE[1] - 1), dtype=np.float32)
    return Part(msg.pixels, lp, {"timesteps": [1.0, 0.5, 0.0], "sde_steps": [0]}, shared=msg.mapping)


def test_the_engine_buffer_is_the_stored_array_and_a_lock_holds_it_throughout(pool):
    segs = TrajectorySegments(pool)
    buf = segs.make(SHAPE)
    array = buf.wait()                                                    # made on the side thread
    name = buf.seg.name
    assert name.startswith(segment_prefix(pool)) and alive(name)          # the creator's lock
    want = torch.randn(SHAPE)
    array.copy_(want)
    del array
    msg = RlResult("r", [[None]], [1.0, 0.0], [], 1.0, "0", segment=buf.hand_over())
    assert msg.pixels is None and msg.segment.shape == SHAPE             # the message carries no bytes
    assert alive(name) and reclaim(pool) == []                            # handed over, still the engine's lock
    msg = adopt(msg, wanted=True)
    segs.held(name)                                                       # the engine lets its lock go
    assert alive(name) and reclaim(pool) == []                            # the HTTP process's lock now
    assert np.array_equal(msg.pixels, want.numpy()) and not msg.pixels.flags.writeable
    store = TrajectoryStore(1 << 20)
    lp = np.zeros((2, 2), dtype=np.float32)
    store.put("t", 0, Part(msg.pixels, lp, {"timesteps": [1.0, 0.5, 0.0], "sde_steps": [0]}, shared=msg.mapping))
    del msg
    assert segments_of(pool) == [name]
    assert store.delete("t") and segments_of(pool) == []


def test_a_result_nobody_wants_and_a_discarded_buffer_are_unlinked(pool):
    segs = TrajectorySegments(pool)
    msg = recorded(segs, 1.0)
    assert adopt(msg, wanted=False) is None and segments_of(pool) == []   # its job ended meanwhile
    segs.held(msg.segment.name)
    segs.make(SHAPE).discard()                                             # a job aborted before its result
    segs.settle()                                                          # (unlinked on the side thread)
    assert segments_of(pool) == []
    segs.make(SHAPE)                                                       # running when the engine stops
    recorded(segs, 2.0)                                                    # handed over: the HTTP process's
    segs.close()                          # unlinks the running one's; the handed one is nobody's now: reclaimed
    left = segments_of(pool)
    assert len(left) == 1 and reclaim(pool) == left and segments_of(pool) == []


def test_the_store_unlinks_what_it_stops_holding(pool):
    segs = TrajectorySegments(pool)
    nbytes = stored_part(segs, 0).nbytes
    assert segments_of(pool) == []                                          # an unstored part is freed (collected)
    store = TrajectoryStore(2 * nbytes + nbytes // 2)
    store.put("a", 0, stored_part(segs, 1))
    store.put("b", 0, stored_part(segs, 2))
    store.put("c", 0, stored_part(segs, 3))                               # evicts "a"
    assert len(segments_of(pool)) == 2
    store.put("c", 0, stored_part(segs, 4))                               # replaces c's first part
    store.put("c", 2, stored_part(segs, 5))                               # evicts "b"
    assert len(segments_of(pool)) == 2
    with pytest.raises(APIError) as e:
        store.put("c", 4, stored_part(segs, 6))                           # c alone would exceed the bound: refused
    assert e.value.status == 413 and len(segments_of(pool)) == 2
    reader = store.reader("c")
    assert store.delete("c") and len(segments_of(pool)) == 2              # streamed: kept until the stream ends
    assert store.stats()["draining_bytes"] == 2 * nbytes
    got = load(b"".join(reader.chunks(0, reader.blob.size)))["latents"]
    reader.close()
    assert segments_of(pool) == [] and store.stats()["draining_bytes"] == 0
    assert got[:, 0, 0, 0, 0].tolist() == [4, 580, 5, 581]                  # the stream read the mappings whole
    store.put("d", 0, stored_part(segs, 6))
    reader = store.reader("d")
    store.close()                                                          # server stop: every name goes
    assert segments_of(pool) == []
    reader.close()


def test_a_trajectory_shm_cannot_hold_is_a_503_and_leaves_nothing(pool):
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    side = int((free / 4 / 3) ** 0.5) + 64                                 # one state more than /dev/shm holds
    with pytest.raises(APIError) as e:
        TrajectorySegments(pool).make((1, 1, 3, side, side))
    assert e.value.status == 503 and e.value.code == "trajectory_shm_full" and "shm_size" in e.value.message
    assert segments_of(pool) == []


def test_the_room_check_counts_the_segments_still_to_be_made_and_an_abort_before_its_make_makes_nothing(pool):
    segs = TrajectorySegments(pool)
    gate = threading.Event()
    segs._side.submit(gate.wait)                                           # the side thread is behind
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    side = int((0.6 * free / 4 / 3) ** 0.5)                                # 60 % of /dev/shm a segment
    first = segs.make((1, 1, 3, side, side))                               # fits: asked for, not made yet
    with pytest.raises(APIError) as e:
        segs.make((1, 1, 3, side, side))                                   # fits /dev/shm alone, not beside it
    assert e.value.status == 503 and e.value.code == "trajectory_shm_full"
    first.discard()                                                        # aborted before the side thread got to it
    gate.set()
    segs.settle()
    assert segments_of(pool) == []
    small = segs.make(SHAPE)                                               # the room is back
    small.wait()
    assert len(segments_of(pool)) == 1
    segs.close()
    assert segments_of(pool) == []


def test_segments_of_a_killed_process_are_reclaimed_and_a_live_ones_never(pool):
    segs = TrajectorySegments(pool)
    mine = segs.make(SHAPE)
    child = textwrap.dedent(f"""
        import os, signal, sys, threading
        from services.generation.shared_trajectory import TrajectorySegments
        segs = TrajectorySegments({pool!r})
        bufs = [segs.make((1, 2, 3, 8, 8)) for _ in range(2)]
        bufs[1].hand_over()                       # one in flight to the HTTP process, one still recording
        segs.settle()
        segs._side.submit(threading.Event().wait)
        segs.make((1, 2, 3, 8, 8))                # one asked of the side thread, never made
        print("made", flush=True)
        sys.stdin.read()
        """)
    p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert p.stdout.readline().strip() == "made"
        assert len(segments_of(pool)) == 3 and reclaim(pool) == []        # all held by live processes
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    left = [n for n in segments_of(pool) if n != mine.seg.name]
    assert len(left) == 2
    assert sorted(reclaim(pool)) == left and segments_of(pool) == [mine.seg.name]
    mine.discard()
    segs.settle()
