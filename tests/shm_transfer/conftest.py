"""Fixtures shared by the shm_transfer tests."""
import os
import uuid

import pytest


@pytest.fixture
def shm_name():
    """A fresh segment name; fails the test if anything of that name is left in /dev/shm (after cleaning)."""
    name = f"u1kv-test-{uuid.uuid4().hex[:12]}"
    yield name
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(name)]
    for f in leftovers:  # clean up before failing so one failure does not leak into the machine
        os.unlink(os.path.join("/dev/shm", f))
    assert not leftovers, f"leaked shared-memory segments: {leftovers}"


@pytest.fixture(scope="module", params=["shm", "device"])
def pages(request):
    """Where a test's pool keeps its pages: in the shared-memory segment ("shm") or in a tensor of this process
    ("device": the device transport's pool, device = cpu here). The page table and its rules are the same code."""
    return request.param
