"""Rank 0's events to the HTTP process (protocol.py), from what one loop iteration did: the admissions (started,
or failed), then per step the progress and previews of every job that ran, the step's stats, and each finished
job's results (RL result, images, done).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from services.kit import timeline
from services.kit.errors import APIError

from . import float_image
from .protocol import (BranchSteps, IdleStats, Image, JobDone, JobFailed, JobStarted, KvImportStats, Preview,
                       Progress, StepPlan, StepStats, WeightsReply)

log = logging.getLogger("u1serve.generation")


class Emitter:
    """Encodes what happened as protocol events; it changes no job and frees nothing (the scheduler's `update`
    and the engine own the transitions)."""

    def __init__(self, out, source, engine):
        self.out = out              # link.Outbox to the HTTP process
        self.source = source        # the prefix pool (kv_source.PrefixSource): where an exported image goes
        self.engine = engine

    def failed(self, request_id: str, err: dict) -> None:
        self.out.send(JobFailed(request_id, err))

    def applied(self, plan: StepPlan, failed: dict[str, dict], stats: list[KvImportStats],
                weights_reply: Optional[dict]) -> None:
        if weights_reply is not None:
            self.out.send(WeightsReply(weights_reply))
        for s in stats:
            self.out.send(s)
        for spec in plan.admit:
            if spec.request_id in failed:
                self.failed(spec.request_id, failed[spec.request_id])
            else:
                self.out.send(JobStarted(spec.request_id, self.engine.weights_version))
                timeline.mark("gen", "admitted")

    def idle(self, queued: int) -> None:
        self.out.send(IdleStats(queued=queued))

    def stepped(self, finished: list, rows: int, seconds: float, queued: int) -> None:
        running = self.engine.running
        for job in list(running) + finished:
            self.out.send(Progress(job.request_id, job.flow.index, job.num_inference_steps))
            if job.preview is not None:
                k, frames = job.preview
                job.preview = None
                for i in range(job.n):
                    self.out.send(Preview(job.request_id, i, k, job.flow.index, pixels=frames[i]))
        # the step's stats before its images: a client that got its last image finds the step in /metrics
        forwards = len(getattr(self.engine, "forwards", [rows]))      # an EngineSet's (reference.py); else one
        self.out.send(StepStats(seconds=seconds, tokens=rows, jobs=len(running) + len(finished),
                                running=len(running), queued=queued, peak_memory=self.engine.peak_memory(),
                                graph=self.engine.graphs.last, forwards=forwards))
        for job in finished:
            self._results(job)

    def _results(self, job) -> None:
        if job.rl is not None:
            self.out.send(job.rl.results(job))
            if not job.rl.wants_images:
                self.out.send(JobDone(job.request_id))
                return
        if not bool(torch.isfinite(job.x).all()):   # a fault, not an image: never a silent black PNG
            log.error("request %s: the denoised image holds NaN/Inf; answered 500 nonfinite_output", job.request_id)
            self.failed(job.request_id, APIError(500, "the generated image came out non-finite (NaN/Inf): a server "
                                                 "fault; the request may be retried", type="server_error",
                                                 code="nonfinite_output").event())
            return
        pixels = self.engine.pixels(job)
        timeline.mark("gen", "pixels")
        image_handle = None
        if job.spec.export_image:
            try:
                image_handle = float_image.export(self.source, job.x[0], job.spec.handles["cond"])
            except APIError as e:
                self.failed(job.request_id, e.event())
                return
        for i in range(job.n):
            self.out.send(Image(job.request_id, i, job.branch_steps, image_handle, self.engine.weights_version,
                                pixels=pixels[i], applied=job.applied()))
        self.out.send(BranchSteps(job.branch_steps))
        self.out.send(JobDone(job.request_id))
