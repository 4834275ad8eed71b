"""The launcher with real processes: a wave's services start together and the next wave once they are healthy,
restarts through the one supervisor (backoff, budget), a service that cannot start stops the stack at once with its
last lines, and the stop order (reason, then "stopped")."""
from __future__ import annotations

import io
import sys
import time

import pytest

from services.kit.restart import RestartPolicy
from services.launch.launcher import ServiceSpec, Stack, StartupError
from services.base.netutil import free_port
from tests.system.stackproc import pid_alive

# A stand-in service: answers /health, then behaves as `mode` says.
SERVICE = r"""
import http.server, json, os, sys, threading, time
port, mode = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code, body = (503, {"status": "error", "error": "bad checkpoint"}) if mode == "error" else (200, {})
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
if mode == "exit" or (mode == "sick" and os.path.exists(sys.argv[3])):
    print("fatal: cannot load the checkpoint", flush=True)
    sys.exit(2)
if mode == "sick":           # healthy once, then it dies and never comes back
    open(sys.argv[3], "w").close()
if mode == "slow":           # a start that takes a while (an engine loading its weights)
    time.sleep(2.0)
srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
print("serving", mode, flush=True)
if mode in ("flaky", "sick"):
    time.sleep(1.0)
    print("boom: lost the GPU", flush=True)
    os._exit(5)
time.sleep(3600)
"""


def spec(name: str, mode: str, *extra: str, wave: int = 0) -> ServiceSpec:
    port = free_port()
    return ServiceSpec(name, [sys.executable, "-c", SERVICE, str(port), mode, *extra],
                       f"http://127.0.0.1:{port}/health", wave=wave)


def test_a_waves_services_start_together_and_the_next_wave_after_them():
    stack, out = stack_of(spec("und", "slow"), spec("gen", "slow"), spec("gateway", "ok", wave=1))
    stack.start()
    stack.stop()
    text = out.getvalue()
    # the two 2-second starts overlapped: each began before the other was healthy (read from the order of the lines,
    # not from a wall time, which a loaded host stretches)
    assert text.index("starting gen") < text.index("und healthy") and \
        text.index("starting und") < text.index("gen healthy"), text
    assert max(text.index("und healthy"), text.index("gen healthy")) < text.index("starting gateway"), text


def test_stack_json_written_by_many_threads_at_once_stays_whole(tmp_path):
    """Services of one wave report healthy from their own threads, each writing stack.json: two writers once shared
    the tmp file, and the loser's rename failed (FileNotFoundError), killing its health thread, so `u1serve up` never
    came up (CI, 2026-12-07). Every write must succeed and leave whole JSON."""
    import json
    import threading
    stack = Stack([spec("und", "ok"), spec("gen", "ok")], out=io.StringIO(), state_file=str(tmp_path / "stack.json"))
    errors, go = [], threading.Barrier(8)

    def writer():
        go.wait()
        for _ in range(200):
            try:
                stack.write_state()
            except Exception as e:      # noqa: BLE001 - the race's failure is what this test looks for
                errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    state = json.loads((tmp_path / "stack.json").read_text())
    assert set(state["services"]) == {"und", "gen"} and not (tmp_path / "stack.json.tmp").exists()


def stack_of(*specs, policy=RestartPolicy(base_delay_s=0.2, max_failures=3, window_s=60)) -> tuple[Stack, io.StringIO]:
    out = io.StringIO()
    return Stack(list(specs), out=out, grace_s=2, startup_timeout_s=30, policy=policy), out


def test_restarts_a_dead_service_within_the_budget_then_stops_with_the_reason():
    stack, out = stack_of(spec("steady", "ok"), spec("flaky", "flaky"))
    t0 = time.monotonic()
    stack.start()
    pids = {s.spec.name: s.unit.pid for s in stack.services}
    code = stack.supervise()
    elapsed = time.monotonic() - t0
    report = out.getvalue()
    stack.stop()
    assert code == 1 and elapsed < 30, report
    flaky = stack.by_name("flaky")
    assert flaky.sup.restarts == 2 and "flaky ready again (restart 2)" in report
    assert "flaky failed: 3 failures in 60 s (last: exit code 5)" in report
    assert "boom: lost the GPU" in report.split("last 6 lines of flaky")[1]            # its last lines
    text = out.getvalue()
    assert text.index("flaky failed") < text.index("[u1serve] stopped")               # reason first
    assert not any(pid_alive(p) for p in pids.values())


def test_restarts_back_off_while_a_service_cannot_come_back(tmp_path):
    stack, out = stack_of(spec("sick", "sick", str(tmp_path / "ran-once")))
    stack.start()
    assert stack.supervise() == 1
    stack.stop()
    report = out.getvalue()
    assert "restarting in 0.2 s" in report and "restarting in 0.4 s" in report, report   # exponential
    assert "sick failed: 3 failures" in report and "fatal: cannot load the checkpoint" in report


@pytest.mark.parametrize("mode, reason", [
    ("exit", "und failed: failed to start: exit code 2"),                    # its process exits
    ("error", "und failed: failed to start: its /health reports error: bad checkpoint"),  # it says it cannot run
])
def test_a_service_that_cannot_start_stops_the_stack_at_once(mode, reason):
    stack, out = stack_of(spec("und", mode), spec("gen", "ok", wave=1))
    t0 = time.monotonic()
    with pytest.raises(StartupError) as e:
        stack.start()
    stack.stop()
    assert time.monotonic() - t0 < 20
    assert reason in str(e.value)
    assert stack.by_name("und").sup.restarts == 0 and stack.by_name("gen").unit is None   # its wave never started
    if mode == "exit":
        assert "fatal: cannot load the checkpoint" in str(e.value)                     # its last lines
