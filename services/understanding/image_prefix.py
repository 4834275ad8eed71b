"""POST /internal/image_prefix: build each CFG branch's prefix, run them as ordinary engine requests,
export their KV into the shared-memory pool and hand back one KVHandle per branch.

Pool pages are reserved at admission, before anything is queued, and owned by one `PrefixPages` object per
request until the handles are handed out: every exit (bad input, pool full, abort, client gone, engine death,
queue timeout, error) ends in its `close()`, which gives back whatever was not handed out. A full pool is a
fast 429 (never waits); one request may reserve at most `--max-prefix-pool-share` of the pool (400 above).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Optional

from fastapi import Request
from fastapi.responses import Response

from services.contract.control import HandlesEvent, ThinkDeltaEvent, wire
from services.contract.image import PrefixRequest
from services.kit import sse, timeline
from services.kit.errors import APIError, bad_request, overloaded, unavailable
from services.model import images as IM
from services.model import prompts as PR

from .detokenizer import IncrementalDetokenizer
from .engine_client import EngineDead
from .protocol import SubmitRequest
from .responses import sse_response, until_done_or_gone
from .sampling import SamplingParams
from .textgen import output_error

PAGES_POLL_S = 0.02     # how often a request waiting for pool pages tries again (a try is one lock and a scan)

log = logging.getLogger("u1serve.understanding.prefix")


class PrefixPages:
    """The shm pages of one image-prefix request. Allocated at admission; `hand_out()` transfers them to the
    client (the handles event / response); `close()` releases whatever was not handed out. Idempotent."""

    def __init__(self, pool):
        self.pool = pool
        self.handles: dict = {}          # branch -> KVHandle as allocated (covers the trimmed final handle)
        self.owned = True

    def allocate(self, branch: str, num_tokens: int, lease_s: float) -> dict:
        h = self.pool.allocate(num_tokens, lease_s, branch=branch)
        self.handles[branch] = h
        return h.to_dict()

    def hand_out(self) -> None:
        self.owned = False

    def close(self) -> int:
        if not self.owned:
            return 0
        self.owned = False
        freed = 0
        for h in self.handles.values():
            try:
                freed += self.pool.release(h)
            except Exception:
                log.exception("releasing prefix pages of handle %s failed", h.handle_id)
        return freed


class PrefixJob:
    """One image-prefix request in the engine: its branches, their output queues, its pages."""

    def __init__(self, svc: "ImagePrefixService", request_id: str, think: bool, pages: PrefixPages, admission):
        self.svc = svc
        self.request_id = request_id
        self.think = think               # the cond branch decodes a think block (think_delta events)
        self.sampled = False             # RL: the think block is sampled (think_token_ids / think_logprobs)
        self.pages = pages
        self.admission = admission       # ExitStack holding the admission slot
        self.queues: dict[str, asyncio.Queue] = {}
        self.t0 = time.monotonic()

    def engine_rid(self, branch: str) -> str:
        return f"{self.request_id}:{branch}"

    def submit(self, msgs: dict[str, SubmitRequest]) -> None:
        engine = self.svc.state.engine
        for branch, msg in msgs.items():
            self.queues[branch] = engine.submit(msg)

    def abort(self) -> int:
        for branch in self.queues:
            self.svc.state.engine.abort(self.engine_rid(branch))
        return len(self.queues)

    def close(self) -> None:
        """Every exit path ends here (idempotent): unfinished branches aborted, pages not handed out freed."""
        engine = self.svc.state.engine
        for branch in self.queues:
            engine.abort(self.engine_rid(branch))
            engine.done(self.engine_rid(branch))
        self.queues = {}
        freed = self.pages.close()
        if freed:
            log.info("prefix %s: released %d shm pages", self.request_id, freed)
        if self.svc.jobs.get(self.request_id) is self:
            del self.svc.jobs[self.request_id]
        self.admission.close()

    async def events(self):
        """The prefix stream's contract events (services/contract/control.py): ThinkDeltaEvent..., then
        HandlesEvent (or one APIError, the last item)."""
        st = self.svc.state
        tok = st.tok
        detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
        done: dict[str, dict] = {}
        think_ids: list[int] = []
        think_lps: list[float] = []
        pending = {b: asyncio.ensure_future(q.get()) for b, q in self.queues.items()}
        try:
            while pending:
                finished, _ = await asyncio.wait(set(pending.values()), return_when=asyncio.FIRST_COMPLETED)
                for branch in [b for b, f in pending.items() if f in finished]:
                    o = pending.pop(branch).result()
                    if o.logprobs and branch == "cond":
                        think_lps += [lp for lp, _ in o.logprobs]
                    if o.new_ids and branch == "cond":
                        delta = detok.push(o.new_ids)
                        if delta:
                            yield ThinkDeltaEvent(text=delta)
                    if o.finish_reason is None:
                        pending[branch] = asyncio.ensure_future(self.queues[branch].get())
                        continue
                    if o.finish_reason != "exported":
                        yield output_error(o)
                        return
                    done[branch] = o.handle
                    if branch == "cond" and o.think_ids is not None:
                        think_ids = o.think_ids
            tail = detok.flush()
            if tail:
                yield ThinkDeltaEvent(text=tail)
            st.metrics.prefix_export.observe(time.monotonic() - self.t0)
            timeline.mark("und", "exported")
            # from here on the client may hold the handles: never free them under it (a client that vanishes
            # now leaks them only until their lease expires)
            self.pages.hand_out()
            sampled = {"think_token_ids": think_ids, "think_logprobs": think_lps} if self.sampled else {}   # RL
            yield HandlesEvent(handles=done, think_text=tok.decode(think_ids) if self.think else None, **sampled)
        finally:
            for f in pending.values():
                f.cancel()


class ImagePrefixService:
    def __init__(self, state):
        self.state = state
        self.jobs: dict[str, PrefixJob] = {}      # request_id -> job in flight

    # ---- admission ----------------------------------------------------------------------------------------
    def _branch_inputs(self, req: PrefixRequest, pils: list) -> dict:
        st = self.state
        system = PR.gen_system_message(st.args.model)
        if req.mode == "t2i":
            return PR.t2i_inputs(st.tok, req.prompt, req.branches(), req.think, system)
        return PR.edit_inputs(st.tok, req.prompt, pils, req.branches(), req.think, system, req.image_offsets)

    def _reserve(self, sizes: dict[str, int]) -> tuple[PrefixPages, dict]:
        """Pages for every branch (its prompt, + think budget and tail on a thinking cond), all or nothing."""
        st, pool = self.state, self.state.pool
        for branch, n in sizes.items():
            if n >= st.limits.max_model_len:
                raise bad_request(f"the {branch} prefix needs up to {n} tokens, over the context limit of "
                                  f"{st.limits.max_model_len}", "prompt", "context_length_exceeded")
        need = sum(pool.layout.pages_for(n) for n in sizes.values())
        cap = max(1, int(st.args.max_prefix_pool_share * pool.num_pages))
        if need > cap:
            raise bad_request(
                f"this request needs {need} KV pool pages ({sum(sizes.values())} tokens over {len(sizes)} "
                f"branches); one request may reserve at most {cap} of the pool's {pool.num_pages} pages "
                "(--max-prefix-pool-share, --kv-pool-gb)", "prompt", "kv_request_too_large")
        from shm_transfer import PoolFull
        pages = PrefixPages(pool)
        handles = {}
        try:
            for branch, n in sizes.items():
                handles[branch] = pages.allocate(branch, n, st.args.kv_lease_s)
        except PoolFull as e:
            pages.close()
            raise overloaded(f"{e}", retry_after_s=1.0, code="kv_pool_full") from None
        except BaseException:
            pages.close()
            raise
        return pages, handles

    def check_unique(self, request_id: str) -> None:
        """409 when a prefix job with this id is running (before any work is done for the new one)."""
        if request_id in self.jobs:
            raise APIError(409, f"request_id {request_id!r} is already running", param="request_id",
                           code="duplicate")

    def require_pool(self):
        st = self.state
        st.require_engine()
        if st.pool is None:
            raise unavailable("this server was started without --kv-pool-name", "no_kv_pool")
        return st.pool

    async def _start(self, req: PrefixRequest) -> PrefixJob:
        st = self.state
        self.require_pool()
        self.check_unique(req.request_id)
        if req.max_think_tokens > st.args.max_think_tokens:
            raise bad_request(f"max_think_tokens: at most {st.args.max_think_tokens} on this server",
                              "max_think_tokens")
        admission = st.admit()
        try:
            pils = []
            if req.images:
                n = len(req.images)
                pils = await st.images.decode([(f"images[{i}]", im) for i, im in enumerate(req.images)],
                                              IM.EDIT_MIN_PIXELS, IM.edit_max_pixels(n))
            inputs = await st.images.run(self._branch_inputs, req, pils)
        except BaseException:
            admission.close()
            raise
        if req.think_token_ids is not None:     # RL scoring: the sampled think block, prefilled as is
            tail = st.tok.encode(PR.THINK_TAIL)
            inputs["cond"].input_ids = list(inputs["cond"].input_ids) + list(req.think_token_ids) + tail
            return await self.start_when_pages_free(admission, lambda a: self.start_job(
                req.request_id, inputs, a, req.cache_salt, lora=req.lora))
        sample = None
        if req.think and req.think_temperature is not None:
            sample = SamplingParams(max_tokens=1, temperature=req.think_temperature, top_p=req.think_top_p,
                                    seed=req.think_seed, logprobs=0,
                                    logit_bias={i: float("-inf") for i in PR.think_excluded_ids(st.tok)})
        return await self.start_when_pages_free(admission, lambda a: self.start_job(
            req.request_id, inputs, a, req.cache_salt, req.think, req.max_think_tokens, sample, lora=req.lora))

    async def start_when_pages_free(self, admission, start) -> PrefixJob:
        """`start(admission)`; while the pool's pages are all held by other requests (429 kv_pool_full), wait for
        them and try again, up to --prefix-pages-wait-s: a burst queues for pages (they free as generation takes
        the prefixes) instead of being refused. Each try is admitted anew: a failed start closed its admission."""
        deadline = time.monotonic() + self.state.args.prefix_pages_wait_s
        while True:
            try:
                return start(admission)
            except APIError as e:
                if e.code != "kv_pool_full" or time.monotonic() + PAGES_POLL_S > deadline:
                    raise
            await asyncio.sleep(PAGES_POLL_S)
            admission = self.state.admit()

    def start_job(self, request_id: str, inputs: dict, admission, cache_salt: Optional[str] = None,
                  think: bool = False, max_think_tokens: int = 0,
                  think_sample: Optional[SamplingParams] = None, lora: Optional[str] = None,
                  salts: Optional[dict] = None) -> PrefixJob:
        """Reserve the pages of every branch's prefix and submit them (think: the cond branch decodes a think
        block first, greedily or sampled with `think_sample`). `salts`: a branch's own cache salt in place of
        `cache_salt`. The job owns `admission` from here on, also when this raises."""
        st = self.state
        try:
            tail = st.tok.encode(PR.THINK_TAIL) if think else []
            self.check_unique(request_id)      # again: the same id may have arrived meanwhile
            pages, handles = self._reserve({b: len(inp.input_ids) + (max_think_tokens + len(tail) if think and
                                                                      b == "cond" else 0)
                                            for b, inp in inputs.items()})
        except BaseException:
            admission.close()
            raise
        job = PrefixJob(self, request_id, think, pages, admission)
        job.sampled = think and think_sample is not None
        self.jobs[request_id] = job
        msgs = {}
        for branch, inp in inputs.items():
            thinks = think and branch == "cond"
            msgs[branch] = SubmitRequest(
                job.engine_rid(branch), list(inp.input_ids), list(inp.images),
                (think_sample if thinks and think_sample else SamplingParams(max_tokens=1)),
                "prefix", think=thinks, max_think_tokens=max_think_tokens if thinks else 0,
                think_sample=bool(thinks and think_sample),
                think_tail_ids=tail if thinks else [], think_stop_id=st.tok.im_end_id,
                think_end_id=st.tok.end_think_id, handle=handles[branch],
                cache_salt=(salts or {}).get(branch, cache_salt), lora=lora)
        try:
            job.submit(msgs)
        except EngineDead as e:
            job.close()
            raise unavailable(str(e), "engine_dead") from None
        except BaseException:
            job.close()
            raise
        return job

    # ---- the endpoint -----------------------------------------------------------------------------------
    async def handle(self, request: Request, req: PrefixRequest):
        timeline.mark("und", "request")
        job = await self._start(req)
        timeline.mark("und", "submitted")
        log.info("prefix %s: %s, branches %s", req.request_id, req.mode, list(job.queues))
        run = job.events()

        async def cleanup():     # branches aborted, pages not handed out freed (also for a client gone)
            await run.aclose()
            job.close()

        if req.stream:
            async def stream():
                async for ev in run:
                    yield sse.encode(ev.event() if isinstance(ev, APIError) else wire(ev))
                yield sse.encode(sse.DONE)
            return sse_response(stream(), cleanup)

        async def consume() -> dict:
            async for ev in run:
                if isinstance(ev, APIError):
                    raise ev
                if isinstance(ev, HandlesEvent):
                    return {"request_id": req.request_id, "handles": ev.handles, "think_text": ev.think_text}
            raise APIError(500, "image prefix ended without handles", code="internal")

        finished, result = await until_done_or_gone(request, consume, cleanup)
        return result if finished else Response(status_code=499)

    # ---- release / abort ----------------------------------------------------------------------------
    def release(self, handles: list) -> dict:
        from shm_transfer import HandleError, KVHandle
        pool = self.state.pool
        if pool is None:
            raise unavailable("this server was started without --kv-pool-name", "no_kv_pool")
        parsed = []
        for i, h in enumerate(handles):
            try:
                parsed.append(KVHandle.from_dict(h))
            except HandleError as e:
                raise bad_request(f"handles[{i}]: {e}", "handles", e.code) from None
        return {"released_pages": sum(pool.release(h) for h in parsed)}

    def abort(self, request_id: str) -> int:
        job: Optional[PrefixJob] = self.jobs.get(request_id)
        return job.abort() if job is not None else 0

    def close_all(self) -> None:
        for job in list(self.jobs.values()):
            with contextlib.suppress(Exception):
                job.close()
