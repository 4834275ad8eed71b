"""The trajectory store: parts assemble in sample order, the byte bound evicts the least recently used
trajectory (never the one being filled), the safetensors round trip, bad uploads are 400s; a trajectory is its
owner's alone and one owner cannot evict another's within its share."""
import numpy as np
import pytest
from safetensors.numpy import load

from services.generation.trajectory_store import Part, TrajectoryStore
from services.kit.errors import APIError


def part(n, first, steps=2, side=4):
    lat = np.full((n, steps + 1, 3, side, side), float(first), dtype=np.float32)
    lp = np.full((n, steps), np.nan, dtype=np.float32)
    lp[:, 0] = first
    return Part(lat, lp, {"timesteps": [0.0, 0.5, 1.0], "sde_steps": [0], "noise_scale": 1.0,
                          "weights_version": "7", "samples": [{"seed": first + i} for i in range(n)]})


def test_parts_assemble_in_order_and_round_trip():
    st = TrajectoryStore(1 << 20)
    st.put("t", 2, part(2, 2))
    st.put("t", 0, part(2, 0))
    t = load(st.blob("t").tobytes())
    assert t["latents"].shape == (4, 3, 3, 4, 4) and t["latents"][:, 0, 0, 0, 0].tolist() == [0, 0, 2, 2]
    assert t["sde_mask"].tolist() == [1, 0] and t["timesteps"].tolist() == [0.0, 0.5, 1.0]
    assert st.latents("t", 1, 2, 2, 4, 4)[:, 0, 0, 0, 0].tolist() == [0, 2]
    with pytest.raises(APIError) as e:
        st.latents("t", 0, 4, 3, 4, 4)                         # wrong number of steps
    assert e.value.code == "trajectory_mismatch"
    assert st.put_safetensors("u", st.blob("t").tobytes()) == 4


def test_lru_by_bytes():
    one = part(1, 0).nbytes
    st = TrajectoryStore(3 * one)
    for name in "abc":
        st.put(name, 0, part(1, 0))
    st.get("a")                                                # a is now the most recent
    st.put("d", 0, part(1, 0))
    with pytest.raises(APIError) as e:
        st.get("b")
    assert e.value.status == 404 and e.value.code == "trajectory_not_found"
    assert st.stats()["trajectories"] == 3 and st.stats()["bytes"] <= 3 * one
    with pytest.raises(APIError):
        st.put("huge", 0, part(4, 0))                          # larger than the whole store
    assert st.delete("a") and not st.delete("a")


def test_bad_upload_is_400():
    st = TrajectoryStore(1 << 20)
    with pytest.raises(APIError) as e:
        st.put_safetensors("x", b"not safetensors")
    assert e.value.status == 400


def test_a_trajectory_read_when_it_leaves_drains_until_its_last_reader_closes():
    one = part(1, 0).nbytes
    st = TrajectoryStore(2 * one)
    st.put("a", 0, part(1, 0))
    st.put("b", 0, part(1, 1))
    first, second = st.reader("a"), st.reader("a")
    whole = first.blob.tobytes()
    assert st.delete("a")                                      # deleted mid-read: gone for new requests ...
    with pytest.raises(APIError) as e:
        st.reader("a")
    assert e.value.code == "trajectory_not_found"
    assert st.stats() | {"max_bytes": 0, "owner_max_bytes": 0} == {
        "trajectories": 1, "bytes": one, "max_bytes": 0, "owner_max_bytes": 0, "owners": 1, "streams": 2,
        "draining_bytes": one}
    assert b"".join(first.chunks(0, first.blob.size)) == whole  # ... the running reads go on
    first.close()
    first.close()                                              # closing twice releases once
    assert st.stats()["draining_bytes"] == one and st.stats()["streams"] == 1
    second.close()
    assert st.stats()["draining_bytes"] == 0 and st.stats()["streams"] == 0
    reading = st.reader("b")                                   # evicted mid-read: the same
    st.put("c", 0, part(1, 2))
    st.put("d", 0, part(1, 3))
    assert st.stats()["draining_bytes"] == one and st.stats()["bytes"] == 2 * one
    reading.close()
    assert st.stats()["draining_bytes"] == 0 and st.stats()["streams"] == 0
    st.reader("c").close()                                     # a reader of a stored trajectory frees nothing
    assert st.stats()["bytes"] == 2 * one and st.stats()["draining_bytes"] == 0


def test_a_trajectory_is_its_owners_alone():
    st = TrajectoryStore(1 << 20)
    st.put("t", 0, part(1, 0), "owner-a")
    for read in (lambda: st.get("t", "owner-b"), lambda: st.reader("t", "owner-b"), lambda: st.get("t"),
                 lambda: st.latents("t", 0, 1, 2, 4, 4, "owner-b"), lambda: st.put("t", 1, part(1, 1), "owner-b")):
        with pytest.raises(APIError) as e:
            read()
        assert e.value.status == 404 and e.value.code == "trajectory_not_found"
    assert not st.delete("t", "owner-b") and st.get("t", "owner-a").nbytes == part(1, 0).nbytes
    assert st.delete("t", "owner-a")


def test_one_owner_cannot_evict_another_within_its_share():
    one = part(1, 0).nbytes
    st = TrajectoryStore(4 * one)
    st.put("b0", 0, part(1, 0), "owner-b")                    # B: the oldest, within its share
    for i in range(6):                                         # A fills the store again and again
        st.put(f"a{i}", 0, part(1, 0), "owner-a")
    assert st.get("b0", "owner-b") is not None
    assert st.stats()["bytes"] <= 4 * one and st.stats()["trajectories"] == 4
    quota = TrajectoryStore(8 * one, owner_max_bytes=2 * one)   # a hard cap: A's own oldest make room
    quota.put("b0", 0, part(1, 0), "owner-b")
    for i in range(4):
        quota.put(f"a{i}", 0, part(1, 0), "owner-a")
    assert quota.stats()["bytes"] == 3 * one
    with pytest.raises(APIError):
        quota.get("a1", "owner-a")
    with pytest.raises(APIError) as e:
        quota.check_fits(3 * one)
    assert e.value.status == 413 and "--rl-trajectory-owner-mb" in e.value.message
