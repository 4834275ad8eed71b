"""One image job across the two engines: prefix handles from understanding, denoise on generation.

Ownership of the KV handles: understanding allocates them; once generation has accepted the
`/internal/generate` request it owns them (it imports and frees them, also on cancel). The gateway
releases them itself only when generation never accepted them, died holding them, or failed the
job (a failed job imports nothing more; release is idempotent).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import anyio
import httpx

from .config import GatewayConfig
from .errors import APIError, from_upstream, unavailable
from .metrics import GatewayMetrics
from .params import ImageJob
from .upstream import (EndpointPool, connection_error, error_from_response, headers,
                       open_stream, sse_events)

log = logging.getLogger("u1serve.gateway")


class Orchestrator:
    def __init__(self, cfg: GatewayConfig, http: httpx.AsyncClient, und: EndpointPool,
                 gen: EndpointPool, metrics: GatewayMetrics):
        self.cfg, self.http, self.und, self.gen, self.metrics = cfg, http, und, gen, metrics

    def _timeout(self) -> httpx.Timeout:
        # image jobs are long; only the connect phase is bounded
        return httpx.Timeout(None, connect=self.cfg.connect_timeout_s)

    async def run(self, job: ImageJob, request_id: str) -> AsyncIterator[dict]:
        """Yield events: think_delta, think_done, queued, progress, image. Raises APIError."""
        hdrs = headers(self.cfg.internal_token, request_id)
        handles: dict | None = None
        gen_owns = gen_dead = gen_failed = cancelled = False
        und_ep = gen_ep = None
        phase = "prefix"
        started = time.monotonic()
        self.metrics.image_jobs_running.inc()
        try:
            und_ep, resp = await open_stream(self.http, self.und, "/internal/image_prefix",
                                             job.prefix_body(request_id), hdrs, self._timeout())
            with self.und.use(und_ep):
                think_text = None
                try:
                    if resp.status_code != 200:
                        raise await error_from_response(resp, "understanding")
                    und_ep.mark_up()
                    async for ev in sse_events(resp):
                        kind = ev.get("type")
                        if kind == "think_delta":
                            yield {"type": "think_delta", "text": ev.get("text", "")}
                        elif kind == "handles":
                            handles = ev.get("handles")
                            think_text = ev.get("think_text")
                        elif kind == "error":
                            raise from_upstream(int(ev.get("status", 500)), ev, "understanding")
                except httpx.TransportError as exc:
                    self.und.down(und_ep)
                    raise connection_error("understanding", und_ep.url, exc) from None
                finally:
                    with anyio.CancelScope(shield=True):
                        await resp.aclose()
            if not isinstance(handles, dict) or "cond" not in handles:
                raise unavailable("understanding service ended the prefix stream without handles",
                                  code="upstream_protocol_error")
            yield {"type": "think_done", "think_text": think_text}

            phase = "generate"
            gen_ep, resp = await open_stream(self.http, self.gen, "/internal/generate",
                                             job.generate_body(request_id, handles), hdrs,
                                             self._timeout())
            with self.gen.use(gen_ep):
                images = 0
                try:
                    if resp.status_code != 200:
                        raise await error_from_response(resp, "generation")
                    gen_owns = True
                    gen_ep.mark_up()
                    async for ev in sse_events(resp):
                        kind = ev.get("type")
                        if kind == "error":
                            # the job is over on generation's side: it imports nothing after this
                            gen_failed = True
                            raise from_upstream(int(ev.get("status", 500)), ev, "generation")
                        if kind == "progress":
                            self.metrics.denoise_steps.inc()
                        if kind == "image":
                            images += 1
                            self.metrics.images.inc()
                        if kind in ("queued", "progress", "image"):
                            yield ev
                except httpx.TransportError as exc:
                    gen_dead = gen_owns
                    self.gen.down(gen_ep)
                    raise connection_error("generation", gen_ep.url, exc) from None
                finally:
                    with anyio.CancelScope(shield=True):
                        await resp.aclose()
                if images < job.n:
                    gen_dead = True
                    self.gen.down(gen_ep)
                    raise unavailable(f"generation service stopped after {images} of {job.n} images",
                                      code="generation_unavailable")
        except (asyncio.CancelledError, GeneratorExit):
            cancelled = True
            self.metrics.cancelled.inc()
            raise
        except APIError as err:
            self.metrics.upstream_errors.labels(phase, str(err.code)).inc()
            raise
        finally:
            self.metrics.image_jobs_running.dec()
            self.metrics.image_job_seconds.observe(time.monotonic() - started)
            # Generation frees what it accepted, but it cannot when it failed before attaching the
            # pool (kv_pool_unavailable / kv_pool_mismatch): after a job error, release here too
            # (idempotent: pages already imported and freed are not touched).
            release = handles if (handles and (not gen_owns or gen_dead or gen_failed)) else None
            if cancelled or release:
                await self._cleanup(request_id, hdrs, phase, cancelled, und_ep, gen_ep, release)

    async def _cleanup(self, request_id, hdrs, phase, cancelled, und_ep, gen_ep, release) -> None:
        """Tell the engines to stop and free what nobody will use; never raises, never blocks long."""
        calls = []
        if cancelled and phase == "prefix" and und_ep is not None:
            calls.append((und_ep.url + "/internal/abort", {"request_id": request_id}))
        if cancelled and phase == "generate" and gen_ep is not None:
            calls.append((gen_ep.url + "/internal/cancel", {"request_id": request_id}))
        if release and und_ep is not None:
            calls.append((und_ep.url + "/internal/release",
                          {"handles": [h for h in release.values() if h]}))
        with anyio.CancelScope(shield=True):
            for url, body in calls:
                with anyio.move_on_after(5):
                    try:
                        await self.http.post(url, json=body, headers=hdrs,
                                             timeout=httpx.Timeout(4.0))
                        log.info("cleanup %s ok", url.rsplit("/", 1)[-1])
                    except httpx.HTTPError as exc:
                        log.warning("cleanup %s failed: %s", url, exc)
