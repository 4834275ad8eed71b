"""The stream of a background response (services/gateway/responses_feed.py): numbered events in order, the end
after the response's end, and a reader that does not read let go after `limit` events (the response goes on)."""
import asyncio

from services.gateway.responses_feed import EventFeed


async def read(feed: EventFeed) -> list[dict]:
    return [ev async for ev in feed.events()]


def test_events_in_order_then_the_end():
    async def go():
        feed = EventFeed()
        for kind in ("response.created", "response.queued", "response.completed"):
            feed.put({"type": kind})
        feed.close()
        feed.close()                               # once is enough
        return await read(feed)
    events = asyncio.run(go())
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.created", 0), ("response.queued", 1), ("response.completed", 2)]


def test_a_reader_that_does_not_read_is_let_go():
    async def go():
        feed = EventFeed(limit=3)
        for i in range(10):
            feed.put({"type": "response.output_text.delta", "delta": str(i)})
        assert not feed.attached
        return await read(feed)
    events = asyncio.run(go())
    assert [e["delta"] for e in events[:3]] == ["0", "1", "2"]
    assert events[3]["type"] == "error" and events[3]["code"] == "stream_backlog" and len(events) == 4
