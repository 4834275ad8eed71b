"""Fixtures for the kernel tests (tests/kernels and tests/kernels/interpreted)."""
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_testutil

# interpreted/ runs only in the TRITON_INTERPRET=1 child process that test_interpreted.py starts.
collect_ignore = ["interpreted"]


@pytest.fixture
def rng():
    """Fresh random inputs each run; the seed is printed so a failure can be replayed."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    torch.manual_seed(seed)
    return seed
