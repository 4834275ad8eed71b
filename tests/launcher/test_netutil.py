"""free_port hands out ports below the ephemeral range (where no outgoing connection or port-0 bind can take them
between the pick and the listener's bind), bindable, never twice."""
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
