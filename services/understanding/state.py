"""The understanding service's typed app state: tokenizer, limits, engine client, KV transport (`pool`: the
producer side of shm_transfer's Transport), image decoder, admission gate. The routers read it through `app_state(request)`; `create_app` builds it once."""
from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from typing import Callable, Optional

from fastapi import Request

from services.kit.admission import AdmissionGate
from services.kit.errors import APIError, bad_request, unavailable
from services.kit.restart import RestartPolicy
from services.model import prompts as PR
from services.model.config import load_config
from services.model.loader import model_fingerprint
from services.model.tokenizer import NeoTokenizer

from .config import ServerConfig
from .engine_client import EngineClient
from .image_inputs import ImageBudget, ImageDecoder
from .image_prefix import ImagePrefixService
from .inputs import Limits
from .interleave import InterleaveService
from .metrics import Metrics
from .weights import UnderstandingWeights

log = logging.getLogger("u1serve.understanding")


def default_queue_limit(kv_cache_tokens: int) -> int:
    """Requests that may wait for admission when --max-queued-requests is not given: one KV cache's worth of
    256-token prompts (at least 16). A longer queue would only hold memory (prompts, decoded images) for
    requests that wait longer than clients do."""
    return max(16, kv_cache_tokens // 256)


class AppState:
    def __init__(self, args: ServerConfig):
        self.args = args
        self.tok = NeoTokenizer.from_dir(args.model)
        self.cfg = load_config(args.model)
        self.model_name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        self.limits = Limits(max_model_len=args.max_model_len, vocab_size=self.cfg.llm.vocab_size,
                             min_pixels=args.image_min_pixels, max_pixels=args.image_max_pixels)
        self.metrics = Metrics()
        self.images = ImageDecoder(ImageBudget(
            max_images=args.max_images_per_request, max_image_bytes=args.max_image_bytes,
            max_pixels_per_image=args.max_source_pixels_per_image,
            max_pixels_per_request=args.max_source_pixels_per_request), threads=args.image_decode_threads)
        self.gate = AdmissionGate(args.max_running_requests + self._queue_limit(args.kv_cache_tokens),
                                  "requests")
        self.pool = None
        self.engine: Optional[EngineClient] = None
        self.weights = UnderstandingWeights()
        self.prefixes = ImagePrefixService(self)
        self.interleave = InterleaveService(self)
        self.started = time.time()
        self.exit_error: Optional[str] = None          # the engine never started: the server exits with it
        self.request_exit: Callable[[], None] = lambda: None

    def _queue_limit(self, kv_cache_tokens: int) -> int:
        a = self.args
        return a.max_queued_requests if a.max_queued_requests is not None else default_queue_limit(kv_cache_tokens)

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        a = self.args
        if a.kv_pool_name:
            self.pool = self._create_transport()
        policy = RestartPolicy(max_failures=a.engine_max_failures, window_s=a.engine_failure_window_s)
        # a dead engine is replaced by a fresh one; the shm pool (ours) keeps its name and generation
        self.engine = EngineClient(a.engine(), policy, on_ready=self._engine_ready, on_start_failure=self._start_failed)
        self.weights.bind(self.engine)
        self.engine.start()
        # the first request's hop into the prompt-building pool and its first prompt, paid before ready (a first
        # image prefix's prompt / pages / submit: 68.5 ms against 2.6 steady on an H100, bench_breakdown); a failure
        # only leaves that cost to the first request
        try:
            await self.images.run(PR.t2i_inputs, self.tok, "warm-up", ("cond", "uncond"), False,
                                  PR.gen_system_message(a.model))
        except Exception:
            log.warning("prompt warm-up failed; the first request builds its prompt cold", exc_info=True)

    def _create_transport(self):
        """The producer side of the KV handoff (shm_transfer.producer.create_producer): the shm pool, served over the
        network too with --kv-transport nixl, or with its pages on --device with --kv-transport device (engines in one
        process). The HTTP process only allocates/releases pages; the engine ranks (which copy) attach the pool and
        pin it."""
        from shm_transfer import KVLayout
        from shm_transfer.producer import create_producer
        a, llm = self.args, self.cfg.llm
        layout = KVLayout(num_layers=llm.num_hidden_layers, num_kv_heads=llm.num_key_value_heads,
                          head_dim=llm.head_dim, dtype=a.dtype, page_tokens=a.kv_page_tokens)
        by_kind = ({"listen_port": a.kv_listen_port, "advertise_host": a.kv_advertise_host}
                   if a.kv_transport == "nixl" else {"device": a.device} if a.kv_transport == "device" else {})
        t = create_producer(a.kv_transport, a.kv_pool_name, layout, int(a.kv_pool_gb * (1 << 30)),
                            model_fingerprint(a.model, self.cfg), pin=False, owner=a.kv_pool_owner, **by_kind)
        if a.kv_transport == "nixl":
            s = t.stats()
            log.info("KV transport nixl: agent %s, metadata at %s", s["agent"], s["listen"])
        return t

    def _engine_ready(self, engine: EngineClient) -> None:
        self.weights.endpoint.engine_restarted()   # a (re)started engine loaded the checkpoint: version "0"
        # the engine may have shrunk its KV cache to fit GPU memory: the context limit and the queue follow
        self.limits.max_model_len = min(self.args.max_model_len, engine.max_model_len)
        self.gate.limit = self.args.max_running_requests + self._queue_limit(engine.kv_cache_tokens)

    def _start_failed(self, why: str) -> None:
        log.error("the engine failed to start; exiting: %s", why)
        self.exit_error = why
        self.request_exit()

    async def stop(self) -> None:
        self.prefixes.close_all()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.pool is not None:       # the creator's close unlinks the segment (and stops a NIXL agent)
            with contextlib.suppress(Exception):
                self.pool.close()

    # ---- per request ---------------------------------------------------------------------------------
    def require_engine(self) -> EngineClient:
        e = self.engine
        if e is None or not e.ready:
            s = e.status() if e is not None else {"state": "starting", "failure": None}
            raise unavailable(s["failure"] or f"the engine is not ready ({s['state']})", "engine_unavailable")
        return e

    def admit(self, slots: int = 1) -> contextlib.ExitStack:
        """Admission slots, one per engine request (429 + Retry-After when the running + queued limit is reached;
        all or none), held until the returned stack is closed (idempotent: every exit path may close it). More slots
        than the gate ever holds (a chat's `n` choices) is the client's error: a 429 would never clear."""
        if slots > self.gate.limit:
            raise bad_request(f"n={slots} choices need more engine slots than this server admits at once "
                              f"({self.gate.limit}); ask for at most {self.gate.limit}", param="n")
        scope = contextlib.ExitStack()
        try:
            for _ in range(slots):
                self.gate.acquire()
                scope.callback(self.gate.release)
        except BaseException:
            scope.close()
            raise
        return scope

    async def build_prompt(self, fn, *args):
        """Prompt building (normalising images, tokenising) in the bounded decode pool; a ValueError of the
        model code (e.g. more <image> markers than images) is the client's: 400."""
        try:
            return await self.images.run(fn, *args)
        except APIError:
            raise
        except ValueError as e:
            raise bad_request(str(e)) from None

    def engine_rid(self, request_id: str) -> str:
        """The engine's id of a text request: the caller's request id (so /internal/abort finds it), made
        unique when a client reuses an id that is still in flight."""
        if self.engine is None or request_id not in self.engine.queues:
            return request_id
        return f"{request_id}.{uuid.uuid4().hex[:8]}"

    def stop_ids(self, params) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids.append(self.tok.im_end_id)
        return ids


def app_state(request: Request) -> AppState:
    return request.app.state.u1
