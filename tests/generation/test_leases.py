"""The generation HTTP process's page ledger (services/generation/leases.py), in-process: a job's lease is told
what happened to the job, in any order and as often as the threads race to say it, and frees each page exactly
once (the prefix unless the engine imported it; an engine failure frees it whatever; the float images its client
did not get). The keeper's thread is not started: the test reads the commands the lease queued for it (the real
pool's claims and frees run in the fault and stream tests: tests/generation/test_faults.py, test_stream_guard.py)."""
from __future__ import annotations

import itertools

import pytest

from services.generation.leases import HandleKeeper

PREFIX = [{"page": "cond"}, {"page": "uncond"}]
IMG_A, IMG_B, IMG_C = {"image": "a"}, {"image": "b"}, {"image": "c"}


def _keeper() -> HandleKeeper:
    return HandleKeeper("pool-unused", None)


def _queued(keeper: HandleKeeper) -> list[tuple[str, list[dict]]]:
    """The commands queued for the keeper thread, in order (then gone from its queue)."""
    out = []
    while keeper.pending():
        out.append(keeper._commands.get_nowait())
    return out


def _freed(keeper: HandleKeeper) -> list[dict]:
    return [h for kind, handles in _queued(keeper) if kind == "release" for h in handles]


def test_a_refused_request_frees_what_it_brought_and_an_empty_one_queues_nothing():
    keeper = _keeper()
    keeper.refuse(PREFIX)
    keeper.refuse([])
    assert _queued(keeper) == [("release", PREFIX)]


# how a job can end, as the call sites report it: (the reports, whether its prefix is freed)
ENDINGS = {
    "aborted or timed out while queued": (["ended"], True),
    "refused by the engine before its import": (["failed"], True),
    "engine died while it was queued": (["failed"], True),
    "done": (["imported", "ended"], False),
    "aborted while running": (["imported", "ended"], False),
    "failed in the engine after its import": (["imported", "failed"], True),
    "engine died mid-job": (["imported", "failed"], True),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_every_ending_frees_the_prefix_exactly_once_whatever_comes_after(ending):
    reports, frees = ENDINGS[ending]
    for late in itertools.product(["ended", "failed", "imported", "hold"], repeat=2):
        keeper = _keeper()
        lease = keeper.lease(PREFIX)
        lease.hold()
        lease.hold()                        # held once
        assert _queued(keeper) == [("claim", PREFIX)]
        for report in [*reports, *late]:    # the job's ending, then the other threads' late reports
            getattr(lease, report)()
        assert _freed(keeper) == (PREFIX if frees else []), (ending, late)


def test_a_job_that_ended_before_its_hold_is_freed_and_never_claimed():
    """The engine died between the job's admission and its claim: the claim must not come after the free."""
    keeper = _keeper()
    lease = keeper.lease(PREFIX)
    lease.failed()
    lease.hold()
    assert _queued(keeper) == [("release", PREFIX)]


def test_a_delivered_stream_hands_its_shown_images_to_the_client_and_frees_the_rest():
    keeper = _keeper()
    lease = keeper.lease([])
    assert lease.image(IMG_A) and lease.image(IMG_B)
    lease.shown(IMG_A)                      # written to the client; B was dropped (the stream fell behind)
    lease.stream_closed(delivered=True)
    assert _freed(keeper) == [IMG_B]
    assert not lease.image(IMG_C)           # exported after the stream closed: freed at once, not delivered
    lease.stream_closed(delivered=True)
    lease.stream_closed(delivered=False)
    assert _freed(keeper) == [IMG_C]


def test_a_stream_cut_before_its_end_frees_every_image_once():
    keeper = _keeper()
    lease = keeper.lease(PREFIX)
    lease.hold()
    _queued(keeper)
    for img in (IMG_A, IMG_B):
        lease.image(img)
    lease.shown(IMG_A)
    lease.shown(IMG_A)
    lease.stream_closed(delivered=False)    # the client went away: it will read nothing back
    lease.stream_closed(delivered=True)
    lease.ended()
    assert sorted(map(str, _freed(keeper))) == sorted(map(str, [IMG_A, IMG_B, *PREFIX]))


def test_an_image_of_no_job_is_freed_once():
    keeper = _keeper()
    keeper.stray_image(IMG_A)
    assert _queued(keeper) == [("release", [IMG_A])]
