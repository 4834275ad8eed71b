"""The preStop drain (services/generation/drain.py) against the real generation server: it returns at once when
the service is idle or gone, and waits for a job in flight to finish."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from .genhelp import REPO, body, errors_of, generate, images_of, prefixes, publish


def _drain(port: int, timeout_s: float) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.generation.drain", "--port", str(port),
                           "--timeout-s", str(timeout_s)], cwd=REPO, capture_output=True, text=True, timeout=120)
    return time.monotonic() - t0, proc


def test_drain_waits_for_the_job_in_flight(gen_server, pool, ref_model):
    """On the session's generation server: the drain only reads /health, it changes nothing there."""
    seconds, proc = _drain(1, 30)                  # nothing listens there: nothing to wait for
    assert proc.returncode == 0 and seconds < 10, proc.stderr
    port = int(gen_server.url.rsplit(":", 1)[1])
    seconds, proc = _drain(port, 30)               # idle
    assert proc.returncode == 0 and seconds < 10, proc.stderr
    result, started = {}, threading.Event()

    def job():      # 80 short steps: seconds of work, while /health stays quick to answer the drain's polls
        result["out"] = generate(gen_server.url, body("drain-1", publish(pool, prefixes(ref_model)),
                                                      num_inference_steps=80),
                                 on_event=lambda ev: started.set())
        result["done_at"] = time.monotonic()
    t = threading.Thread(target=job)
    t.start()
    assert started.wait(60)
    waited, proc = _drain(port, 60)
    drained_at = time.monotonic()
    t.join(120)
    status, events = result["out"]
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1
    assert proc.returncode == 0 and waited > 1.0, (waited, proc.stderr)       # it did wait for the job
    assert drained_at >= result["done_at"] - 1.0, (drained_at, result["done_at"])   # until it was over
