"""bench/bench_handoff.py's CPU smoke mode runs (two processes, both transports) and checks its imports."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shm_transfer.nixl_transport import nixl_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("transport", ["shm", "network"])
def test_bench_handoff_smoke(transport, tmp_path):
    if transport == "network" and not nixl_available() and not os.environ.get("CI"):
        pytest.skip("NIXL not installed (pip install -e '.[network]')")
    out = tmp_path / "r.json"
    env = dict(os.environ, UCX_TLS="tcp", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "bench.bench_handoff", "--smoke", "--transport", transport,
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "imports bit-exact: True" in r.stdout
    assert f"| import ({transport}, other process, sync call) | 300 |" in r.stdout
    assert out.exists()



def test_bench_breakdown_handoff_smoke_shm_vs_device(tmp_path):
    """bench_breakdown.py --part handoff --smoke: one image's prefix handoff through shm pages and device pages (the
    CPU standing in for the device), both bit-exact and nothing left held."""
    out = tmp_path / "h.json"
    r = subprocess.run([sys.executable, "-m", "bench.bench_breakdown", "--part", "handoff", "--smoke", "--json",
                        str(out)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "imports bit-exact, no pages left: True" in r.stdout
    assert "| **handoff, non-step time of one image** |" in r.stdout
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"shm", "device"} and all(v > 0 for v in res["handoff_s"].values())


def test_bench_handoff_smoke_between_network_namespaces(tmp_path):
    """The network transport between two network namespaces joined by a veth pair (two hosts on one machine);
    the namespaces (named after the bench's pid) are gone afterwards."""
    import shutil
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (ip netns) to make the namespaces")
    if not nixl_available() and not os.environ.get("CI"):
        pytest.skip("NIXL not installed (pip install -e '.[network]')")
    out = tmp_path / "r.json"
    env = dict(os.environ, UCX_TLS="tcp", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "bench.bench_handoff", "--smoke", "--transport", "network",
                             "--netns", "--json", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "imports bit-exact: True" in stdout
    assert "| import (network, veth netns, other process, sync call) | 300 |" in stdout
    assert "veth pair" in out.read_text()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not {f"u1kv-p{proc.pid % 100000}", f"u1kv-c{proc.pid % 100000}"} & set(names)
