"""One real `u1serve up` stack on the tiny checkpoint (CPU) for every RL training test: each test brings the stack
to its own weights first (a fresh weights version), so the tests do not depend on each other's training."""
import pytest


@pytest.fixture(scope="package")
def rl_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system import stackproc
    s = stackproc.rl_stack(tiny_checkpoint("u1"), str(tmp_path_factory.mktemp("rl-stack")))
    yield s
    s.stop_clean()
