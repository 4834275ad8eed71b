"""Shared fixtures: tiny checkpoints are written once per test session."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GOLDEN = os.path.join(os.path.dirname(ROOT), "shared", "golden")


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
