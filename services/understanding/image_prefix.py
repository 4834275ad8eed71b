"""POST /internal/image_prefix: build each CFG branch's prefix, run them as ordinary engine requests,
export their KV into the shared-memory pool and hand back one KVHandle per branch.

Pool pages are allocated here, at admission, before anything is queued: a full pool answers a fast 503
(`kv_pool_full`) and never waits. Handles of a failed or aborted request are released at once.
"""
from __future__ import annotations

import asyncio
import json
import math
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from services.model import prompts as PR
from services.model import sampler as S

from .api_errors import APIError, bad_request, unavailable
from .detokenizer import IncrementalDetokenizer
from .engine_client import EngineDead
from .http_util import until_disconnect
from .protocol import SubmitRequest
from .request_parsing import decode_image_ref
from .sampling import SamplingParams


def _sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


class ImagePrefixService:
    def __init__(self, svc):
        self.svc = svc
        self.active: dict[str, list[str]] = {}     # request_id -> engine rids
        self.cancelled: set[str] = set()
        self.unclaimed: dict[str, dict] = {}       # request_id -> pages allocated, handles not yet handed out

    # ---- request parsing ---------------------------------------------------------------------------
    def _parse(self, body: dict):
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise bad_request("request_id must be a non-empty string", "request_id")
        kind = body.get("kind")
        if kind not in ("t2i", "edit"):
            raise bad_request("kind must be 't2i' or 'edit'", "kind")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string", "prompt")
        images = body.get("images") or []
        if not isinstance(images, list):
            raise bad_request("images must be a list", "images")
        if kind == "edit" and not 1 <= len(images) <= 4:
            raise bad_request("edit takes 1 to 4 images", "images")
        if kind == "t2i" and images:
            raise bad_request("t2i takes no images", "images")
        nums = {}
        for name, default in (("guidance_scale", 4.0), ("image_guidance_scale", 1.0)):
            v = body.get(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise bad_request(f"{name} must be a non-negative number", name)
            nums[name] = float(v)
        think = body.get("think", False)
        if not isinstance(think, bool):
            raise bad_request("think must be a boolean", "think")
        mtt = body.get("max_think_tokens", 1024)
        limit = self.svc.args.max_think_tokens
        if isinstance(mtt, bool) or not isinstance(mtt, int) or not 1 <= mtt <= limit:
            raise bad_request(f"max_think_tokens must be an integer in [1, {limit}]", "max_think_tokens")
        params = S.SamplerParams(guidance_scale=nums["guidance_scale"], image_guidance_scale=nums["image_guidance_scale"], mode=kind)
        return rid, kind, prompt, images, params, think, mtt, bool(body.get("stream", False))

    def _inputs(self, kind, prompt, images, params, think):
        svc = self.svc
        system = PR.gen_system_message(svc.args.model)
        if kind == "t2i":
            return PR.t2i_inputs(svc.tok, prompt, params, think, system)
        pils = [decode_image_ref(im, svc.limits, f"images[{i}]") for i, im in enumerate(images)]
        return PR.edit_inputs(svc.tok, prompt, pils, params, think, system)

    # ---- main entry -----------------------------------------------------------------------------------
    async def handle(self, request: Request, body: dict):
        svc = self.svc
        rid, kind, prompt, images, params, think, mtt, stream = self._parse(body)
        client = svc.require_engine()
        if svc.pool is None:
            raise unavailable("this server was started without --kv-pool-name", "no_kv_pool")
        if rid in self.active:
            raise bad_request(f"request_id {rid!r} is already running", "request_id")
        try:
            inputs = await asyncio.to_thread(self._inputs, kind, prompt, images, params, think)
        except APIError:
            raise
        except ValueError as e:
            raise bad_request(str(e)) from None
        tail = svc.tok.encode(PR.THINK_TAIL)
        handles = self._allocate(inputs, think, mtt, len(tail))
        self.unclaimed[rid] = handles
        msgs = []
        for branch, inp in inputs.items():
            br_think = think and branch == "cond"
            msgs.append(SubmitRequest(
                f"{rid}:{branch}", list(inp.input_ids), list(inp.images), SamplingParams(max_tokens=1),
                "prefix", think=br_think, max_think_tokens=mtt if br_think else 0,
                think_tail_ids=tail if br_think else [], think_stop_id=svc.tok.im_end_id,
                think_end_id=svc.tok.end_think_id, handle=handles[branch].to_dict()))
        self.active[rid] = [m.rid for m in msgs]
        try:
            queues = {m.rid.rsplit(":", 1)[1]: client.submit(m) for m in msgs}
        except EngineDead as e:
            self._cleanup(rid, handles, {})
            raise unavailable(str(e)) from None
        run = self._run(rid, queues, handles, time.monotonic(), think)
        if stream:
            state = {"complete": False}

            async def events():
                try:
                    async for ev in run:
                        if ev["type"] == "handles":
                            # from here on the client may hold the handles: never free them under it (a
                            # client that vanishes now leaks them only until their lease expires)
                            state["complete"] = True
                        yield _sse(ev)
                    yield _sse("[DONE]")
                finally:
                    await run.aclose()

            async def after():
                # Runs even when the client left before (or while) the body streamed; a stream that did not
                # reach [DONE] gives everything back (idempotent with _run's own cleanup).
                await run.aclose()
                if not state["complete"]:
                    self._abandon(rid, list(queues), handles)

            return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(after))
        async def consume():
            try:
                async for ev in run:
                    if ev["type"] == "error":
                        raise APIError(ev["status"], ev["error"]["message"], None, ev["error"]["code"])
                    if ev["type"] == "handles":
                        return {"request_id": rid, "handles": ev["handles"], "think_text": ev["think_text"]}
            finally:
                await run.aclose()
            raise APIError(500, "image prefix ended without handles", None, "internal")

        # a client that goes away cancels the branches and frees their pages (run's finally)
        res = await until_disconnect(request, consume())
        return res if res is not None else Response(status_code=499)

    def _allocate(self, inputs, think, mtt, tail_len):
        from shm_transfer import PoolFull
        svc = self.svc
        handles = {}
        try:
            for branch, inp in inputs.items():
                n = len(inp.input_ids) + ((mtt + tail_len) if think and branch == "cond" else 0)
                if n >= svc.limits.max_model_len:
                    raise bad_request(f"the {branch} prefix needs up to {n} tokens, over the context limit of "
                                      f"{svc.limits.max_model_len}", "prompt", "context_length_exceeded")
                handles[branch] = svc.pool.allocate(n, svc.args.kv_lease_s, branch=branch)
        except PoolFull as e:
            self._release_all(handles)
            raise APIError(503, str(e), None, "kv_pool_full", "service_unavailable") from None
        except BaseException:
            self._release_all(handles)
            raise
        return handles

    def _release_all(self, handles) -> None:
        for h in handles.values():
            try:
                self.svc.pool.release(h)
            except Exception:
                pass

    def _abandon(self, rid, branches, handles) -> None:
        """Abort every branch and free every page allocated for the request (same handle ids cover any
        trimmed final handle)."""
        client = self.svc.client
        for b in branches:
            client.abort(f"{rid}:{b}")
            client.done(f"{rid}:{b}")
        self._release_all(handles)
        self.active.pop(rid, None)
        self.unclaimed.pop(rid, None)

    def _cleanup(self, rid, handles, done: dict) -> None:
        """Release every page of a request that will not hand its handles out (error / abort)."""
        from shm_transfer import KVHandle
        for branch, h in handles.items():
            final = done.get(branch)
            self._release_all({branch: KVHandle.from_dict(final) if final else h})
        self.active.pop(rid, None)
        self.unclaimed.pop(rid, None)
        self.cancelled.discard(rid)

    async def _run(self, rid, queues, handles, t0, think):
        """Async iterator of contract events: think_delta..., then handles (or error)."""
        svc = self.svc
        detok = IncrementalDetokenizer(svc.tok, skip_special_tokens=False)
        done: dict[str, dict] = {}
        think_ids: list[int] = []
        ok = False
        pending = {b: asyncio.ensure_future(q.get()) for b, q in queues.items()}
        try:
            while pending:
                finished, _ = await asyncio.wait(set(pending.values()), return_when=asyncio.FIRST_COMPLETED)
                for branch in [b for b, f in pending.items() if f in finished]:
                    o = pending.pop(branch).result()
                    if o.new_ids and branch == "cond":
                        delta = detok.push(o.new_ids)
                        if delta:
                            yield {"type": "think_delta", "text": delta}
                    if o.finish_reason is None:
                        pending[branch] = asyncio.ensure_future(queues[branch].get())
                        continue
                    if o.finish_reason != "exported":
                        status = 503 if o.error_code in ("engine_dead",) else (
                            499 if o.finish_reason == "abort" else 500)
                        if o.error_code in ("kv_cache_too_small",):
                            status = 400
                        yield {"type": "error", "status": status, "error": {
                            "message": o.error or f"{branch} prefix {o.finish_reason}", "type": "server_error"
                            if status >= 500 else "invalid_request_error", "param": None,
                            "code": o.error_code or o.finish_reason}}
                        return
                    done[branch] = o.handle
                    if branch == "cond" and o.think_ids is not None:
                        think_ids = o.think_ids
            tail = detok.flush()
            if tail:
                yield {"type": "think_delta", "text": tail}
            ok = True
            self.unclaimed.pop(rid, None)      # the pages are the client's from here on
            svc.metrics.prefix_export.observe(time.monotonic() - t0)
            yield {"type": "handles", "handles": done,
                   "think_text": svc.tok.decode(think_ids) if think else None}
        finally:
            for f in pending.values():
                f.cancel()
            for b in queues:
                if b not in done:
                    svc.client.abort(f"{rid}:{b}")
                svc.client.done(f"{rid}:{b}")
            if not ok:
                self._cleanup(rid, handles, done)
            self.active.pop(rid, None)

    # ---- release / abort ----------------------------------------------------------------------------
    def release(self, body: dict) -> dict:
        from shm_transfer import HandleError, KVHandle
        svc = self.svc
        if svc.pool is None:
            raise unavailable("this server was started without --kv-pool-name", "no_kv_pool")
        hs = body.get("handles")
        if not isinstance(hs, list):
            raise bad_request("handles must be a list of KV handles", "handles")
        parsed = []
        for i, h in enumerate(hs):
            try:
                parsed.append(KVHandle.from_dict(h))
            except HandleError as e:
                raise bad_request(f"handles[{i}]: {e}", "handles", e.code) from None
        return {"released_pages": sum(svc.pool.release(h) for h in parsed)}

    def engine_dead(self) -> int:
        """The engine died: free every page allocated for an image prefix whose handles were not handed out
        yet (its request is failing with engine_dead; release is idempotent with that path's own cleanup)."""
        n = 0
        for rid, handles in list(self.unclaimed.items()):
            for h in handles.values():
                try:
                    n += self.svc.pool.release(h)
                except Exception:
                    pass
            self.unclaimed.pop(rid, None)
        return n

    def abort(self, rid: str) -> int:
        rids = self.active.get(rid, [])
        for r in rids:
            self.svc.client.abort(r)
        return len(rids)
