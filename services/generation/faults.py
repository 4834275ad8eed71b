"""Faults a test injects into a real engine (test-only knobs of services/base/knobs.py; off unless set).

U1SERVE_FAULT_STEP_OOM: a job whose request id contains the knob's text raises torch.OutOfMemoryError in its 2nd
denoise step (after one step that worked), where a real allocation would fail: inside Engine.step, before the
forward. The engine's handling of it (worker._step_or_fail) is what the fault tests.
U1SERVE_FAULT_STEP_CRASH / _HANG / _NAN: the same job's 2nd step raises an error no engine handles (the engine dies),
hangs (an hour), or has its latents turned NaN (its image is answered 500 nonfinite_output). The fused mode's fault
tests use them (tests/system/test_fused.py).
U1SERVE_FAULT_WRONG_GEMM: the generation branch's Linear of that name returns finite but wrong values (3x + 1), as
cuBLAS did under an MPS SM cap (services/model/gemm_check.py): the start-up GEMM check must name it.
"""
from __future__ import annotations

import time

import torch

from services.base import knobs

_OOM_MARKER = knobs.FAULT_STEP_OOM.get()
_OOM_STEP = 1     # the job's flow index when it fails: its 2nd step
_CRASH, _HANG, _NAN = knobs.FAULT_STEP_CRASH.get(), knobs.FAULT_STEP_HANG.get(), knobs.FAULT_STEP_NAN.get()


def inject_step_faults(jobs) -> None:
    """The injected fault of a marked job in this step at its chosen index (module doc)."""
    if not (_OOM_MARKER or _CRASH or _HANG or _NAN):
        return
    for job in jobs:
        if job.flow.index != _OOM_STEP:
            continue
        rid = job.request_id
        if _OOM_MARKER and _OOM_MARKER in rid:
            raise torch.OutOfMemoryError(f"injected by U1SERVE_FAULT_STEP_OOM in a step of {rid}")
        if _CRASH and _CRASH in rid:
            raise SystemError(f"injected by U1SERVE_FAULT_STEP_CRASH in a step of {rid}")
        if _HANG and _HANG in rid:
            time.sleep(3600)
        if _NAN and _NAN in rid:
            job.x.fill_(float("nan"))


def inject_wrong_gemm(model: torch.nn.Module) -> None:
    """U1SERVE_FAULT_WRONG_GEMM's Linear returns 3x + 1 of its right output (module doc)."""
    name = knobs.FAULT_WRONG_GEMM.get()
    if name:
        model.get_submodule(name).register_forward_hook(lambda m, i, o: o * 3 + 1)
