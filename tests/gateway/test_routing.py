"""Replica routing rules (services/gateway/routing.py): affinity, bounded load, KV pairing, ejection backoff,
membership and DNS expansion. The resolver is a function argument: several A records for one name cannot be
made on this machine without editing /etc/hosts."""
from __future__ import annotations

import random
import time

import pytest

from services.gateway.routing import (Endpoint, EndpointPool, affinity_key, by_affinity, can_read,
                                      conversation_key, expand, image_key)
from services.kit.errors import APIError

URLS = [f"http://10.0.0.{i}:8100" for i in range(1, 5)]


def pool(urls=URLS, **kw) -> EndpointPool:
    return EndpointPool("understanding", list(urls), 1.0, **kw)


def test_same_conversation_start_same_replica_and_spread_over_replicas():
    random.seed(0)
    p = pool()
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    later = {"messages": chat["messages"] + [{"role": "assistant", "content": "hello"},
                                             {"role": "user", "content": "more"}]}
    k = conversation_key(chat)
    assert k == conversation_key(later)                       # later turns share the start
    assert k != conversation_key({**chat, "cache_salt": "tenant-2"})
    assert len({p.pick(key=k).url for _ in range(20)}) == 1
    keys = [conversation_key({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(400)]
    counts = {u: 0 for u in URLS}
    for key in keys:
        counts[p.pick(key=key).url] += 1
    assert min(counts.values()) > 60, counts                  # about 100 each


def test_a_replica_leaving_moves_only_its_own_keys():
    p = pool()
    keys = [affinity_key("k", i) for i in range(300)]
    before = {k: p.pick(key=k).url for k in keys}
    p.set_urls(URLS[:3])
    after = {k: p.pick(key=k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[3] for k in moved)


def test_bounded_load_moves_a_hot_key_to_the_next_replica():
    eps = [Endpoint(u) for u in URLS]
    key = image_key({"mode": "t2i", "prompt": "a fox"})
    first = by_affinity(eps, key)
    first.in_flight = 10                                      # far above the average
    second = by_affinity(eps, key)
    assert second is not first
    first.in_flight = 4
    assert by_affinity(eps, key) is first                     # a little busier keeps its keys


def test_generation_least_loaded_among_replicas_that_can_read_the_kv():
    g = EndpointPool("generation", ["http://a:8200", "http://b:8200", "http://c:8200"], 1.0)
    a, b, c = g.endpoints
    a.shm_domain, b.shm_domain, c.shm_domain = "host1", "host2", "host2"
    a.reported_load, b.reported_load, c.reported_load = 3, 1, 0
    shm_src = Endpoint("http://u:8100", shm_domain="host1", kv_transport="shm")
    net_src = Endpoint("http://u:8100", shm_domain="host2", kv_transport="nixl")
    assert g.pick(source=shm_src) is a                        # shm: only its own host, however busy
    assert g.pick(exclude={a.url}, source=shm_src) is a       # tried already: nobody else can take it ...
    assert not g.untried({a.url}, shm_src) and g.untried({a.url}, net_src)   # ... so the request stops there
    assert g.pick(source=net_src) is c                        # network: the least loaded
    c.in_flight = 1                                           # b and c tie: the producer's domain first
    c.reported_load = 1
    net_src.shm_domain = "host2"
    assert g.pick(source=net_src) in (b, c)
    net_src.shm_domain = "host1"
    a.reported_load = 1
    assert g.pick(source=net_src) is a
    with pytest.raises(APIError) as e:
        g.pick(source=Endpoint("http://u:8100", shm_domain="host9", kv_transport="shm"))
    assert e.value.status == 503 and e.value.code == "no_kv_route"
    assert can_read(Endpoint("u", kv_transport="shm"), a)     # unknown domain: let the consumer answer


def test_ejection_backoff_doubles_and_a_success_resets_it():
    p = pool(URLS[:2], eject_max_s=3.0)
    ep = p.endpoints[0]
    waits = []
    for _ in range(4):
        p.down(ep)
        waits.append(round(ep.down_until - time.monotonic()))
    assert waits == [1, 2, 3, 3]
    assert not ep.looks_up and p.pick() is p.endpoints[1]
    assert p.pick(exclude={p.endpoints[1].url}) is ep           # all others tried: the ejected one anyway
    ep.mark_up()
    assert ep.looks_up and ep.failures == 0


def test_membership_keeps_state_of_known_replicas():
    p = pool(URLS[:2])
    p.endpoints[0].in_flight = 2
    p.set_urls(URLS[:3])
    assert [e.url for e in p.endpoints] == URLS[:3] and p.endpoints[0].in_flight == 2
    p.set_urls([])                                            # a failed resolution never empties a pool
    assert len(p.endpoints) == 3


def test_dns_names_expand_to_one_replica_per_address():
    def resolver(host, port):
        assert (host, port) == ("u1-und", 8100)
        return ["10.1.0.7", "10.1.0.9"]

    assert expand("http://u1-und:8100", resolver) == ["http://10.1.0.7:8100", "http://10.1.0.9:8100"]
    assert expand("http://u1-und:8100", lambda h, p: ["10.1.0.7"]) == ["http://u1-und:8100"]
    assert expand("http://127.0.0.1:8100", resolver) == ["http://127.0.0.1:8100"]

    def broken(host, port):
        raise OSError("no such name")
    assert expand("http://u1-und:8100", broken) == ["http://u1-und:8100"]
    assert expand("http://u1:8100", lambda h, p: ["fd00::1", "fd00::2"]) == ["http://[fd00::1]:8100",
                                                                             "http://[fd00::2]:8100"]
    assert expand("http://localhost:8100") == ["http://localhost:8100"]        # the real resolver


def test_an_interleaved_answer_routes_by_its_conversation():
    """Each segment goes where the conversation's chat turns went; two conversations are two keys (the segment's
    prefix body names no prompt or image, so a key from those alone would send every answer to one replica)."""
    from services.gateway.interleave import Answer, Segment

    def segment(question: str, k: int = 0) -> Segment:
        answer = Answer(request_id="a", messages=[{"role": "user", "content": question}], think=False,
                        max_tokens=64, max_images=2, generate={"guidance_scale": 4.0, "image_guidance_scale": 1.0})
        return Segment(answer, k)

    a, b = segment("draw a fox"), segment("draw a lighthouse")
    ka, kb = a.route_key(a.prefix_body()), b.route_key(b.prefix_body())
    assert ka != kb
    assert ka == conversation_key({"messages": [{"role": "user", "content": "draw a fox"}]})
    later = segment("draw a fox", k=1)
    assert later.route_key(later.prefix_body()) == ka
