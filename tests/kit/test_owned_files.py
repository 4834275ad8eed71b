"""Files in shared places that a stack makes and removes by what is recorded in them, never by their name alone
(issue 30): the QoS page in /dev/shm (created exclusively; a live writer's page refused, a dead one's reclaimed,
a planted file refused by the writer and ignored by readers), and the understanding's private socket
directories (`u1und-*`: a dead owner's removed at the next start)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

import pytest

from services.kit import rundirs
from services.base.knobs import STACK_ID
from shm_transfer.errors import PoolError
from shm_transfer.segment import owner_of, unlink_exact, unlink_if_owned
from shm_transfer.yield_signal import PAGE, YieldSignal


@pytest.fixture()
def name():
    n = f"u1test-yield-{uuid.uuid4().hex[:8]}"
    yield n
    for leftover in (n,):
        try:
            unlink_exact(leftover)
        except (OSError, ValueError):
            pass


def _create_and_die(name: str, stack: str) -> None:
    os.environ[STACK_ID.name] = stack
    YieldSignal.create(name)
    os.kill(os.getpid(), signal.SIGKILL)        # no atexit: the page stays behind


def test_the_qos_page_is_private_and_records_its_stack(name, monkeypatch):
    monkeypatch.setenv(STACK_ID.name, "stack-a")
    sig = YieldSignal.create(name)
    try:
        st = os.stat(f"/dev/shm/{name}")
        assert st.st_mode & 0o777 == 0o600
        with open(f"/dev/shm/{name}", "rb") as f:
            assert owner_of(f.read(PAGE)) == {"stack": "stack-a", "pid": os.getpid()}
        with pytest.raises(PoolError, match="belongs to a live process"):
            YieldSignal.create(name)                     # a live writer's page is never replaced
        reader = YieldSignal.open(name)
        assert reader is not None
        sig.set_busy()
        assert reader.busy_for() is not None
        reader.close()
        monkeypatch.setenv(STACK_ID.name, "stack-b")      # another stack's page: not ours to follow
        assert YieldSignal.open(name) is None
    finally:
        sig.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_dead_writers_page_is_reclaimed_by_the_next(name, monkeypatch):
    p = mp.get_context("spawn").Process(target=_create_and_die, args=(name, "stack-dead"))
    p.start()
    p.join(60)
    assert os.path.exists(f"/dev/shm/{name}")
    assert not unlink_if_owned(name, "stack-other")      # a launcher removes only its own stack's segments
    monkeypatch.setenv(STACK_ID.name, "stack-next")
    sig = YieldSignal.create(name)
    sig.close()
    p = mp.get_context("spawn").Process(target=_create_and_die, args=(name, "stack-dead"))
    p.start()
    p.join(60)
    assert unlink_if_owned(name, "stack-dead") and not os.path.exists(f"/dev/shm/{name}")


def test_a_planted_file_or_link_at_the_name_is_not_trusted(name, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.symlink(target, f"/dev/shm/{name}")
    with pytest.raises(PoolError, match="not a shared-memory segment of ours"):
        YieldSignal.create(name)
    assert YieldSignal.open(name) is None
    assert target.read_bytes() == b"precious"           # never truncated through the link
    os.unlink(f"/dev/shm/{name}")
    with open(f"/dev/shm/{name}", "wb") as f:         # world-readable, no owner record
        f.write(b"\0" * PAGE)
    os.chmod(f"/dev/shm/{name}", 0o644)
    assert YieldSignal.open(name) is None
    if os.geteuid() == 0:                              # another user's file: refused, left alone
        os.chown(f"/dev/shm/{name}", 4242, 4242)
        with pytest.raises(PoolError, match="belongs to uid 4242"):
            YieldSignal.create(name)
        assert os.path.exists(f"/dev/shm/{name}")


def _own_dir_and_die(note: str) -> None:
    with open(note, "w") as f:
        f.write(rundirs.owned_tempdir("u1test-rundir-"))
    os.kill(os.getpid(), signal.SIGKILL)


def test_private_dirs_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    note = str(tmp_path / "dir")
    p = mp.get_context("spawn").Process(target=_own_dir_and_die, args=(note,))
    p.start()
    p.join(60)
    dead = open(note).read()
    assert os.path.isdir(dead)
    mine = rundirs.owned_tempdir("u1test-rundir-")       # (removes the dead one first)
    assert not os.path.exists(dead) and os.path.isdir(mine)
    assert rundirs.reclaim_stale("u1test-rundir-") == [] and os.path.isdir(mine)   # alive: kept
