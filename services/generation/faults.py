"""Faults a test injects into a real engine (test-only knobs of services/knobs.py; off unless set).

U1SERVE_FAULT_STEP_OOM: a job whose request id contains the knob's text raises torch.OutOfMemoryError in its 2nd
denoise step (after one step that worked), where a real allocation would fail: inside Engine.step, before the
forward. The engine's handling of it (worker._step_or_fail) is what the fault tests.
"""
from __future__ import annotations

import torch

from services import knobs

_OOM_MARKER = knobs.FAULT_STEP_OOM.get()
_OOM_STEP = 1     # the job's flow index when it fails: its 2nd step


def inject_step_oom(jobs) -> None:
    """Raise the injected out-of-memory when a marked job is in this step at its chosen index."""
    if not _OOM_MARKER:
        return
    for job in jobs:
        if _OOM_MARKER in job.request_id and job.flow.index == _OOM_STEP:
            raise torch.OutOfMemoryError(f"injected by U1SERVE_FAULT_STEP_OOM in a step of {job.request_id}")
