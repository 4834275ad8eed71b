"""The understanding service's KV transport flags: the network transport needs a pool and an address other hosts
reach it by (the service itself is started with --kv-transport nixl in tests/system/test_replicas.py)."""
import pytest

from services.understanding.server import advertise_host, parse_args

BASE = ["--model", "unused", "--internal-token", "t"]


def test_nixl_needs_a_pool_and_advertises_a_reachable_address(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--kv-transport", "nixl"])
    a = parse_args(BASE + ["--kv-transport", "nixl", "--kv-pool-name", "p", "--host", "10.2.3.4"])
    assert a.kv_advertise_host == "10.2.3.4" and a.kv_listen_port == 0
    assert parse_args(BASE + ["--kv-pool-name", "p"]).kv_transport == "shm"
    monkeypatch.setenv("POD_IP", "10.9.9.9")
    assert advertise_host("0.0.0.0") == "10.9.9.9"
    assert parse_args(BASE + ["--kv-transport", "nixl", "--kv-pool-name", "p", "--host", "0.0.0.0",
                              "--kv-advertise-host", "gpu-7.internal"]).kv_advertise_host == "gpu-7.internal"


def test_device_transport_is_a_choice():
    """--kv-transport device: the pool's pages on --device, for a generation engine in this process (fused)."""
    a = parse_args(BASE + ["--kv-transport", "device", "--kv-pool-name", "p", "--device", "cpu"])
    assert a.kv_transport == "device" and a.device == "cpu"
