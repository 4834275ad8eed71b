"""One real `u1serve up` stack (tiny checkpoint, CPU, the benches' cpu-colocate profile) for the whole-stack bench
smokes that measure a running stack (`--up-url`): one start instead of one per bench. Weight updates are allowed
and the benches push them, so no test here compares outputs with the checkpoint."""
import pytest


@pytest.fixture(scope="module")
def bench_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import ONE_THREAD, RunningStack
    # the RL routes on and /tmp allowed: where the RL benches write their updates (bench/stack.py enable_rl)
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("bench-stack")),
                     extra=["--enable-rl", "--allowed-local-dirs", "/tmp"], env=ONE_THREAD)
    s.wait_ready()
    yield s
    s.stop_clean()
