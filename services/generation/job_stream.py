"""One job's SSE response: the engine's events (protocol.py) rendered as the contract's generation events
(services/contract/control.py), and the one cleanup that runs however the response ends (kit.streaming's
OwnedStream: done, failed, cut, or the client gone before the body even started).

    queued -> progress ... (partial_image ...) -> image ... | rl_result -> [DONE]        an error ends it early

A heartbeat comment goes out whenever nothing happened for --stream-heartbeat-s (a queued job), so no idle
timeout on the way fires before the queue's own (a 429 queue_timeout).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from services.contract import control as C
from services.kit import sse, timeline
from services.kit.errors import APIError
from services.kit.logsafe import safe
from services.kit.streaming import OwnedStream

from .encode import encode_image
from .job_table import End
from .leases import JobLease
from .previews import preview_format
from .protocol import Image, JobFailed, Preview, Progress, RlResult
from .shared_trajectory import release
from .state import GenerationState
from .stream_queue import StreamQueue

log = logging.getLogger("u1serve.generation")
MiB = 1 << 20


class JobStream:
    """An image job's stream; `RlJobStream` renders RL jobs."""
    kind = "request"
    counted = True                 # in u1_gen_requests{outcome}

    def __init__(self, state: GenerationState, job):
        self.state, self.job = state, job
        self.loop = asyncio.get_running_loop()
        self.events = StreamQueue(self.loop, int(state.server.max_stream_backlog_mb * MiB), self._overflow)
        self.lease: Optional[JobLease] = None      # the job's pages, once it is accepted
        self.outcome = "disconnected"          # until the stream ends otherwise
        self.delivered = False                 # the client read [DONE]
        self.started = time.monotonic()

    def respond(self) -> OwnedStream:
        """Submit the job (APIError 409 / 429 / 503 before any byte: the caller rejects it) and stream it."""
        self.lease = self.state.engine.submit(self.job, self.events.deliver)
        return OwnedStream(self.body(), on_close=self.close)

    async def body(self):
        yield sse.encode(C.wire(C.QueuedEvent()))
        while True:
            ev = await self.events.get(self.state.server.stream_heartbeat_s or None)
            if ev is None:
                yield sse.HEARTBEAT
                continue
            if isinstance(ev, End):
                break
            data = await self.render(ev)
            if data is not None:
                yield data
        if self.outcome == "disconnected":
            self.outcome = "ok"
        yield sse.encode(sse.DONE)
        self.delivered = True

    async def render(self, ev) -> Optional[bytes]:
        job = self.job
        match ev:
            case Progress():
                return sse.encode(C.wire(C.ProgressEvent.model_construct(step=ev.step, total=ev.total)))
            case Preview():
                fmt = preview_format(job.output_format)
                b64 = await self._encode(ev.pixels, fmt)
                return sse.encode(C.wire(C.PartialImageEvent.model_construct(
                    index=ev.index, partial_image_index=ev.partial_image_index, step=ev.step, b64=b64, format=fmt,
                    width=ev.pixels.shape[1], height=ev.pixels.shape[0])))
            case Image():
                return await self._image(ev)
            case JobFailed():
                return self.failed(ev.error)
        return None

    async def _image(self, ev: Image) -> bytes:
        job = self.job
        timeline.mark("gen", "image_event")
        b64 = await self._encode(ev.pixels, job.output_format)
        timeline.mark("gen", "encoded")
        fields = dict(index=ev.index, b64=b64, format=job.output_format, width=job.width, height=job.height,
                      seed=job.seed, branch_steps=ev.branch_steps, weights_version=ev.weights_version,
                      applied=ev.applied)
        if ev.image_handle:
            self.lease.shown(ev.image_handle)
            fields["image_handle"] = ev.image_handle
        data = sse.encode(C.wire(C.ImageEvent.model_construct(**fields)))
        timeline.mark("gen", "sse_event")
        return data

    def failed(self, error: dict) -> bytes:
        self.outcome = str(error.get("error", {}).get("code") or "error")
        return sse.encode(error)

    async def _encode(self, pixels, fmt: str):
        return await self.loop.run_in_executor(self.state.encoder, encode_image, pixels, fmt)

    def _overflow(self, nbytes: int) -> None:
        """The stream's reader fell behind: end the job (stream_queue.py)."""
        self.state.metrics.streams_behind.inc()
        self.state.engine.abort(self.job.request_id, f"the stream fell {nbytes / MiB:.0f} MiB behind its reader "
                                f"(--max-stream-backlog-mb {self.state.server.max_stream_backlog_mb:g}); cut")

    async def close(self) -> None:
        """However the response ended (done, failed, cut, or the client gone before its first byte)."""
        st, rid = self.state, self.job.request_id
        if self.outcome == "disconnected":          # the client went away: stop the job at the next step
            st.engine.abort(rid, "client disconnected")
        self.events.close()                         # what it never took is dropped
        if self.lease is not None:                  # the float images its client did not get are freed
            self.lease.stream_closed(self.delivered)
        if self.counted:
            st.metrics.requests.labels(outcome=self.outcome).inc()
        log.info("%s %s %s in %.2fs", self.kind, safe(rid), self.outcome, time.monotonic() - self.started)


class RlJobStream(JobStream):
    """A rollout / score job: progress, its images when asked (no previews: `partial_images` is 0), its
    `rl_result` (`on_result` may store the trajectory first, or refuse it with an APIError)."""
    kind = "rl job"
    counted = False

    def __init__(self, state: GenerationState, job, on_result: Callable[[object, RlResult], None]):
        super().__init__(state, job)
        self.on_result = on_result

    async def render(self, ev) -> Optional[bytes]:
        job = self.job
        match ev:
            case Image():
                b64 = await self._encode(ev.pixels, job.output_format)
                return sse.encode(C.wire(C.ImageEvent.model_construct(
                    index=ev.index, b64=b64, format=job.output_format, width=job.width, height=job.height)))
            case RlResult():
                try:
                    self.on_result(job, ev)
                except APIError as err:
                    release(ev)                  # not stored (the store released it too: release is idempotent)
                    self.state.engine.abort(job.request_id, "trajectory refused")
                    return self.failed(err.event())
                return sse.encode(C.wire(C.RlResultEvent.model_construct(**ev.result())))
        return await super().render(ev)
