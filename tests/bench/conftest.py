"""One real `u1serve up` stack (tiny checkpoint, CPU, the benches' cpu-colocate profile) for the whole-stack bench
smokes that measure a running stack (`--up-url`): one start instead of one per bench. The RL benches push weights
into it, so no test here compares its outputs with the checkpoint."""
import pytest


@pytest.fixture(scope="module")
def bench_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import rl_stack
    s = rl_stack(tiny_checkpoint("u1"), str(tmp_path_factory.mktemp("bench-stack")))
    yield s
    s.stop_clean()
