"""POST /internal/interleave_segment: one text segment of an interleaved text-and-image answer.

The gateway drives the answer (docs/architecture.md, "Interleaved answers"); each segment is stateless here: the
body carries the conversation and the answer so far (text token ids, and each generated image as a handle of its
float pixels in the KV pool). One segment is
1. a greedy text request over `cond` = the conversation + the answer so far, until `<img>`, `<|im_end|>` or the
   budget (the prefix cache holds the earlier segments, so only the newest image and what follows it is
   computed): `text` events;
2. at `<img>` (and images left): the prefix KV of every CFG branch the image needs, exported like an image
   prefix (`PrefixPages` owns the pages until the `handles` event): cond = all of it + `<img>`; tu = the input
   and generated images only + `<img>`; iu = the static 9-token prefix (interleave_spec §2.1); else `done`.
Generated images re-enter at the positions their gen tokens had (`<img>` t, image t + 1, `</img>` t + 2: an
ordinary image span) from the float image, bf16-rounded as the official code does (images.generated_image_tensor).
"""
from __future__ import annotations

import collections
import logging
import threading
import uuid
from typing import Optional

from services.contract.chat import TextSampling
from services.contract.control import AnswerDoneEvent, HandlesEvent, TextEvent, wire
from services.contract.interleave import (ALL_UNCOND, FLOAT_IMAGE_BRANCH, TEXT_FREE, InterleaveSegmentRequest,
                                          TranscriptImage)
from services.kit import sse
from services.kit.errors import APIError, bad_request
from services.model import images as IM
from services.model import prompts as PR
from services.model import row_blocks

from . import textgen
from .inputs import image_refs, prompt_messages, text_params
from .responses import sse_response
from .sampling import SamplingParams

log = logging.getLogger("u1serve.understanding.interleave")
CACHE_BYTES = 256 << 20  # re-encoded generated images kept here (a segment re-reads every image of its answer)


class FloatImages:
    """Generated images read back from the KV pool, as und-embedder inputs. Each read also extends the handle's
    lease (the answer uses it again at every later segment); a small LRU saves the re-reads."""

    def __init__(self, state):
        self.state = state
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def load(self, item: TranscriptImage, param: str) -> IM.ImageTensor:
        """Runs in the decode pool (blocking copies)."""
        from shm_transfer import HandleError, KVHandle
        from shm_transfer.tensors import tokens_for, unpack
        pool, lease_s = self.state.pool, self.state.args.kv_lease_s
        try:
            h = KVHandle.from_dict(item.image)
            if h.branch != FLOAT_IMAGE_BRANCH:
                raise bad_request(f"{param}: not a generated image (branch {h.branch!r})", param, "invalid_handle")
            if h.num_tokens != tokens_for(pool.layout, 3 * item.width * item.height):
                raise bad_request(f"{param}: the handle does not hold a {item.width}x{item.height} image", param,
                                  "invalid_handle")
            pool.extend_lease(h, lease_s)          # checks that the pages are still this handle's
            key = (h.pool_generation, h.handle_id)
            with self._lock:
                if key in self._lru:
                    self._lru.move_to_end(key)
                    return self._lru[key]
            x = unpack(pool.read_kv(h), (3, item.height, item.width))
            image = IM.generated_image_tensor(x)
        except HandleError as e:
            gone = e.code in ("stale_generation", "pages_freed", "lease_expired")
            raise APIError(410 if gone else 400, f"{param}: {e}", param=param, code=f"kv_{e.code}") from None
        except ValueError as e:          # the handle is too small for the size it claims
            raise bad_request(f"{param}: {e}", param, "invalid_handle") from None
        with self._lock:
            self._lru[key] = image
            while sum(im.pixel_values.nbytes for im in self._lru.values()) > CACHE_BYTES and len(self._lru) > 1:
                self._lru.popitem(last=False)
        return image


def reasoning_state(tok, think: bool, segments: list[list[int]]) -> Optional[bool]:
    """How the next segment's text splits into reasoning and content (detokenizer.OutputText's `think`). Think
    mode: the answer's first token may open <think> (None: the segment starts the answer), a later </think>
    closes it (True: the segment starts inside the block). Non-think mode never splits (False)."""
    if not think:
        return False
    if not segments:
        return None
    opened = segments[0][:1] == [tok.think_id]
    return opened and all(tok.end_think_id not in seg for seg in segments)


class InterleaveService:
    def __init__(self, state):
        self.state = state
        self.images = FloatImages(state)

    async def _inputs(self, req: InterleaveSegmentRequest):
        """(cond prompt of the segment, tu head + generated images, the transcript's text segments)."""
        st = self.state
        refs = image_refs(req.messages)
        pils = await st.images.decode(refs, IM.EDIT_MIN_PIXELS, IM.edit_max_pixels(max(1, len(refs))))
        items, texts = [], []
        for i, item in enumerate(req.transcript):
            if isinstance(item, TranscriptImage):
                items.append(await st.images.run(self.images.load, item, f"transcript[{i}].image"))
            else:
                items.append(list(item.token_ids))
                texts.append(list(item.token_ids))
        system = PR.interleave_system_message(st.args.model, req.system_message)
        cond_head, tu_head = await st.build_prompt(PR.interleave_heads, st.tok, prompt_messages(req.messages, pils),
                                                   req.think, system)
        cond = PR.extend_prompt(st.tok, cond_head, items)
        tu = PR.extend_prompt(st.tok, tu_head, items, with_text=False)
        return cond, tu, texts

    def _text_params(self, req: InterleaveSegmentRequest, prompt_len: int) -> SamplingParams:
        """Greedy (as the official loop), stopping at <img> as well as at <|im_end|>; the chat checks (room
        left in the context, logit_bias ids in the vocabulary)."""
        greedy = TextSampling(max_tokens=req.max_tokens, temperature=0.0, logit_bias=req.logit_bias,
                              stop_token_ids=[self.state.tok.img_start_id])
        return text_params(greedy, prompt_len, self.state.limits, clamp=True)   # the answer's remaining budget

    async def _official_blocks(self, rid: str, tu: PR.PromptInput, inputs: dict,
                               req: InterleaveSegmentRequest) -> dict:
        """Where bits matter (row_blocks: CPU), the branches' rows are computed in the blocks the official loop
        computes them in. A row's bits depend on its block's row count (CPU GEMM kernels below ~12 rows) and its
        attention's key count: cond already grows as the official cache does (prompt, then one row per token,
        `<img>` alone, each image + `</img>` as one block); tu would compute the newest image + `</img>` +
        `<img>` together (the official: the image block, then `<img>` alone), so its transcript is cached first
        (a one-token text request) and the export computes `<img>` alone; iu, a cache hit but for its last
        token, would compute that token alone (the official: the whole prefix once), so it skips the cache (a
        salt of its own). tu's salt is its own too (the answer's salt + ":tu"): with cond's it took a hit on the
        prompt's first token(s) and computed the rest of its head as a smaller block than the official's one
        block; harmless where only blocks under ~12 rows round differently (MKL's default AVX2 dispatch), not
        where a row's bits depend on its block's row count at any size (MKL_CBWR=COMPATIBLE: modulo 4; docs/model.md
        "Bits"). Returns the per-branch salts for start_job."""
        salts = {}
        if TEXT_FREE in inputs:
            salts[TEXT_FREE] = f"{req.cache_salt or ''}:tu"
            gen = textgen.generate(self.state, f"{rid}:tu", tu, SamplingParams(max_tokens=1, temperature=0.0), False,
                                   salts[TEXT_FREE], req.lora)
            try:
                async for ev in gen:
                    if "finish_reason" in ev:
                        break
            finally:
                await gen.aclose()
        if ALL_UNCOND in inputs:
            salts[ALL_UNCOND] = f"{req.cache_salt or ''}:iu:{uuid.uuid4().hex}"
        return salts

    async def handle(self, req: InterleaveSegmentRequest):
        """The segment as SSE (the gateway reads its text as it comes)."""
        st = self.state
        tok = st.tok
        st.prefixes.require_pool()
        st.prefixes.check_unique(req.request_id)      # not after the segment's text was decoded and streamed
        admission = st.admit()
        try:
            cond, tu, texts = await self._inputs(req)
            params = self._text_params(req, len(cond.input_ids))
            rid = st.engine_rid(req.request_id)
            gen = textgen.generate(st, rid, cond, params, reasoning_state(tok, req.think, texts), req.cache_salt,
                                   req.lora)
            first = await anext(gen)       # an immediate error is still a plain 4xx/5xx response
        except BaseException:
            admission.close()
            raise
        job = None

        async def cleanup():
            await gen.aclose()
            if job is not None:
                job.close()
            admission.close()

        ends = (tok.img_start_id, tok.im_end_id)       # the greedy text's stops: never part of a segment
        # return_token_ids as vLLM's: the token that ends the answer is its last id (<|im_end|>, or the <img> past
        # max_images); an <img> that starts an image is the first id of that image's span (the gateway's)
        answer_ends = ends if req.images_left <= 0 else (tok.im_end_id,)

        async def events():
            nonlocal job
            ev, ids = first, []
            if req.return_token_ids and not req.transcript:     # the answer's first segment: its prompt first
                yield TextEvent(reasoning="", content="", token_ids=[], prompt_token_ids=list(cond.input_ids))
            while True:
                ids.extend(ev["ids"])
                new = [t for t in ev["ids"] if t not in ends or t in answer_ends] if req.return_token_ids else []
                if ev["reasoning"] or ev["content"] or new:
                    ids_given = {"token_ids": new} if req.return_token_ids else {}
                    yield TextEvent(reasoning=ev["reasoning"], content=ev["content"], **ids_given)
                if "finish_reason" in ev:
                    break
                ev = await anext(gen)
            final = ev
            stop = ids[-1] if final["finish_reason"] == "stop" and ids else None
            seg = ids[:-1] if stop in ends else ids
            usage = {**final["usage"], "completion_tokens": len(seg)}
            # what the gateway needs to spell a generated image as token ids
            extra = {"image_span_ids": [tok.img_start_id, tok.img_context_id, tok.img_end_id]} \
                if req.return_token_ids else {}
            if stop != tok.img_start_id or req.images_left <= 0:
                yield AnswerDoneEvent(finish_reason=final["finish_reason"], token_ids=seg, usage=usage, **extra)
                return
            inputs = {"cond": PR.PromptInput(cond.input_ids + seg + [tok.img_start_id], cond.images),
                      TEXT_FREE: PR.PromptInput(tu.input_ids + [tok.img_start_id], tu.images),
                      ALL_UNCOND: PR.PromptInput(tok.encode(PR.UNCOND_TEXT))}
            inputs = {b: inputs[b] for b in req.branches()}
            salts = None
            if row_blocks.enabled(st.args.device):
                salts = await self._official_blocks(rid, tu, inputs, req)
            # the prefix job takes over the segment's admission slot (the text request is done); a full pool is
            # waited for as an image request's is
            job = await st.prefixes.start_when_pages_free(admission, lambda a: st.prefixes.start_job(
                req.request_id, inputs, a, req.cache_salt, lora=req.lora, salts=salts))
            async for pev in job.events():
                if isinstance(pev, APIError):
                    raise pev
                if isinstance(pev, HandlesEvent):
                    yield HandlesEvent(handles=pev.handles, token_ids=seg, usage=usage, **extra)

        async def stream():
            try:
                async for ev in events():
                    yield sse.encode(wire(ev))
            except APIError as e:
                yield sse.encode(e.event())
            yield sse.encode(sse.DONE)
        return sse_response(stream(), cleanup)
