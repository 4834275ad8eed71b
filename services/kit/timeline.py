"""Per-request stage marks across the services, for `bench/bench_breakdown.py`: where one image request spends
the time that is not denoising (gateway, prefix prefill, admission, the last step's wait, pixels, encoding,
transfers).

Off unless U1SERVE_TIMELINE=1 (the bench sets it for the stack it starts). Each mark is one stderr line,
`u1-timeline <service> <stage> <unix time>`, in the service's log. Wall-clock times: the services share a host.
The generation engine also waits for the device after each step while marks are on, so a step's mark is its
end on the GPU, not its launch (kernels otherwise run up to a step behind the host).
"""
from __future__ import annotations

import sys
import time

from services.base import knobs

PREFIX = "u1-timeline"
ENABLED = knobs.TIMELINE.get()


def mark(service: str, stage: str) -> None:
    if ENABLED:
        sys.stderr.write(f"{PREFIX} {service} {stage} {time.time():.6f}\n")
        sys.stderr.flush()


def parse(lines) -> list[tuple[float, str, str]]:
    """(time, service, stage) of every mark in `lines`, in time order."""
    marks = []
    for line in lines:
        i = line.find(PREFIX + " ")
        if i < 0:
            continue
        fields = line[i:].split()
        if len(fields) == 4:
            marks.append((float(fields[3]), fields[1], fields[2]))
    return sorted(marks)
