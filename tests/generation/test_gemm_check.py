"""The start-up GEMM check (services/model/gemm_check.py): under an MPS SM cap cuBLAS returned wrong values for the
generation branch's GEMMs (then NaN images); the check asks the device, before the first request, whether every
GEMM shape the model serves comes out right against fp32, and a generation server whose GEMMs are wrong refuses to
start, naming the shape, instead of serving wrong images. The wrong GEMM here is an injected fault (a Linear
returning 3x + 1 of its right output, U1SERVE_FAULT_WRONG_GEMM), the CPU's GEMMs being right."""
from __future__ import annotations

import subprocess
import uuid

import pytest
import torch

from services.model import gemm_check
from tests.generation.genhelp import GenServer
from tests.waiting import stop_group, wait_ok

WRONG = "language_model.model.layers.0.mlp_mot_gen.gate_proj"
pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def gen_model(tiny_dir):
    from services.model.loader import load_model
    return load_model(tiny_dir, branch="gen", dtype=torch.float32, device="cpu")


def test_every_served_linear_shape_is_checked_and_right(gen_model):
    linears, skipped = gemm_check.distinct_linears(gen_model)
    served = {(m.in_features, m.out_features) for m in gen_model.modules() if isinstance(m, torch.nn.Linear)}
    assert {(k[0], k[1]) for k in linears} == served and skipped == 0
    rows = gemm_check.rows_for_sizes([(64, 64), (128, 64)], 32)
    assert rows == (4, 8, 16, 128)        # tokens of each size, both CFG branches, and the probe's 128
    found = gemm_check.require_right_gemms(gen_model, rows, "test")
    assert found["checked"] == len(linears) * len(rows) and found["failures"] == []


def test_a_wrong_gemm_is_named_with_its_shape(gen_model):
    handle = gen_model.get_submodule(WRONG).register_forward_hook(lambda m, i, o: o * 3 + 1)
    try:
        with pytest.raises(gemm_check.GemmCheckFailed) as err:
            gemm_check.require_right_gemms(gen_model, (128,), "generation rank 0")
    finally:
        handle.remove()
    text = str(err.value)
    assert WRONG in text and "(128, 64) x (128, 64)" in text and "--gemm-check off" in text


def test_only_a_partial_gpu_checks_by_default(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv(gemm_check.MPS_PERCENT_ENV, raising=False)
    assert not gemm_check.wanted("auto", cpu) and not gemm_check.wanted("auto", cuda)
    assert gemm_check.wanted("auto", cuda, green_sm_percent=75) and not gemm_check.wanted("auto", cpu, 75)
    monkeypatch.setenv(gemm_check.MPS_PERCENT_ENV, "85")
    assert gemm_check.wanted("auto", cuda) and gemm_check.wanted("on", cpu) and not gemm_check.wanted("off", cuda)
    with pytest.raises(ValueError):
        gemm_check.wanted("sometimes", cpu)


def test_a_server_with_a_wrong_gemm_refuses_to_start_and_says_why(tiny_dir, tmp_path):
    """The real server: with the check on and the fault injected, the engine never becomes ready, the process exits
    non-zero (the launcher's restart budget then gives up, as for any engine that cannot start) and its log names
    the GEMM; the same server without the fault starts and serves."""
    log = tmp_path / "gen.log"
    bad = GenServer(tiny_dir, f"u1gen-gemm-{uuid.uuid4().hex[:8]}", "--gemm-check", "on",
                    "--log-level", "info", knobs={"U1SERVE_FAULT_WRONG_GEMM": WRONG})
    with open(log, "w") as out:
        proc = subprocess.Popen(bad.argv, env=dict(bad.env(), **bad.knobs), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=180)
        finally:
            stop_group(proc, 5)
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert "GEMMs came out wrong" in text and WRONG in text, text[-3000:]
    good = GenServer(tiny_dir, f"u1gen-gemm-{uuid.uuid4().hex[:8]}", "--gemm-check", "on").start()
    try:
        wait_ok(good.url + "/health", good.proc, lambda: "", 60, "gen", interval=0.1)
    finally:
        good.stop()
