#!/usr/bin/env python3
"""Sustained mixed load through the gateway: N concurrent clients for T seconds, each sending chat, streamed
chat, images, streamed images, edits, cancelled streams and bad inputs (weighted, seeded), back to back.

    python -m bench.bench_load --base http://127.0.0.1:8000 --clients 32 --duration 300 \
        --size 1024x1024 --steps 8 [--api-key KEY] [--json out.json] [--markdown out.md]
    python -m bench.bench_load --smoke        # CPU: a tiny `u1serve up` stack, 8 clients for 8 s

Reports goodput (images/min, chat tokens/s), p50/p99 latency per kind and of every chat (streamed or not; with
--ignore-eos each runs to --max-tokens), the 429 rate and every 5xx by code. bench/bench_qos.py runs it against
stacks with and without the colocate QoS defaults.
Client i starts with kind i (so every kind runs when clients >= kinds); a client that gets a 429 waits its
Retry-After (at most 2 s) before its next request. `--rate R` is an open loop instead: requests arrive at R a second
(Poisson, seeded) whatever the answers' latency, at most --clients in flight, so two stacks get the same work.

A hostile mix (`--hostile-fraction 0.1`: that share of all clients, added to the --clients honest ones) runs
clients that send 40 MB bodies (declared and chunked) and 32 MB `[{},{},...]` bodies, read their streams
slowly or not at all for a while, and probe the prefix cache (a one-token guess at another prompt, reading
`cached_tokens`). With two tenant keys and an operator key (`--tenant-keys A,B --operator-key K`; the smoke and
--stack make their own), one more hostile client is tenant B against tenant A (bench/tenant_attempts.py: weight
pushes, adapter loads, A's trajectory read, fetched with Range, scored, deleted): each attempt is counted per
kind, and any 5xx or anything of A that B could see or change fails the run. Goodput counts the honest clients only; `--baseline` runs the same honest load without the
hostile clients first and prints the ratio (the target: within 5 %).

Importable (the CI load test builds on it):
    outcomes = run_load(base_url, clients=32, duration_s=60)      # list[Outcome]
    summary = summarize(outcomes, duration_s=60)
    outcomes = run_burst(base_url, n=32)                          # one request per client, all at once

Needs httpx and the repository's services/kit/sse.py (input images are written with zlib).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import shlex
import struct
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Optional
from urllib.parse import urlsplit

import httpx

from bench.tenant_attempts import (ATTEMPTS, TENANT_KINDS, TenantKeys, attempt, make_trajectory, next_attempt,
                                   tenant_problems)
from services.kit import sse  # the one SSE decoder; imports nothing heavy

KINDS = ("chat", "chat_stream", "image", "image_stream", "edit", "cancel", "bad")
DEFAULT_MIX = {"chat": 3, "chat_stream": 2, "image": 2, "image_stream": 2, "edit": 1, "cancel": 1, "bad": 1}
HOSTILE_KINDS = ("big_body", "slow_reader", "probe")
HOSTILE_ROWS = HOSTILE_KINDS + TENANT_KINDS      # every outcome kind goodput does not count
PROBE_PREFIX = "Clinic record 4411, confidential. The patient's test result is "


@dataclass
class Outcome:
    kind: str
    status: int                  # HTTP status, the status of an error event in a stream, 499 for a cancel we
    latency_s: float             # made, 0 when the connection failed
    error_code: Optional[str] = None
    images: int = 0
    tokens: int = 0
    started_s: float = 0.0       # since the run began
    retry_after_s: float = 0.0   # a 429's Retry-After
    cached_tokens: int = 0       # a probe: what the answer said was cached


@dataclass
class LoadConfig:
    size: str = "64x64"
    steps: int = 2
    max_tokens: int = 16
    api_key: Optional[str] = None
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))
    timeout_s: float = 600.0
    seed: int = 0
    slow_hold_s: float = 20.0    # a slow reader holds its stream this long without reading
    ignore_eos: bool = False     # chats run to max_tokens (a latency figure for exactly that many tokens)
    tenants: Optional[TenantKeys] = None   # with hostile clients: one more, tenant B against tenant A's trajectory
    rate: Optional[float] = None  # open loop: honest requests arrive at this many a second (Poisson), each on its own,
    #                               up to `clients` in flight; None: `clients` closed loops (each waits for its answer)


# ----------------------------------------------------------------------------------------- inputs
def png(width: int, height: int, rgb: tuple[int, int, int] = (200, 80, 40)) -> bytes:
    """A solid-colour RGB PNG."""
    row = b"\x00" + bytes(rgb) * width
    return _png(width, height, zlib.compress(row * height))


def bomb_png(side: int = 30000) -> bytes:
    """A decompression bomb: a tiny file declaring side x side pixels (900 M at the default)."""
    c = zlib.compressobj()
    row = b"\x00" + b"\x00" * 3 * side
    data = b"".join(c.compress(row) for _ in range(64)) + c.flush()
    return _png(side, side, data)


def _png(width: int, height: int, idat: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def hostile_requests() -> list[tuple[str, str, bytes, dict]]:
    """(name, path, raw body, extra headers) of inputs that must get a 4xx (never a 5xx)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("seed 2**64", "/v1/images/generations", json.dumps({"prompt": "x", "seed": 2**64}).encode(), {}),
        ("NaN", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', {}),
        ("Infinity", "/v1/images/generations", b'{"prompt": "x", "guidance_scale": Infinity}', {}),
        ("nested JSON", "/v1/chat/completions", b'{"a":' * 64 + b"1" + b"}" * 64, {}),
        ("bad size", "/v1/images/generations", json.dumps({"prompt": "x", "size": "100x100"}).encode(), {}),
        ("decompression bomb", "/v1/images/edits",
         json.dumps({"prompt": "x", "image": [data_url(bomb_png())]}).encode(), {}),
        ("empty messages", "/v1/chat/completions", json.dumps({**chat, "messages": []}).encode(), {}),
    ]


# ----------------------------------------------------------------------------------------- one request
class Client:
    def __init__(self, http: httpx.AsyncClient, cfg: LoadConfig, t0: float, source: Optional[str] = None):
        self.http, self.cfg, self.t0, self.source = http, cfg, t0, source
        self.edit_image = data_url(png(64, 64))
        self.hostile = hostile_requests()

    async def run(self, kind: str, rng: random.Random) -> Outcome:
        start = time.monotonic()
        try:
            out = await getattr(self, "_" + kind)(rng)
        except httpx.HTTPError as exc:
            out = Outcome(kind, 0, 0.0, type(exc).__name__)
        out.kind = out.kind if kind == "tenant" else kind     # a tenant attempt names its own kind
        out.latency_s = time.monotonic() - start      # a cancel: until it left, at the first progress event
        out.started_s = start - self.t0
        return out

    def _image_body(self, rng, **kw) -> dict:
        return {"prompt": f"a lighthouse at dusk, variant {rng.randrange(10**6)}", "size": self.cfg.size,
                "num_inference_steps": self.cfg.steps, "seed": rng.randrange(2**31), **kw}

    def _chat_extra(self) -> dict:
        return {"ignore_eos": True} if self.cfg.ignore_eos else {}

    async def _chat(self, rng) -> Outcome:
        r = await self.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Describe a fox, take {rng.randrange(10**6)}."}],
            "max_tokens": self.cfg.max_tokens, "temperature": 0.8, "seed": rng.randrange(2**31), **self._chat_extra()})
        if r.status_code != 200:
            return _failed("chat", r)
        return Outcome("chat", 200, 0.0, tokens=int(r.json().get("usage", {}).get("completion_tokens", 0)))

    async def _chat_stream(self, rng) -> Outcome:
        body = {"messages": [{"role": "user", "content": f"Count to ten, take {rng.randrange(10**6)}."}],
                "max_tokens": self.cfg.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **self._chat_extra()}
        tokens = chunks = 0
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _failed("chat_stream", r)
            async for ev in _events(r):
                if ev.get("error"):
                    return _stream_error("chat_stream", ev)
                if ev.get("usage"):
                    tokens = int(ev["usage"].get("completion_tokens", 0))
                elif ev.get("choices"):
                    chunks += 1
        return Outcome("chat_stream", 200, 0.0, tokens=tokens or chunks)

    async def _image(self, rng) -> Outcome:
        r = await self.http.post("/v1/images/generations", json=self._image_body(rng))
        if r.status_code != 200:
            return _failed("image", r)
        return Outcome("image", 200, 0.0, images=len(r.json().get("data", [])))

    async def _image_stream(self, rng, cancel: bool = False) -> Outcome:
        kind = "cancel" if cancel else "image_stream"
        images = 0
        async with self.http.stream("POST", "/v1/images/generations", json=self._image_body(rng, stream=True)) as r:
            if r.status_code != 200:
                await r.aread()
                return _failed(kind, r)
            async for ev in _events(r):
                t = ev.get("type", "")
                if t == "error" or ev.get("error"):
                    return _stream_error(kind, ev)
                if cancel and (t.endswith(".progress") or t.endswith(".queued")):
                    return Outcome(kind, 499, 0.0, "cancelled_by_client")   # leave mid-job: the stack cancels
                if t.endswith(".completed"):
                    images += 1
        return Outcome(kind, 200, 0.0, images=images)

    async def _cancel(self, rng) -> Outcome:
        return await self._image_stream(rng, cancel=True)

    async def _edit(self, rng) -> Outcome:
        r = await self.http.post("/v1/images/edits", json={
            "prompt": "make it blue", "image": [self.edit_image], "size": self.cfg.size,
            "num_inference_steps": self.cfg.steps, "seed": rng.randrange(2**31)})
        if r.status_code != 200:
            return _failed("edit", r)
        return Outcome("edit", 200, 0.0, images=len(r.json().get("data", [])))

    async def _bad(self, rng) -> Outcome:
        name, path, raw, headers = rng.choice(self.hostile)
        r = await self.http.post(path, content=raw, headers={"content-type": "application/json", **headers})
        out = _failed("bad", r) if r.status_code != 200 else Outcome("bad", 200, 0.0, "accepted")
        out.error_code = f"{name}: {out.error_code}"
        return out


    # ---- hostile clients (goodput counts none of them)
    async def _big_body(self, rng) -> Outcome:
        """A body over the route's limit: declared (Content-Length) or chunked, a long string or 32 MB of
        [{},{},...] (the element budget), sent until the gateway answers."""
        how = rng.choice(["declared", "chunked_string", "chunked_objects"])
        mb = 1000 * 1000
        if how == "declared":
            head, chunks = {"Content-Length": str(40 * mb)}, (b"a" * 65536 for _ in range(40 * mb // 65536))
        elif how == "chunked_string":
            head, chunks = {}, (c for c in [b'{"x": "', *(b"a" * 65536 for _ in range(40 * mb // 65536))])
        else:
            head, chunks = {}, (c for c in [b'{"messages": [', *(b"{}," * 21845 for _ in range(32 * mb // 65535))])
        status, code = await raw_post(str(self.http.base_url), "/v1/chat/completions",
                                      {**head, **{k: v for k, v in self.http.headers.items()
                                                  if k.lower() == "authorization"}}, chunks, self.source)
        return Outcome("big_body", status, 0.0, code if status == 429 else f"{how}: {code}")

    async def _slow_reader(self, rng) -> Outcome:
        """A streamed image whose client reads nothing for `slow_hold_s`, then reads one line a second (five),
        and leaves. Status 200: the stack made the image (GPU time spent on it)."""
        async with self.http.stream("POST", "/v1/images/generations", json=self._image_body(rng, stream=True)) as r:
            await asyncio.sleep(self.cfg.slow_hold_s)
            if r.status_code != 200:        # refused: nothing was made for it
                await r.aread()
                return _failed("slow_reader", r)
            lines = r.aiter_lines()
            try:
                for _ in range(5):
                    await anext(lines)
                    await asyncio.sleep(1.0)
            except (StopAsyncIteration, httpx.HTTPError):
                pass
            return Outcome("slow_reader", r.status_code, 0.0)

    async def _tenant(self, rng) -> Outcome:
        """The next tenant-on-tenant attempt (self.tenant_next) against tenant A's trajectory (self.tenant_tid)."""
        kind = self.tenant_next()
        r = await attempt(self.http, self.cfg.tenants, kind, self.tenant_tid)
        await r.aread()
        return _failed(kind, r) if r.status_code not in (200, 206) else Outcome(kind, r.status_code, 0.0)

    async def _probe(self, rng) -> Outcome:
        """Another client's prompt guessed one token at a time: what does `cached_tokens` give away?"""
        guess = rng.choice(["positive", "negative", "pos", "neg", "inconclusive"])
        r = await self.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROBE_PREFIX + guess}], "max_tokens": 1})
        if r.status_code != 200:
            return _failed("probe", r)
        usage = r.json().get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return Outcome("probe", 200, 0.0, cached_tokens=cached)


async def raw_post(base_url: str, path: str, headers: dict, chunks,
                   source: Optional[str] = None) -> tuple[int, Optional[str]]:
    """POST a body piece by piece over a plain connection (chunked unless Content-Length is given) until the
    server answers; (status, error code). The server may close while we still send: its answer counts."""
    u = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80,
                                                   local_addr=(source, 0) if source else None)
    chunked = "Content-Length" not in headers
    lines = [f"POST {path} HTTP/1.1", f"Host: {u.netloc}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())] + (["Transfer-Encoding: chunked"] if chunked else [])
    answer = asyncio.ensure_future(reader.read(65536))
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        for chunk in chunks:
            if answer.done():
                break
            writer.write((f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") if chunked else chunk)
            await writer.drain()
        raw = await asyncio.wait_for(answer, 60)
    except (ConnectionError, asyncio.TimeoutError) as exc:
        raw = answer.result() if answer.done() and not answer.exception() else b""
        if not raw:
            return 0, type(exc).__name__
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split()[1])
        code = json.loads(body).get("error", {}).get("code")
    except (IndexError, ValueError):
        return (int(head.split()[1]) if len(head.split()) > 1 else 0), None
    return status, code


def _failed(kind: str, r: httpx.Response) -> Outcome:
    try:
        code = r.json().get("error", {}).get("code")
    except ValueError:
        code = None
    out = Outcome(kind, r.status_code, 0.0, code or f"http_{r.status_code}")
    ra = r.headers.get("retry-after", "")
    if r.status_code == 429 and ra.isdigit():
        out.retry_after_s = float(ra)
    return out


def _stream_error(kind: str, ev: dict) -> Outcome:
    err = ev.get("error") if isinstance(ev.get("error"), dict) else {}
    return Outcome(kind, int(ev.get("status") or err.get("status") or 500), 0.0, err.get("code") or "stream_error")


def _events(r: httpx.Response):
    return sse.aevents(r.aiter_lines())


# ----------------------------------------------------------------------------------------- drivers
def _http(base_url: str, cfg: LoadConfig, clients: int, source: Optional[str] = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=clients * 2 + 4)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
                             transport=httpx.AsyncHTTPTransport(limits=limits, local_address=source))


def hostile_source(base_url: str, i: int) -> Optional[str]:
    """Hostile client i's own address: 127.0.0.(2+i) when the stack is on 127.0.0.1 (all of 127/8 is loopback on
    Linux), so the gateway can tell it from the honest clients (127.0.0.1), as it would tell two hosts apart;
    None (the honest clients' address) elsewhere."""
    host = urlsplit(base_url).hostname
    return f"127.0.0.{2 + i % 250}" if host in ("127.0.0.1", "localhost") and sys.platform.startswith("linux") \
        else None


def hostile_clients(clients: int, fraction: float) -> int:
    """Hostile clients added to `clients` honest ones so that they are `fraction` of all."""
    return 0 if fraction <= 0 else max(1, round(clients * fraction / (1 - fraction)))


async def run_load_async(base_url: str, clients: int, duration_s: float, cfg: LoadConfig,
                         hostile: int = 0) -> list[Outcome]:
    kinds = [k for k in KINDS if cfg.mix.get(k, 0) > 0]
    weights = [cfg.mix[k] for k in kinds]
    t0 = time.monotonic()
    deadline = t0 + duration_s
    outcomes: list[Outcome] = []
    async with _http(base_url, cfg, clients) as http:
        client = Client(http, cfg, t0)

        async def one_hostile(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + 500 + i)
            kind = HOSTILE_KINDS[i % len(HOSTILE_KINDS)]
            source = hostile_source(base_url, i)
            async with _http(base_url, cfg, 1, source) as own:
                mine = Client(own, cfg, t0, source)
                while time.monotonic() < deadline:
                    out = await mine.run(kind, rng)
                    outcomes.append(out)
                    kind = rng.choice(HOSTILE_KINDS)
                    if out.status == 429:       # refused (on probation): as an honest client, it waits a little
                        await asyncio.sleep(min(2.0, out.retry_after_s or 1.0))

        async def one_tenant() -> None:
            """Tenant A's rollout, then tenant B's (and the operator's) attempts back to back, then A reads its own
            trajectory: B deleted nothing."""
            source = hostile_source(base_url, hostile)
            async with _http(base_url, cfg, 1, source) as own:
                start = time.monotonic()
                status, tid = await make_trajectory(own, cfg.tenants)
                outcomes.append(Outcome("a_rollout", status, time.monotonic() - start, started_s=start - t0))
                if tid is None:
                    return
                mine = Client(own, cfg, t0, source)
                mine.tenant_next, mine.tenant_tid = next_attempt(), tid
                n = 0           # one whole round at least, however long the rollout took
                while n < len(ATTEMPTS) or time.monotonic() < deadline:
                    outcomes.append(await mine.run("tenant", random.Random(0)))
                    n += 1
                mine.tenant_next = lambda: "a_reads_own"
                outcomes.append(await mine.run("tenant", random.Random(0)))
                await own.delete(f"/v1/rl/trajectories/{tid}", headers={"Authorization": f"Bearer {cfg.tenants.a}"})

        async def one_client(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + i)
            kind = kinds[i % len(kinds)]           # first requests cover every kind, then the weighted mix
            while time.monotonic() < deadline:
                out = await client.run(kind, rng)
                kind = rng.choices(kinds, weights)[0]
                outcomes.append(out)
                if out.status == 429:
                    await asyncio.sleep(min(2.0, out.retry_after_s or 1.0))

        async def open_loop() -> None:
            """Arrivals at cfg.rate a second whatever the answers' latency: closed-loop clients send a side that
            answers chats fast more chats, so two stacks under them do not get the same work (docs/benchmarks/load.md).
            The first arrivals cover every kind, then the weighted mix; at most `clients` in flight (an arrival
            beyond waits for one: its latency includes that wait, as a user's would)."""
            rng = random.Random(cfg.seed * 1000 + 999)
            room = asyncio.Semaphore(clients)

            async def one(kind: str, seed: float) -> None:
                arrived = time.monotonic()
                async with room:
                    waited = time.monotonic() - arrived
                    out = await client.run(kind, random.Random(seed))
                out.latency_s += waited          # from its arrival, as a user would count it
                outcomes.append(out)

            tasks, due, i = [], time.monotonic(), 0
            while True:
                due += rng.expovariate(cfg.rate)
                if due >= deadline:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                kind = kinds[i] if i < len(kinds) else rng.choices(kinds, weights)[0]
                i += 1
                tasks.append(asyncio.create_task(one(kind, rng.random())))
            await asyncio.gather(*tasks)

        honest = [open_loop()] if cfg.rate else [one_client(i) for i in range(clients)]
        tenant = [one_tenant()] if hostile and cfg.tenants else []
        await asyncio.gather(*honest, *(one_hostile(i) for i in range(hostile)), *tenant)
    return outcomes


async def run_burst_async(base_url: str, n: int, cfg: LoadConfig) -> list[Outcome]:
    kinds = [k for k in KINDS if cfg.mix.get(k, 0) > 0]
    rng = random.Random(cfg.seed)
    plan = [kinds[i % len(kinds)] for i in range(n)]          # every kind, then round-robin
    t0 = time.monotonic()
    async with _http(base_url, cfg, n) as http:
        client = Client(http, cfg, t0)
        outs = await asyncio.gather(*(client.run(k, random.Random(rng.random())) for k in plan))
    return list(outs)


def run_load(base_url: str, clients: int = 32, duration_s: float = 60.0, cfg: Optional[LoadConfig] = None,
             hostile: int = 0, **kw) -> list[Outcome]:
    """N clients (and `hostile` hostile ones), back to back, for `duration_s` (requests in flight at the deadline
    finish)."""
    return asyncio.run(run_load_async(base_url, clients, duration_s, cfg or LoadConfig(**kw), hostile))


def run_burst(base_url: str, n: int = 32, cfg: Optional[LoadConfig] = None, **kw) -> list[Outcome]:
    """n requests at once, one of each kind in turn."""
    return asyncio.run(run_burst_async(base_url, n, cfg or LoadConfig(**kw)))


# ----------------------------------------------------------------------------------------- report
def _pct(xs: list[float], p: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    """Goodput (images, tokens, 429s, 5xx) over the honest clients; the hostile ones under `hostile`."""
    hostile_rows = [o for o in outcomes if o.kind in HOSTILE_ROWS]
    outcomes = [o for o in outcomes if o.kind not in HOSTILE_ROWS]
    by_kind = {}
    for kind in KINDS:
        rows = [o for o in outcomes if o.kind == kind]
        if not rows:
            continue
        ok = [o for o in rows if o.status == 200]
        statuses: dict[str, int] = {}
        for o in rows:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        by_kind[kind] = {"n": len(rows), "ok": len(ok), "statuses": statuses,
                         "p50_s": _pct([o.latency_s for o in ok], 0.5), "p99_s": _pct([o.latency_s for o in ok], 0.99)}
    five = [o for o in outcomes if o.status >= 500]
    codes: dict[str, int] = {}
    for o in five:
        codes[f"{o.status} {o.error_code}"] = codes.get(f"{o.status} {o.error_code}", 0) + 1
    images = sum(o.images for o in outcomes if o.status == 200)
    chats = [o for o in outcomes if o.status == 200 and o.kind.startswith("chat")]
    tokens = sum(o.tokens for o in chats)
    return {"duration_s": duration_s, "requests": len(outcomes), "images": images,
            "images_per_min": 60.0 * images / duration_s if duration_s else None,
            "tokens_per_s": tokens / duration_s if duration_s else None,
            # every answered chat, streamed or not (the colocate QoS target: p50 / p99 of a 64-token chat)
            "chat_p50_s": _pct([o.latency_s for o in chats], 0.5), "chat_p99_s": _pct([o.latency_s for o in chats], 0.99),
            "chat_tokens_mean": tokens / len(chats) if chats else None,
            "rate_429": sum(o.status == 429 for o in outcomes) / max(1, len(outcomes)),
            "count_5xx": len(five), "codes_5xx": codes,
            "transport_errors": sum(o.status == 0 for o in outcomes), "by_kind": by_kind,
            "hostile": summarize_hostile(hostile_rows)}


def summarize_hostile(rows: list[Outcome]) -> dict:
    out: dict = {}
    for kind in HOSTILE_ROWS:
        mine = [o for o in rows if o.kind == kind]
        if not mine:
            continue
        statuses: dict[str, int] = {}
        for o in mine:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        out[kind] = {"n": len(mine), "statuses": statuses}
        refused = [o.error_code for o in mine if o.status == 429]
        if refused:
            out[kind]["codes_429"] = {c: refused.count(c) for c in sorted(set(map(str, refused)))}
        if kind == "probe":
            out[kind]["cached_tokens_seen"] = sorted({o.cached_tokens for o in mine if o.status == 200})
    return out


def markdown(summary: dict, title: str = "load") -> str:
    fmt = (lambda v: f"{v:.2f}" if v is not None else "-")
    lines = [f"### {title}", "",
             f"{summary['requests']} requests in {summary['duration_s']:.0f} s: "
             f"{summary['images_per_min']:.1f} images/min, {summary['tokens_per_s']:.1f} chat tokens/s, "
             f"chat p50 / p99 {fmt(summary['chat_p50_s'])} / {fmt(summary['chat_p99_s'])} s "
             f"({fmt(summary['chat_tokens_mean'])} tokens a chat), "
             f"429 rate {100 * summary['rate_429']:.1f}%, 5xx {summary['count_5xx']}"
             + (f" {summary['codes_5xx']}" if summary["codes_5xx"] else "")
             + f", connection errors {summary['transport_errors']}", "",
             "| kind | requests | ok | p50 s | p99 s | statuses |", "|---|---:|---:|---:|---:|---|"]
    for kind, k in summary["by_kind"].items():
        lines.append(f"| {kind} | {k['n']} | {k['ok']} | {fmt(k['p50_s'])} | {fmt(k['p99_s'])} | "
                     f"{', '.join(f'{s}: {c}' for s, c in sorted(k['statuses'].items()))} |")
    for kind, k in summary.get("hostile", {}).items():
        extra = f" (cached_tokens seen: {k['cached_tokens_seen']})" if "cached_tokens_seen" in k else ""
        extra += f" (429: {k['codes_429']})" if k.get("codes_429") else ""
        lines.append(f"| hostile {kind} | {k['n']} | - | - | - | "
                     f"{', '.join(f'{s}: {c}' for s, c in sorted(k['statuses'].items()))}{extra} |")
    if summary.get("hostile") and "images_for_hostile" in summary:
        lines += ["", f"Images made for the hostile clients (the gateway's images beyond the honest ones): "
                      f"{summary['images_for_hostile']}"]
    if summary.get("gateway"):
        lines += ["", "Gateway over the run: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["gateway"].items())]
    return "\n".join(lines) + "\n"


GATEWAY_COUNTERS = ("u1serve_gateway_images_total", "u1serve_gateway_client_strikes_total",
                    "u1serve_gateway_probation_refused_total", "u1serve_gateway_slow_readers_cut_total")


def gateway_counters(base_url: str, api_key: Optional[str]) -> dict:
    """The gateway's strike / probation / slow-reader counters from its /metrics ({} where it cannot say)."""
    try:
        r = httpx.get(base_url + "/metrics", timeout=10,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError:
        return {}
    out = {}
    for line in r.text.splitlines() if r.status_code == 200 else []:
        name, _, value = line.partition(" ")
        if name in GATEWAY_COUNTERS:
            out[name.removeprefix("u1serve_gateway_").removesuffix("_total")] = float(value)
    return out


def measured_run(base_url: str, clients: int, duration_s: float, cfg: LoadConfig, hostile: int = 0):
    """One run: (outcomes, its summary with the gateway's counters over the run under `gateway`)."""
    before = gateway_counters(base_url, cfg.api_key)
    outcomes = run_load(base_url, clients, duration_s, cfg, hostile)
    summary = summarize(outcomes, duration_s)
    after = gateway_counters(base_url, cfg.api_key)
    summary["gateway"] = {k: after[k] - before.get(k, 0.0) for k in after}
    if "images" in summary["gateway"]:      # what the stack made beyond the honest clients' images
        summary["images_for_hostile"] = max(0, int(summary["gateway"]["images"]) - summary["images"])
    return outcomes, summary


def goodput_ratio(base: dict, hostile: dict) -> dict:
    """Honest goodput with hostile clients as a share of the baseline's (images/min and chat tokens/s)."""
    def ratio(key):
        return hostile[key] / base[key] if base.get(key) else None
    return {"images_per_min": ratio("images_per_min"), "tokens_per_s": ratio("tokens_per_s")}


def hostile_problems(summary: dict, tenants: bool = False) -> list[str]:
    """What a hostile mix must never cause: a 5xx for anyone, a big body accepted; with tenant keys, anything of
    one tenant another key could see or change (bench/tenant_attempts.py)."""
    out = tenant_problems(summary.get("hostile", {})) if tenants else []
    for kind, k in summary.get("hostile", {}).items():
        if kind in TENANT_KINDS:
            continue             # tenant_problems judged them
        five = {s: c for s, c in k["statuses"].items() if s.startswith("5")}
        if five:
            out.append(f"hostile {kind}: 5xx {five}")
    big = summary.get("hostile", {}).get("big_body", {}).get("statuses", {})
    if big.get("200"):
        out.append(f"{big['200']} oversized bodies were accepted")
    return out


# ----------------------------------------------------------------------------------------- smoke mode
def smoke(args) -> int:
    """A tiny CPU stack (`u1serve up --model tiny`), a short run, and the invariants CI checks."""
    import shutil

    from bench.profile_stack import Stack
    tenants = args.hostile_fraction > 0          # the hostile mix includes tenant B against tenant A
    if tenants and not roles_supported():
        print("FAIL the tenant-on-tenant attempts need `u1serve up --admin-api-key-file` (issue 37's operator "
              "roles), which this checkout does not have: nothing ran")
        return 1
    stack = Stack(profile="cpu", out_dir=args.out_dir, tenants=tenants)
    try:
        with stack:
            cfg = LoadConfig(size="64x64", steps=2, max_tokens=8, api_key=stack.api_key, seed=args.seed,
                             slow_hold_s=2.0, tenants=stack_tenants(stack) if tenants else None)
            hostile = hostile_clients(args.clients, args.hostile_fraction)
            outcomes, summary = measured_run(stack.base, args.clients, args.duration, cfg, hostile)
            problems = stack.settle_problems()
        problems += [] if stack.exit_code == 0 else [f"u1serve up exited {stack.exit_code}"]
    finally:
        if args.out_dir is None:
            shutil.rmtree(stack.dir, ignore_errors=True)
    print(markdown(summary, "bench_load --smoke (CPU, tiny checkpoint)"))
    _write(args, summary, outcomes)
    missing = [k for k in KINDS if not summary["by_kind"].get(k, {}).get("n")]
    bad_ok = summary["by_kind"].get("bad", {}).get("ok", 0)
    problems += [f"no {k} request ran" for k in missing]
    problems += [f"{summary['count_5xx']} 5xx: {summary['codes_5xx']}"] if summary["count_5xx"] else []
    problems += [f"{bad_ok} hostile inputs were accepted"] if bad_ok else []
    problems += hostile_problems(summary, tenants=cfg.tenants is not None)
    if args.hostile_fraction > 0:
        problems += [f"no hostile {k} request ran" for k in HOSTILE_KINDS if k not in summary["hostile"]]
    for p in problems:
        print(f"FAIL {p}")
    return 1 if problems else 0


def roles_supported() -> bool:
    """Whether `u1serve up` (so the gateway) of this checkout takes an operator key file."""
    import argparse

    from services.launch.stack import add_stack_flags
    p = argparse.ArgumentParser()
    add_stack_flags(p, model_default=None)
    return any("--admin-api-key-file" in a.option_strings for a in p._actions)


def stack_tenants(stack) -> TenantKeys:
    """A deploy/gpu_smoke.py Stack's two tenant keys and operator key (started with tenants=True)."""
    return TenantKeys(a=stack.api_key, b=stack.tenant_b, operator=stack.operator_key)


def _write(args, summary: dict, outcomes: list[Outcome]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "outcomes": [asdict(o) for o in outcomes]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "a") as f:
            if summary.get("baseline"):
                f.write(markdown(summary["baseline"], f"{args.title}: baseline") + "\n")
            f.write(markdown(summary, args.title) + "\n")
            if summary.get("goodput_ratio"):
                f.write("Honest goodput with hostile clients, share of the baseline: " + ", ".join(
                    f"{k} {100 * v:.1f}%" for k, v in summary["goodput_ratio"].items() if v is not None) + "\n\n")


def main(argv=None) -> int:
    from services.base import knobs
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=knobs.API_KEY.get())
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="seconds")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="chats run to --max-tokens (latency for that many tokens)")
    p.add_argument("--mix", default=None, help="weights, e.g. chat=3,image=1,bad=0 (default: every kind)")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: honest requests arrive at this many a second (Poisson, kinds from --mix), at most "
                        "--clients in flight; default: --clients closed loops")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="summary + every outcome")
    p.add_argument("--markdown", default=None, help="append the result table here")
    p.add_argument("--title", default="load")
    p.add_argument("--hostile-fraction", type=float, default=0.0,
                   help="share of all clients that are hostile (big bodies, slow readers, cache probes), added to "
                        "--clients honest ones")
    p.add_argument("--baseline", action="store_true",
                   help="with --hostile-fraction: run the honest load alone first, then with the hostile clients, "
                        "and print honest goodput as a share of the baseline")
    p.add_argument("--tenant-keys", default=None, metavar="A,B",
                   help="with --hostile-fraction against --base: two tenant keys; tenant B tries tenant A's "
                        "trajectory and the operator routes (needs --operator-key, RL and runtime LoRA on)")
    p.add_argument("--operator-key", default=None, help="the operator key of --tenant-keys' stack")
    p.add_argument("--slow-hold-s", type=float, default=LoadConfig.slow_hold_s,
                   help="a hostile slow reader holds its image stream this long without reading")
    p.add_argument("--stack", default=None, metavar="PROFILE",
                   help="start `u1serve up` of this deploy/gpu_smoke.py profile (cpu: the tiny checkpoint; colocate-1: "
                        "one GPU, random 8B weights) for the run(s), with its own key and port, and stop it after")
    p.add_argument("--stack-flags", default="",
                   help="more `u1serve up` flags for --stack, one string (e.g. \"--gateway-args '--strike-hold-s 0'\")")
    p.add_argument("--smoke", action="store_true", help="CPU: start a tiny stack, 8 clients for 8 s, check")
    p.add_argument("--out-dir", default=None, help="--smoke / --stack: where the stack's run dir goes")
    args = p.parse_args(argv)
    if args.smoke:
        if args.clients == 32:
            args.clients = 8
        if args.duration == 120.0:
            args.duration = 8.0
        return smoke(args)
    mix = dict(DEFAULT_MIX)
    if args.mix:
        mix = {k: 0 for k in KINDS}
        for item in args.mix.split(","):
            k, _, v = item.partition("=")
            if k not in KINDS:
                raise SystemExit(f"--mix: unknown kind {k!r} (kinds: {', '.join(KINDS)})")
            mix[k] = float(v)
    cfg = LoadConfig(size=args.size, steps=args.steps, max_tokens=args.max_tokens, api_key=args.api_key, mix=mix,
                     seed=args.seed, ignore_eos=args.ignore_eos, slow_hold_s=args.slow_hold_s, rate=args.rate)
    if args.tenant_keys:
        a, _, b = args.tenant_keys.partition(",")
        if not (a and b and args.operator_key):
            raise SystemExit("--tenant-keys A,B needs two keys and --operator-key")
        cfg.tenants = TenantKeys(a=a, b=b, operator=args.operator_key)
        cfg.api_key = cfg.api_key or a
    if not args.stack:
        return measure(args, cfg)
    from bench.profile_stack import Stack
    tenants = args.hostile_fraction > 0 and roles_supported()
    with Stack(args.stack, out_dir=args.out_dir, extra_flags=tuple(shlex.split(args.stack_flags)),
               tenants=tenants) as stack:
        print(f"stack {args.stack} up in {stack.startup_s:.0f} s ({stack.dir})", flush=True)
        args.base, cfg.api_key = stack.base, stack.api_key
        cfg.tenants = stack_tenants(stack) if tenants else None
        rc = measure(args, cfg)
        problems = stack.settle_problems()
    problems += [] if stack.exit_code == 0 else [f"u1serve up exited {stack.exit_code}"]
    for p in problems:
        print(f"FAIL {p}")
    return 1 if problems else rc


def measure(args, cfg: LoadConfig) -> int:
    """The run(s) against args.base: the honest baseline first with --baseline, then the (hostile) mix."""
    hostile = hostile_clients(args.clients, args.hostile_fraction)
    base_summary = None
    if args.baseline and hostile:
        base_summary = measured_run(args.base, args.clients, args.duration, cfg)[1]
        print(markdown(base_summary, f"{args.title}: baseline, {args.clients} honest clients"), flush=True)
    outcomes, summary = measured_run(args.base, args.clients, args.duration, cfg, hostile)
    print(markdown(summary, f"{args.title}: {args.clients} honest + {hostile} hostile clients" if hostile
                   else args.title))
    if base_summary is not None:
        summary["baseline"] = base_summary
        summary["goodput_ratio"] = goodput_ratio(base_summary, summary)
        r = summary["goodput_ratio"]
        print("honest goodput with hostile clients, share of the baseline: "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r.items() if v is not None))
    _write(args, summary, outcomes)
    problems = hostile_problems(summary, tenants=cfg.tenants is not None)
    if args.hostile_fraction > 0 and cfg.tenants is None:
        print("note: no tenant-on-tenant attempts (no --tenant-keys / --operator-key, or no operator roles here)")
    for p in problems:
        print(f"FAIL {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
