"""Under CUDA MPS with generation at its default SM cap, the denoiser's values are right (GPU with MPS only).

The test that would have caught the NaN images of `--gpu-sharing mps` (docs/benchmarks/load.md, MPS section): the
probe's "check" run (deploy/mps_probe.py, deploy/module_check.py) under the deployment's own MPS daemon at
DEFAULT_GEN_SM_PERCENT, on the 8B geometry with random weights: every step's state finite and every Linear /
Conv2d output of every step within bf16 rounding of fp32 from its own input. About a minute on an H100; skipped
without CUDA or without nvidia-cuda-mps-control (CI runs the probe's CPU mode: tests/launcher/test_smoke_scripts.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from services.launch.mps import CONTROL, DEFAULT_GEN_SM_PERCENT
from tests.system.stackproc import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or shutil.which(CONTROL) is None,
                                reason=f"needs a CUDA GPU and {CONTROL} (MPS)")


def test_denoiser_values_right_under_mps(tmp_path):
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, "-m", "deploy.mps_probe", "--sm-percents", str(DEFAULT_GEN_SM_PERCENT),
                        "--baseline-runs", "", "--runs", "check", "--json", str(out)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    [(label, res)] = json.loads(out.read_text()).items()
    assert "error" not in res, res
    for prompt in ("short (t2i)", "long (edit)"):
        assert res[prompt]["finite"] and "wrong" not in res[prompt], (label, prompt, res[prompt])
