"""Strikes for clients that hold responses unread (issue 30, gateway/probation.py), against a gateway in front of
the real tiny stack: a client whose streamed image sits unread with its receive window closed gets a strike and
its next requests a 429 `client_on_probation` while other clients are served; the strike decays; a client that
reads slowly but keeps reading is never struck. Each client has its own loopback address (127/8 is loopback)."""
from __future__ import annotations

import json
import socket
import time

import httpx

from tests.metrics import metric
from tests.waiting import wait_until

HOLD_S, DECAY_S = 1.0, 4.0
IMAGE = {"prompt": "a fox", "size": "96x96", "stream": True, "num_inference_steps": 1, "output_format": "png",
         "response_format": "b64_json"}          # ~37 KB of SSE: more than a 4 KB receive buffer holds


def _gateway(stack, side_gateway):
    return side_gateway(stack.und, stack.gen, "--strike-hold-s", str(HOLD_S), "--strike-decay-s", str(DECAY_S),
                        env={"U1SERVE_INTERNAL_TOKEN": stack.token})


def _raw_stream(port: int, source: str) -> socket.socket:
    """A streamed image request from `source` whose client offers a 4 KB receive buffer."""
    data = json.dumps(IMAGE).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _image(base: str, source: str) -> httpx.Response:
    with httpx.Client(base_url=base, timeout=120, transport=httpx.HTTPTransport(local_address=source)) as c:
        return c.post("/v1/images/generations", json={**IMAGE, "stream": False})


def test_a_client_that_holds_its_image_unread_is_refused_until_its_strike_decays(stack, side_gateway):
    g = _gateway(stack, side_gateway)
    hostile = _raw_stream(g.port, "127.0.0.2")
    try:
        assert wait_until(lambda: metric(g.base, "u1serve_gateway_client_strikes_total") == 1, 60, interval=0.2)
        struck_at = time.monotonic()
        refused = _image(g.base, "127.0.0.2")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "client_on_probation", refused.text
        assert 1 <= int(refused.headers["retry-after"]) <= DECAY_S
        assert metric(g.base, "u1serve_gateway_clients_on_probation") == 1
        honest = _image(g.base, "127.0.0.1")              # another client is served meanwhile
        assert honest.status_code == 200 and honest.json()["data"][0]["b64_json"], honest.text
    finally:
        hostile.close()
    time.sleep(max(0.0, DECAY_S - (time.monotonic() - struck_at)) + 0.5)
    again = _image(g.base, "127.0.0.2")                   # the strike has decayed
    assert again.status_code == 200, again.text
    assert metric(g.base, "u1serve_gateway_probation_refused_total") == 1
    assert metric(g.base, "u1serve_gateway_clients_on_probation") == 0
    assert "held its response unread" in g.output()


def test_a_slow_client_that_keeps_reading_is_not_struck(stack, side_gateway):
    g = _gateway(stack, side_gateway)
    s = _raw_stream(g.port, "127.0.0.3")
    got = b""
    started = time.monotonic()
    try:
        while b"data: [DONE]" not in got and time.monotonic() - started < 120:
            chunk = s.recv(1024)                          # ~10 KB/s: the image takes seconds to arrive
            if not chunk:
                break
            got += chunk
            time.sleep(0.1)
    finally:
        s.close()
    assert b".completed" in got and b"data: [DONE]" in got, got[-300:]
    assert time.monotonic() - started > 2 * HOLD_S         # it was slow, for longer than the hold limit
    assert metric(g.base, "u1serve_gateway_client_strikes_total") == 0
    assert _image(g.base, "127.0.0.3").status_code == 200


def test_strikes_add_up_and_drain_one_per_decay():
    from services.gateway.probation import ClientLedger
    now = [0.0]
    ledger = ClientLedger(decay_s=10, max_clients=2, clock=lambda: now[0])
    assert ledger.probation_s("a") == 0
    assert ledger.strike("a") == 10
    now[0] = 4
    assert ledger.probation_s("a") == 6
    assert ledger.strike("a") == 16                    # a repeat offender waits longer
    now[0] = 20
    assert ledger.probation_s("a") == 0 and ledger.on_probation() == 0 and not ledger.strikes
    for c in ("a", "b", "c"):                          # bounded: the least recently struck is forgotten
        ledger.strike(c)
    assert list(ledger.strikes) == ["b", "c"]


def test_a_client_is_its_key_and_its_address():
    from services.gateway.probation import client_of

    def scope(host, key=None):
        return {"client": (host, 1234), "state": {"bearer": key} if key else {}}
    assert client_of(scope("2001:db8::1")) == client_of(scope("2001:db8::ffff:1"))    # one /64
    assert client_of(scope("2001:db8::1")) != client_of(scope("2001:db8:0:1::1"))
    assert client_of(scope("::ffff:10.0.0.1")) == client_of(scope("10.0.0.1"))
    assert client_of(scope("10.0.0.1", "k1")) != client_of(scope("10.0.0.1", "k2")) != client_of(scope("10.0.0.1"))
    assert "k1" not in client_of(scope("10.0.0.1", "k1"))                             # a fingerprint, not the key
