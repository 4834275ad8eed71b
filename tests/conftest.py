"""Shared fixtures: tiny checkpoints are written once per test session."""
import os
import random
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
