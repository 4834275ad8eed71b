"""One real `u1serve up` stack on the tiny checkpoint (CPU) for every RL training test: each test brings the stack
to its own weights first (a fresh weights version), so the tests do not depend on each other's training."""
import os

import pytest


@pytest.fixture(scope="package")
def rl_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import RunningStack
    # four processes (und, gen, gateway, trainer) share the CI machine's two cores: one thread each avoids
    # OpenMP oversubscription, which slows these tiny forwards ten-fold
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("rl-stack")),
                         extra=["--enable-rl", "--allowed-local-dirs", "/tmp"])
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    s.wait_ready()
    yield s
    s.stop_clean()
