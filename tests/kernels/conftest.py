"""Fixtures for the kernel tests (tests/kernels and tests/kernels/interpreted)."""
import pytest

# interpreted/ runs only in the TRITON_INTERPRET=1 child process that test_interpreted.py starts.
collect_ignore = ["interpreted"]


@pytest.fixture
def rng(test_seed):
    """The test's seed (tests/conftest.py: derived from U1SERVE_TEST_SEED and the test id, printed)."""
    return test_seed
