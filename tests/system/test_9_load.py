"""Sustained mixed load on its own CPU stack (tiny checkpoint): 32 clients for 60 s of chat, streamed chat,
images, streamed images, edits, cancelled streams and hostile inputs (bench/bench_load.py), against a gateway
that admits 12 requests at a time, so the clients are over capacity all along: the first half 32 closed loops, the
second half the open loop (`--rate`: arrivals at a fixed rate whatever the latency, at most 32 in flight).

What must hold: no 5xx at all (the stack is healthy: a 503 would be a bug here), no transport errors, every
kind of request completes, hostile inputs are 4xx, the excess gets 429 with Retry-After; afterwards the stack
drains (no KV pool pages held, generation idle) and the resident memory of every service process is flat
between the first and the second half of the run (nothing grows per request)."""
from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest

from bench.bench_load import KINDS, LoadConfig, run_load, summarize
from bench.profile_stack import Stack

CLIENTS = 32
HALF_S = 30.0
GATEWAY_LIMIT = 12                   # requests in flight at the gateway; the rest get 429
OPEN_RATE = 6.0                      # the second half's arrivals a second (open loop)
RSS_GROWTH_MB = 48.0                 # allowed growth of one process between the two halves (allocator noise)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _tracebacks(run_dir: str, limit: int = 3) -> str:
    """The first tracebacks in the services' logs (what a 5xx came from), for the failure message."""
    found = []
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log"))):
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if "Traceback" in line and len(found) < limit:
                found.append(f"--- {os.path.basename(path)}:\n" + "\n".join(lines[max(0, i - 2):i + 30]))
    return "\n".join(found)


def _service_pids(stack: Stack) -> dict[str, int]:
    with open(os.path.join(stack.run_dir, "stack.json")) as f:
        services = json.load(f)["services"]
    pids = {name: s["pid"] for name, s in services.items() if s.get("pid")}
    for name, pid in list(pids.items()):   # the engines' rank processes are children of their HTTP process
        for child in _children(pid):
            pids[f"{name}-child-{child}"] = child
    return pids


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.timeout(600)
def test_sustained_mixed_load_over_capacity(tmp_path):
    stack = Stack(profile="cpu", out_dir=str(tmp_path),
                  extra_flags=(f"--gateway-args=--max-concurrent-requests {GATEWAY_LIMIT}",))
    with stack:
        cfg = LoadConfig(size="64x64", steps=2, max_tokens=8, api_key=stack.api_key, seed=7)
        first = run_load(stack.base, CLIENTS, HALF_S, cfg)
        pids = _service_pids(stack)
        rss_mid = {name: _rss_mb(pid) for name, pid in pids.items()}
        second = run_load(stack.base, CLIENTS, HALF_S, dataclasses.replace(cfg, seed=8, rate=OPEN_RATE))
        rss_end = {name: _rss_mb(pid) for name, pid in pids.items()}
        problems = stack.settle_problems()
        log_problems = stack.log_problems()
    summary = summarize(first + second, 2 * HALF_S)
    print(json.dumps({k: v for k, v in summary.items() if k != "by_kind"}), json.dumps(summary["by_kind"]))
    print("RSS MB mid -> end:", {k: (round(rss_mid[k]), round(rss_end[k])) for k in rss_mid})

    assert stack.exit_code == 0
    assert summary["count_5xx"] == 0, (summary["codes_5xx"], _tracebacks(stack.run_dir))
    assert summary["transport_errors"] == 0
    for kind in KINDS:
        row = summary["by_kind"].get(kind, {})
        if kind == "bad":
            assert row.get("n") and row.get("ok", 0) == 0, row
            assert all(400 <= int(s) < 500 for s in row["statuses"]), row
        elif kind == "cancel":
            assert row.get("n"), row
        else:
            assert row.get("ok"), (kind, row)
    offered = OPEN_RATE * HALF_S        # Poisson: 180 arrivals, sd ~13; the open loop sends them whatever the latency
    assert 0.7 * offered <= len(second) <= 1.3 * offered, len(second)
    assert {o.kind for o in second} == set(KINDS), "the open loop's first arrivals cover every kind"
    rejected = [o for o in first + second if o.status == 429]
    assert rejected, "32 clients over a gateway limit of 12 got no 429"
    assert all(o.retry_after_s >= 1 for o in rejected)
    assert not problems, problems
    assert not log_problems, log_problems[:5]
    grown = {k: rss_end[k] - rss_mid[k] for k in rss_mid if rss_end[k] - rss_mid[k] > RSS_GROWTH_MB}
    assert not grown, f"resident memory grew by more than {RSS_GROWTH_MB} MB: {grown}"
