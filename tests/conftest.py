"""Shared fixtures: tiny checkpoints written once per test session, the one shared stack, side gateways."""
import os
import random
import re
import signal
import zlib

import pytest

from tests.schedule import slowest_first
from tests.threads import default_count, default_threads_env, pin_run_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every test runs with a seed derived from this one and its own id: reproducible, yet tests do not share
# a random stream. Replay or vary with U1SERVE_TEST_SEED=N.
BASE_SEED = int(os.environ.get("U1SERVE_TEST_SEED", "20261130"))

GOLDEN = os.path.join(ROOT, "tests", "golden")   # official outputs, with their provenance (README there)

pin_run_threads()       # one CPU thread per process of the run (tests/threads.py says why and the exception)


@pytest.fixture(scope="module")
def default_threads():
    """For a module that checks the official goldens' bits (tests/golden_cases.py `assert_official`): the test
    process computes at torch's own thread count meanwhile; the value is the environment its stack needs for
    the same."""
    import torch
    pinned = torch.get_num_threads()
    torch.set_num_threads(default_count())
    yield default_threads_env()
    torch.set_num_threads(pinned)


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


# ------------------------------------------------------------------------------------------------ tiers
# Every test is in one tier (pyproject.toml registers the markers): `unit` runs in this process alone and runs no
# model (the fast tier: `python -m pytest -m unit`), `service` starts real processes (an engine server, a gateway,
# engine ranks, a CLI, a script) or runs the tiny model end to end in this process, `stack` needs a whole
# `u1serve up` stack or a Ray cluster. A test or module may name its tier itself (`pytestmark =
# pytest.mark.service`); otherwise it is read from what the test uses: its directory, its fixtures, and what its
# module calls (for `service`, also a test helper module it imports).
TIERS = ("unit", "service", "stack")
STACK_DIRS = {"system", "ray", "weights"}          # every test there drives a whole stack or cluster
STACK_FIXTURES = {"stack", "rl_stack", "bench_stack"}
SERVICE_FIXTURES = {"gateway", "side_gateway", "peer", "gen_server", "server", "server_plain", "server_tp2",
                    "tiny_checkpoint", "tiny_dir", "tiny_model", "ref_model", "ref", "reference", "pool"}
STACK_CALLS = re.compile(r"\bRunningStack\b|\bUpStack\b")
SERVICE_CALLS = re.compile(r"\bsubprocess\b|\bPopen\b|\bmultiprocessing\b|\bmp\.spawn\b|\bsys\.executable\b|"
                           r"\bGenServer\b|\bUndServer\b|\bGatewayProc\b|\bService\(|\bin_terminal\(|"
                           r"\bload_model\(|\bwrite_tiny_checkpoint\(|\bmodel_tok\(")
HELPER_IMPORT = re.compile(r"^\s*from\s+(\.\w+|tests(?:\.\w+)+)\s+import", re.M)


def module_text(path: str, cache: dict) -> tuple[str, str]:
    """(a test module's source, that of the test helper modules it imports: one level, tests/conftest.py -- the
    tiny checkpoint's writer -- is no helper)."""
    if path not in cache:
        with open(path) as f:
            own = f.read()
        helpers = ""
        for name in HELPER_IMPORT.findall(own):
            rel = (name[1:] if name.startswith(".") else name.replace(".", os.sep)) + ".py"
            helper = os.path.join(os.path.dirname(path) if name.startswith(".") else ROOT, rel)
            if os.path.isfile(helper) and os.path.abspath(helper) != os.path.abspath(__file__):
                with open(helper) as f:
                    helpers += f.read()
        cache[path] = own, helpers
    return cache[path]


def tier_of(item, own: str, helpers: str) -> str:
    named = [m.name for m in item.iter_markers() if m.name in TIERS]
    if named:
        return named[0]
    used = set(item.fixturenames)
    directory = os.path.relpath(str(item.path), os.path.join(ROOT, "tests")).split(os.sep)[0]
    if directory in STACK_DIRS or used & STACK_FIXTURES or STACK_CALLS.search(own):
        return "stack"
    if used & SERVICE_FIXTURES or SERVICE_CALLS.search(own) or SERVICE_CALLS.search(helpers):
        return "service"
    return "unit"


def pytest_collection_modifyitems(config, items):
    sources: dict[str, tuple[str, str]] = {}
    for item in items:
        item.add_marker(tier_of(item, *module_text(str(item.path), sources)))
    if hasattr(config, "workerinput"):                 # a parallel run's worker: every worker sorts alike
        items[:] = slowest_first(items)


# ------------------------------------------------------------------------------------------------ parallel runs
# pyproject's addopts run the suite on pytest-xdist workers (`-n auto --dist loadfile`): each worker has its own
# session fixtures (its own shared stack), a file runs whole on one worker (its module fixtures start once), the
# slowest files first (tests/schedule.py). `-n 0` runs in this process alone.
MAX_WORKERS = 4             # each worker may run a stack of several processes beside its own


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per CPU this process may use (at most MAX_WORKERS), none when the command names test
    files only -- one file pays no worker start-up. PYTEST_XDIST_AUTO_NUM_WORKERS=N decides, as in xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if config.args and all(os.path.isfile(arg.split("::")[0]) for arg in config.args):
        return 0
    return min(len(os.sched_getaffinity(0)), MAX_WORKERS)
