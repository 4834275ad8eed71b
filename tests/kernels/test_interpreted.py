"""Runs tests/kernels/interpreted (Triton kernels under TRITON_INTERPRET=1) in a child process."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_triton_kernels_match_references_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env.pop("U1SERVE_KERNELS", None)
    env.pop("PYTEST_ADDOPTS", None)     # CI's junit file and slow list are the parent run's, not this child's
    # -n 0: one process, no parallel workers of its own (pyproject's `-n auto` would start them for a directory)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-n", "0", "-p", "no:cacheprovider",
           "-o", "python_files=check_*.py", "-o", "timeout=170", os.path.join(HERE, "interpreted")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    print(proc.stdout[-20000:])
    print(proc.stderr[-5000:])
    assert proc.returncode == 0, "interpreted kernel tests failed (output above)"
