"""free_port hands out ports below the ephemeral range (where no outgoing connection or port-0 bind can take them
between the pick and the listener's bind), bindable, never twice, and never to two processes at once (a claim file)."""
import socket

from services.base.netutil import _ephemeral_low, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    low = _ephemeral_low()
    assert all(p < low for p in ports) or low - 20000 < 1000
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_claimed_by_another_process_is_skipped_until_its_claim_is_old(tmp_path, monkeypatch):
    """Two processes that pick before either binds never share a port: the claim file makes the second skip it."""
    import os
    import time

    from services.base import netutil
    first, second = 21001, 21002
    picks = iter([first, first, second, first])

    class Scripted:                      # the random picks, in order
        def randint(self, low, high):
            return next(picks)

    monkeypatch.setattr(netutil, "CLAIMS", str(tmp_path / "claims"))
    monkeypatch.setattr(netutil.random, "SystemRandom", Scripted)
    monkeypatch.setattr(netutil, "_bindable", lambda port: True)
    monkeypatch.setattr(netutil, "_ephemeral_low", lambda: 32768)
    monkeypatch.setattr(netutil, "_given", set())
    assert free_port() == first
    monkeypatch.setattr(netutil, "_given", set())          # another process: it has handed out nothing yet
    assert free_port() == second                            # `first` is claimed
    old = time.time() - netutil.CLAIM_S - 1
    os.utime(tmp_path / "claims" / str(first), (old, old))
    monkeypatch.setattr(netutil, "_given", set())
    assert free_port() == first                             # an old claim is taken over
    assert (tmp_path / "claims").stat().st_mode & 0o777 == 0o700
