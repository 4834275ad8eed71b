"""services.kit.sse: the one encoder and decoder of server-sent events (what every service writes and every
client and test reads)."""
import asyncio

import httpx

from services.kit import sse


def test_each_event_is_dispatched_by_its_blank_line_and_json_objects_come_out():
    text = 'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    assert list(sse.events(text.splitlines())) == [{"a": 1}, {"b": 2}]
    assert list(sse.events(text.splitlines(), done=True)) == [{"a": 1}, {"b": 2}, sse.DONE]


def test_done_ends_the_stream_and_a_stream_without_it_shows_no_done():
    lines = ["data: {\"a\": 1}", "", "data: [DONE]", "", "data: {\"after\": 1}", ""]
    assert list(sse.events(lines, done=True)) == [{"a": 1}, "[DONE]"]
    cut = ["data: {\"a\": 1}", "", "data: {\"b\":"]          # cut mid-event: no clean end, the half event dropped
    assert list(sse.events(cut, done=True)) == [{"a": 1}]


def test_multi_line_data_is_joined_with_newlines():
    lines = ["data: first", "data: second", "", 'data: {"x":', "data: [1, 2]}", ""]
    assert [e.data for e in sse.parse(lines)] == ["first\nsecond", '{"x":\n[1, 2]}']
    assert list(sse.events(lines)) == [{"x": [1, 2]}]          # the JSON of joined lines; plain text skipped


def test_comments_and_heartbeats_are_no_events():
    text = (sse.HEARTBEAT + sse.encode({"a": 1}) + b": another comment\n\n" + sse.HEARTBEAT
            + sse.encode(sse.DONE)).decode()
    assert [e.data for e in sse.parse(text.splitlines())] == ['{"a":1}', "[DONE]"]
    assert list(sse.events(text.splitlines(), done=True)) == [{"a": 1}, "[DONE]"]


def test_event_names_ids_and_field_syntax():
    lines = ["event: progress", "id: 7", "data:no-space", "retry: 100", "unknown: x", "", "data", "",
             "event: error", 'data: {"e": 1}', ""]
    evs = list(sse.parse(lines))
    assert [(e.event, e.id, e.data) for e in evs] == [("progress", "7", "no-space"), ("message", "7", ""),
                                                       ("error", "7", '{"e": 1}')]


def test_a_last_event_without_its_blank_line_still_counts():
    """The gateway reads a stream's first line alone (is it an error?): one `data:` line is one event."""
    assert list(sse.events(['data: {"error": {"code": "x"}, "status": 429}'])) == [
        {"error": {"code": "x"}, "status": 429}]


def _lines(chunks: list[bytes]) -> list[str]:
    """A streamed body's lines as the clients read them (httpx's line decoder over the chunks as they came)."""
    return list(httpx.Response(200, content=iter(chunks)).iter_lines())


def test_chunks_split_anywhere_crlf_cr_and_utf8_included():
    body = sse.encode({"text": "héllo ✓"}) + b": hb\r\n\r\n" + b'data: {"n": 2}\r\rdata: [DONE]\r\n\r\n'
    whole = _lines([body])
    assert whole == ['data: {"text":"héllo ✓"}', "", ": hb", "", 'data: {"n": 2}', "", "data: [DONE]", ""]
    for size in (1, 2, 3, 5, 7):                                  # every split, CRLF and multi-byte chars cut
        chunks = [body[i:i + size] for i in range(0, len(body), size)]
        assert _lines(chunks) == whole, size
        assert list(sse.events(_lines(chunks), done=True)) == [{"text": "héllo ✓"}, {"n": 2}, "[DONE]"], size


def test_encode_round_trips_through_the_decoder_bytes_spliced():
    frames = sse.encode({"type": "done", "b64_json": b"aGk=", "n": 1}) + sse.encode({"a": "ü"}) + sse.encode(sse.DONE)
    assert list(sse.events(_lines([frames]), done=True)) == [{"type": "done", "n": 1, "b64_json": "aGk="},
                                                                 {"a": "ü"}, "[DONE]"]


def test_async_reader_over_an_http_response():
    body = sse.HEARTBEAT + sse.encode({"a": 1}) + b"data: not json\n\n" + sse.encode([1]) + sse.encode(sse.DONE)

    async def read(done):
        resp = httpx.Response(200, content=body)
        return [ev async for ev in sse.aevents(resp.aiter_lines(), done=done)]
    assert asyncio.run(read(False)) == [{"a": 1}]
    assert asyncio.run(read(True)) == [{"a": 1}, "[DONE]"]
