"""CPU threads of the test run: one per process, the test process's torch and every process it starts.

On CI's 2 cores a parallel run has two workers, each with a stack or servers of its own: at torch's default
count every one of those processes spins OpenMP threads against the others, which slows the tiny forwards
several-fold (docs/model.md "Bits"; tests/system/stackproc.py ONE_THREAD). Pinned everywhere, the bit-exact
comparisons between the test process and a served stack still hold (the same host and thread count: docs/model.md
"What is exact where"). The one exception is the official goldens' equality (tests/golden_cases.py
`assert_official`): it is demanded where this host's kernels give the golden host's bits at torch's own count,
so the tests that check it take `default_threads` (tests/conftest.py) for the test process and their stack.
A run started with OMP_NUM_THREADS or MKL_NUM_THREADS set keeps what it set."""
from __future__ import annotations

import os

from services.base.knobs import TEST_DEFAULT_THREADS

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
ONE_THREAD = {name: "1" for name in THREAD_VARS}


def pin_run_threads() -> None:
    """Called once per test process (tests/conftest.py): the first one records torch's own count and pins the
    environment every later process inherits (xdist workers, servers, stacks); each pins its own torch."""
    import torch
    if not TEST_DEFAULT_THREADS.get():       # the run's first process: the count before the pin, for those after it
        os.environ[TEST_DEFAULT_THREADS.name] = str(torch.get_num_threads())
        if not any(name in os.environ for name in THREAD_VARS):
            os.environ.update(ONE_THREAD)
    if os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(1)


def default_count() -> int:
    """torch's own thread count on this host (what the run would have had unpinned)."""
    import torch
    return TEST_DEFAULT_THREADS.get() or torch.get_num_threads()


def default_threads_env() -> dict[str, str]:
    """The environment for a process that must compute at torch's own thread count."""
    return {name: str(default_count()) for name in THREAD_VARS}
