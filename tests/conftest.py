"""Shared fixtures: tiny checkpoints written once per test session, the one shared stack, side gateways."""
import os
import random
import signal
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every test runs with a seed derived from this one and its own id: reproducible, yet tests do not share
# a random stream. Replay or vary with U1SERVE_TEST_SEED=N.
BASE_SEED = int(os.environ.get("U1SERVE_TEST_SEED", "20261130"))

GOLDEN = os.path.join(ROOT, "tests", "golden")   # official outputs, with their provenance (README there)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(variant="u1") -> path of a tiny random checkpoint (seed 0), made once."""
    from services.model.tiny import write_tiny_checkpoint

    made = {}

    def get(variant: str = "u1") -> str:
        if variant not in made:
            made[variant] = write_tiny_checkpoint(str(tmp_path_factory.mktemp(f"tiny-{variant}")), variant, seed=0)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint):
    """The tiny u1 checkpoint's directory (read-only: copy it to change it)."""
    return tiny_checkpoint("u1")


@pytest.fixture(scope="session")
def stack(tiny_checkpoint, tmp_path_factory):
    """The one shared `u1serve up --mode colocate` stack on the tiny checkpoint (CPU) for every test that needs
    only a plain stack: started once for the session. RL routes and runtime LoRA loading are on (gateway routes
    only: the engines serve as without them) and /tmp is an allowed local directory. A test may SIGSTOP an
    engine or SIGKILL one (the launcher restarts it; the test then updates `stack.pids`), but never changes
    the weights or leaves an adapter loaded: tests after it compare with the checkpoint."""
    from tests.system.stackproc import RunningStack
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("stack-colocate")),
                     extra=["--enable-rl", "--enable-runtime-lora", "--allowed-local-dirs", "/tmp"])
    s.wait_ready()
    yield s
    for pid in s.service_pids().values():      # never leave an engine stopped
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    s.stop_clean()


@pytest.fixture()
def side_gateway(tmp_path):
    """start(und_url, gen_url, *flags, env=...) -> a started gateway process (tests/system/stackproc.py
    GatewayProc) with its own flags; all are stopped after the test, and none may have logged a traceback."""
    from tests.system.stackproc import GatewayProc
    procs = []

    def start(und_url: str, gen_url: str, *flags: str, env: dict | None = None,
              host: str | None = "127.0.0.1") -> GatewayProc:
        procs.append(GatewayProc(und_url, gen_url, *flags, env=env, log_dir=str(tmp_path), host=host))
        return procs[-1].wait_up()

    yield start
    for p in procs:
        out = p.stop()
        assert "Traceback" not in out, out


def pytest_report_header(config):
    return f"u1serve test seed: U1SERVE_TEST_SEED={BASE_SEED}"


@pytest.fixture(autouse=True)
def test_seed(request):
    """Seeds python, numpy and torch for the test; the seed is printed (shown with a failure's output)."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    print(f"seed={seed} (U1SERVE_TEST_SEED={BASE_SEED})")
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:
        pass
    import torch
    torch.manual_seed(seed)
    return seed
