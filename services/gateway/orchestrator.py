"""One image job across the two engines: prefix handles from understanding, denoise on generation. A segment of
an interleaved answer (interleave.py) is the same job whose understanding stream also carries the answer's text
and may end it without an image (`answer_done`).

However a job ends early (client gone, upstream timeout or deadline, an engine error, a 429, a broken
connection), one path undoes it: the engine still working on it is told to stop (`/internal/abort`, on
understanding or generation) and the prefix pages the gateway owns are released
(handles.PrefixHandles decides which). The undo runs as a background task, so the client's answer never
waits for a hung engine.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional

import httpx

from services.contract.control import (AbortRequest, AnswerDoneEvent, ErrorEvent, HandlesEvent, ImageEvent,
                                      ProgressEvent, TextEvent, ThinkDeltaEvent)
from services.contract.rl_weights import WEIGHTS_VERSION_MISMATCH
from services.kit import timeline
from services.kit.errors import APIError, unavailable

from .config import GatewayConfig
from .engine_events import generation_event, prefix_event, relayed
from .handles import GATEWAY, PrefixHandles
from .jobs import ImageJob
from .metrics import GatewayMetrics
from .routing import EndpointPool
from .upstream import (CONTROL_TIMEOUT_S, Deadline, Janitor, Target, engine_headers, error_from_event,
                       error_from_response, is_timeout, open_stream, reading, release_pages, tell)

log = logging.getLogger("u1serve.gateway")
UND, GEN = "understanding", "generation"


class Orchestrator:
    def __init__(self, cfg: GatewayConfig, http: httpx.AsyncClient, und: EndpointPool, gen: EndpointPool,
                 metrics: GatewayMetrics, janitor: Janitor):
        self.cfg, self.http, self.und, self.gen, self.metrics = cfg, http, und, gen, metrics
        self.janitor = janitor

    async def run(self, job: ImageJob, deadline: Deadline, pins: Optional[dict] = None) -> AsyncIterator[dict]:
        """`attempt`, once more when generation refused the job because a weight update came between its prefix
        and its denoising (`weights_version_mismatch`) and the client has seen nothing of it yet."""
        seen = False
        for last in (False, True):
            try:
                async for ev in self.attempt(job, deadline, pins):
                    seen = seen or ev.get("type") not in ("queued", "think_done") or bool(ev.get("think_text"))
                    yield ev
                return
            except APIError as err:
                if last or seen or err.code != WEIGHTS_VERSION_MISMATCH:
                    raise
                log.info("job %s: weights changed between prefix and denoising; running it again", job.request_id)

    async def attempt(self, job: ImageJob, deadline: Deadline, pins: Optional[dict] = None) -> AsyncIterator[dict]:
        """Yield the engines' events, checked against the contract (engine_events.py): think_delta (or a segment's
        `text`), think_done (with the rest of the handles event under `prefix`), then generation's (queued,
        progress, partial_image, image, rl_result); or `answer_done` when an interleave segment ends the answer.
        `pins` {service: url} keeps the job on the endpoints an earlier part of the same answer used (filled in
        here). Raises APIError; cancelling or closing the iterator undoes the job."""
        rid = job.request_id
        hdrs = engine_headers(self.cfg.internal_token, rid)
        handles = PrefixHandles()
        prefix_body = job.prefix_body()       # a full dump (input images, a segment's transcript): once
        und, gen = Target(key=job.route_key(prefix_body)), Target()
        working: Optional[str] = None          # the engine that may still be working on the job
        phase = UND
        started = time.monotonic()
        self.metrics.image_jobs_running.inc()
        try:
            working = UND
            und_pool = self._pool(self.und, pins)
            resp = await self._open(und_pool, job.prefix_path, prefix_body, hdrs, deadline, und, pins)
            think_text, prefix, ended = None, {}, None
            async with reading(und_pool, und.ep, resp):
                if resp.status_code != 200:
                    working = None
                    raise await error_from_response(resp, UND, deadline)
                async for raw in deadline.events(resp, UND):
                    ev = prefix_event(raw)           # the contract's types (engine_events.py); None: undeclared
                    if isinstance(ev, ThinkDeltaEvent):
                        yield {"type": "think_delta", "text": ev.text}
                    elif isinstance(ev, TextEvent):
                        yield relayed(raw, ev)
                    elif isinstance(ev, HandlesEvent):
                        handles.received(ev.handles)
                        think_text = ev.think_text
                        prefix = {k: v for k, v in relayed(raw, ev).items()
                                  if k not in ("type", "handles", "think_text")}
                    elif isinstance(ev, AnswerDoneEvent):
                        ended = relayed(raw, ev)
                    elif isinstance(ev, ErrorEvent):
                        working = None
                        raise error_from_event(raw, UND)
            working = None
            if ended is not None and handles.owner != GATEWAY:
                yield {**ended, "type": "answer_done"}
                return
            if handles.owner != GATEWAY:
                raise unavailable("understanding service ended the prefix stream without handles",
                                  code="upstream_protocol_error")
            yield {"type": "think_done", "think_text": think_text, "prefix": prefix}

            timeline.mark("gateway", "prefix_done")
            phase = GEN
            working = GEN
            gen.source = und.ep                # a generation replica that can read this replica's KV
            gen_pool = self._pool(self.gen, pins)
            # not moved on after a 429 / 503 head: generation frees the pages of a job it refuses
            resp = await self._open(gen_pool, job.generate_path(), job.generate_body(handles.handles), hdrs,
                                    deadline, gen, pins, retry_refused=False)
            images = 0
            async with reading(gen_pool, gen.ep, resp):
                if resp.status_code != 200:
                    working = None
                    raise await error_from_response(resp, GEN, deadline)
                handles.accepted()
                async for raw in deadline.events(resp, GEN):
                    ev = generation_event(raw)       # the contract's types (engine_events.py); None: undeclared
                    if isinstance(ev, ErrorEvent):
                        # the job is over on generation's side: it imports nothing after this
                        working = None
                        handles.returned()
                        raise error_from_event(ev.model_dump(), GEN)
                    if isinstance(ev, ProgressEvent):
                        self.metrics.denoise_steps.inc()
                    elif isinstance(ev, ImageEvent):
                        images += 1
                        self.metrics.images.inc()
                    if ev is not None:
                        yield relayed(raw, ev)
            working = None
            if images < job.expected_images():
                handles.returned()
                gen_pool.down(gen.ep)
                raise unavailable(f"generation service stopped after {images} of {job.expected_images()} images",
                                  code="generation_unavailable")
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.cancelled.inc()
            raise
        except APIError as err:
            if is_timeout(err):
                self.metrics.timeouts.labels(err.code).inc()
            self.metrics.upstream_errors.labels(phase, str(err.code)).inc()
            raise
        finally:
            self.metrics.image_jobs_running.dec()
            self.metrics.image_job_seconds.observe(time.monotonic() - started)
            self._undo_later(rid, hdrs, working, und, gen, handles)

    @staticmethod
    def _pool(pool: EndpointPool, pins: Optional[dict]) -> EndpointPool:
        url = (pins or {}).get(pool.service)
        return pool if url is None else pool.pinned(url)

    async def _open(self, pool: EndpointPool, path: str, body: dict, hdrs: dict, deadline: Deadline,
                    target: Target, pins: Optional[dict] = None, retry_refused: bool = True) -> httpx.Response:
        try:
            resp = await open_stream(self.http, pool, path, body, hdrs, deadline, target,
                                     retry_refused=retry_refused)
        except APIError as err:
            if not is_timeout(err):
                target.ep = None         # refused everywhere: no engine got the request
            raise
        if pins is not None:
            pins[pool.service] = target.ep.url
        return resp

    # ------------------------------------------------------------------------------------------ undo
    def _undo_later(self, rid: str, hdrs: dict, working: Optional[str], und: Target, gen: Target,
                    handles: PrefixHandles) -> None:
        target = {UND: und, GEN: gen}.get(working)
        if (target is None or target.ep is None) and handles.owner != GATEWAY:
            handles.close()              # no engine to stop, no pages to free
            return
        self.janitor.later(self._undo(rid, hdrs, working, und, gen, handles))

    async def _undo(self, rid: str, hdrs: dict, working: Optional[str], und: Target, gen: Target,
                    handles: PrefixHandles) -> None:
        """Stop the engine still working on the job, then release the pages nobody else will free."""
        abort = AbortRequest(request_id=rid).model_dump()
        if working == UND and und.ep is not None:
            await tell(self.http, und.ep.url + "/internal/abort", abort, hdrs, CONTROL_TIMEOUT_S)
        if working == GEN:
            answer = None
            if gen.ep is not None:
                answer = await tell(self.http, gen.ep.url + "/internal/abort", abort, hdrs, CONTROL_TIMEOUT_S)
            if not (isinstance(answer, dict) and answer.get("aborted")):
                handles.returned()       # generation did not confirm it has the job: it may never free them
        release = handles.close()
        if release and und.ep is not None:
            await release_pages(self.http, und.ep.url, release, hdrs)
