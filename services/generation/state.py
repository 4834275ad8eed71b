"""The generation service's typed app state: its configs, the engine supervisor (the rank processes and the jobs
in flight), the KV keeper, the weights endpoint, the image encoder pool, the RL trajectory store and the metrics.
The routers read it through `app_state(request)`; `create_app` builds it once and its lifespan starts and
closes it."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from fastapi import Request

from services.contract.image import CacheOptions
from services.kit.errors import APIError, bad_request
from services.kit.logsafe import safe
from services.kit.weights_api import WeightsEndpoint

from . import encode, shared_trajectory
from .config import GenerationConfig, ServerConfig
from .image_limits import checkpoint_max_tokens, size_error
from .leases import HandleKeeper
from .metrics import GenerationMetrics
from .perf_options import EnginePerfMetrics
from .protocol import WeightsReply
from .supervisor import EngineSupervisor
from .trajectory_store import TrajectoryStore
from .warmup import parse_sizes
from .weights import weights_endpoint

log = logging.getLogger("u1serve.generation")


def _model_fingerprint(model_dir: str) -> Optional[str]:
    try:
        from services.model.loader import model_fingerprint
        return model_fingerprint(model_dir)
    except Exception:  # the engine reports a broken checkpoint itself
        return None


@dataclass
class GenerationState:
    cfg: GenerationConfig
    server: ServerConfig
    cache_defaults: CacheOptions          # step caching for requests that do not set `cache`
    fingerprint: Optional[str]            # of the checkpoint: handles of another model are refused
    max_tokens: int                       # the trained image size limit (image_limits.py)
    metrics: GenerationMetrics
    perf: EnginePerfMetrics
    keeper: HandleKeeper                  # the pages of accepted jobs until the engine imports them
    engine: EngineSupervisor
    weights: WeightsEndpoint
    encoder: ThreadPoolExecutor           # image encoding off the event loop
    trajectories: TrajectoryStore

    @classmethod
    def create(cls, cfg: GenerationConfig, server: ServerConfig, cache_defaults: CacheOptions,
               on_give_up: Callable[[str], None] = lambda why: None) -> "GenerationState":
        metrics = GenerationMetrics()
        fingerprint = _model_fingerprint(cfg.model)
        keeper = HandleKeeper(cfg.kv_pool_name, fingerprint, cfg.kv_pool_follow_handles == "on")
        engine = EngineSupervisor(cfg, keeper, on_give_up=on_give_up, max_queued=server.max_queued_requests,
                                  max_queue_wait_s=server.max_queue_wait_s)
        state = cls(
            cfg=cfg, server=server, cache_defaults=cache_defaults, fingerprint=fingerprint,
            max_tokens=checkpoint_max_tokens(cfg.model), metrics=metrics,
            perf=EnginePerfMetrics(metrics.registry), keeper=keeper, engine=engine,
            weights=weights_endpoint(engine),
            encoder=ThreadPoolExecutor(max_workers=server.encode_threads, thread_name_prefix="u1-encode"),
            trajectories=TrajectoryStore(int(server.rl_trajectory_store_mb * (1 << 20)),
                                         int(server.rl_trajectory_owner_mb * (1 << 20)) or None))
        engine.on_stats, engine.on_restart = state.on_stats, state.on_restart   # before the engine starts
        return state

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        shared_trajectory.reclaim(self.cfg.kv_pool_name)   # segments a killed server of this pool left
        self.engine.start()
        sizes = parse_sizes(self.cfg.default_size)
        # the encoders' first-use costs, while the engine loads
        warm = self.encoder.submit(encode.warm, sizes[0] if sizes else None)
        warm.add_done_callback(lambda f: f.exception() and log.warning("encoder warm-up failed: %r", f.exception()))

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.stop)
        self.trajectories.close()                          # their segments unlinked
        shared_trajectory.reclaim(self.cfg.kv_pool_name)   # and what the engine made but never handed over
        self.encoder.shutdown(wait=False)

    # -- engine callbacks (the link reader thread) ---------------------------------------------------
    def on_stats(self, msg) -> None:
        if isinstance(msg, WeightsReply):          # rank 0's reply to a weights op (weights.py)
            self.weights.reply(msg.reply)
        else:
            self.metrics.on_stats(msg)
            self.perf.on_stats(msg)

    def on_restart(self) -> None:
        shared_trajectory.reclaim(self.cfg.kv_pool_name)   # the dead engine's unfinished rollouts
        self.metrics.engine_restarts.inc()
        self.weights.engine_restarted()

    # -- per request ---------------------------------------------------------------------------------
    def check_size(self, job) -> None:
        too_big = size_error(job.width, job.height, self.max_tokens)
        if too_big:
            raise bad_request(too_big, param="size", code="invalid_size")

    def reject(self, err: APIError, rid, handles: list[dict]) -> APIError:
        """A request refused before its stream: log it under its id; its KV pages are freed (except on a
        duplicate id, whose handles may be the running job's)."""
        if err.code != "duplicate":
            self.keeper.refuse(handles)
        self.metrics.requests.labels(outcome=str(err.code)).inc()
        log.info("request %s rejected: %d %s", safe(rid), err.status, err.code)
        return err

    def health(self) -> dict:
        return {**self.engine.status(), "cfg_parallel": self.cfg.cfg_parallel, "sp": self.cfg.sp,
                "sp_mode": self.cfg.sp_mode, "max_image_tokens": self.max_tokens, "warmup": self.perf.warmup,
                "kv_pool": self.perf.kv_pool,
                "weights_version": self.weights.version,
                # decoder layers on the device with weight streaming (the rest in pinned host memory), null: off
                "weight_streaming": ({"device_layers": self.cfg.weight_streaming_layers}
                                     if self.cfg.weight_streaming_layers else None), "rl_trajectories": self.trajectories.stats(),
                # colocate QoS: the page the ranks yield to (services/generation/qos.py), null without a gate
                "yield_gate": {"page": self.cfg.yield_to, "share": self.cfg.yield_share} if self.cfg.yield_to else None}


def app_state(request: Request) -> GenerationState:
    return request.app.state.generation
