"""One real `u1serve up` stack on the tiny checkpoint (CPU) for every RL training test: each test brings the stack
to its own weights first (a fresh weights version), so the tests do not depend on each other's training."""
import pytest


@pytest.fixture(scope="package")
def rl_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import ONE_THREAD, RunningStack
    # four processes (und, gen, gateway, trainer) share the CI machine's two cores: one thread each avoids
    # OpenMP oversubscription, which slows these tiny forwards ten-fold
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("rl-stack")),
                     extra=["--enable-rl", "--allowed-local-dirs", "/tmp"], env=ONE_THREAD)
    s.wait_ready()
    yield s
    s.stop_clean()
