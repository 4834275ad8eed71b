"""Triton kernels vs references under the Triton CPU interpreter.

Triton decides at import time whether its own library functions are interpreted, so
TRITON_INTERPRET=1 must be set before anything imports triton. These files are named
check_*.py so the main test run does not collect them; tests/kernels/test_interpreted.py
runs them in a child process with the variable set, which keeps other tests unaffected.
Run by hand: TRITON_INTERPRET=1 python -m pytest -o python_files='check_*.py' tests/kernels/interpreted
"""
import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise pytest.UsageError("tests/kernels/interpreted needs TRITON_INTERPRET=1 set before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _no_kernel_overrides(monkeypatch):
    monkeypatch.delenv("U1SERVE_KERNELS", raising=False)
    monkeypatch.delenv("U1SERVE_DENOISE_BACKEND", raising=False)
