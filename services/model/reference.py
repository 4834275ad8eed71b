"""The single-process reference pipeline: eager torch attention with explicit masks.

Serving tests use it as the oracle. It is built from two halves the engines mirror:
  prefix:  prompt (+ images) -> per-branch PrefixKV [L, 2, P, Hkv, D] (+ think text)
  denoise: prefix KVs + size + sampler params + seed -> image in [-1, 1]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import sampler as S
from .model import NeoModel
from .positions import image_token_positions, prefill_mask, thw_indexes
from .step_cache import BranchState, CacheGroup, StepCache, StepCacheOptions, truncated_interval

if TYPE_CHECKING:   # prompts/tokenizer need PIL and tokenizers: imported where used, so the denoise
    from . import prompts as P       # half runs with torch alone (GPU benchmark machines)
    from .tokenizer import NeoTokenizer


@dataclass
class PrefixKV:
    kv: torch.Tensor  # [L, 2, P, Hkv, D]; K after Q/K norm and RoPE
    t_offset: int  # t of the generated image tokens = max prefix t + 1
    think_text: str | None = None
    input_ids: list[int] = field(default_factory=list)
    think_ids: list[int] = field(default_factory=list)  # decoded think tokens (cond branch, think mode)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]


class _Cache:
    """Per-layer K/V lists the reference appends to (prefill, decode, appended blocks)."""

    def __init__(self, num_layers: int):
        self.k = [None] * num_layers
        self.v = [None] * num_layers

    def append(self, i, k, v):
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k])
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v])
        return self.k[i], self.v[i]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def stacked(self) -> torch.Tensor:
        return torch.stack([torch.stack([k, v]) for k, v in zip(self.k, self.v)])


def masked_attention(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Eager attention as upstream's und path: fp32 softmax, additive -inf mask. q [Tq,Hq,D], k/v [Tk,Hkv,D]."""
    rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    w = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if mask is not None:
        w = w + torch.where(mask, 0.0, float("-inf")).to(w.dtype)[None]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, vh).transpose(0, 1)


def _forward_und(model: NeoModel, cache: _Cache, x, positions, mask):
    """Append a block of und tokens to the cache; row i of the block sees the whole cache + mask[i]."""
    past = cache.length
    scale = model.head_dim ** -0.5

    def attend(i, q, k, v):
        kk, vv = cache.append(i, k, v)
        full = None
        if mask is not None:
            full = torch.cat([torch.ones(mask.shape[0], past, dtype=torch.bool, device=mask.device), mask], 1)
        return masked_attention(q, kk, vv, full, scale)

    return model.und_forward(x, model.rope(positions), attend)


def prefill(model: NeoModel, inp: P.PromptInput):
    """Prefix forward -> (cache, positions, last hidden [P, H])."""
    ids = torch.tensor(inp.input_ids, dtype=torch.long)
    positions = thw_indexes(ids, model._img_context_id, inp.grids).to(model.device)
    x = model.embed(ids, inp.images)
    cache = _Cache(model.num_layers)
    hidden = _forward_und(model, cache, x, positions, prefill_mask(positions))
    return cache, positions, hidden


def _append_text(model, cache, ids: list[int], t_last: int):
    """Append text tokens causally after the cache (t continues from t_last)."""
    n = len(ids)
    t = torch.arange(t_last + 1, t_last + 1 + n)
    positions = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)]).to(model.device)
    x = model.embed(torch.tensor(ids))
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=model.device))
    hidden = _forward_und(model, cache, x, positions, mask)
    return hidden, t_last + n


def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = torch.where(logits < kth, float("-inf"), logits)
    probs = torch.softmax(logits, -1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sp, 0) - sp) < top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@torch.no_grad()
def generate_text(model: NeoModel, tok: NeoTokenizer, inp: P.PromptInput, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  stop_ids: tuple[int, ...] | None = None, keep_stop: bool = False) -> list[int]:
    """Autoregressive decode (greedy when temperature == 0). Returns the new token ids, the stop token that ended
    them excluded (`keep_stop`: included, as vLLM's and the API's `token_ids` have it)."""
    stop = set(stop_ids if stop_ids is not None else (tok.im_end_id,))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache, positions, hidden = prefill(model, inp)
    t_last = int(positions[0].max())
    out: list[int] = []
    logits = model.lm_logits(hidden[-1:])[0]
    for _ in range(max_new_tokens):
        nxt = _sample(logits, temperature, top_p, top_k, gen)
        if nxt in stop:
            if keep_stop:
                out.append(nxt)
            break
        out.append(nxt)
        hidden, t_last = _append_text(model, cache, [nxt], t_last)
        logits = model.lm_logits(hidden[-1:])[0]
    return out


@torch.no_grad()
def think_decode(model, tok, cache, hidden, t_last: int, max_think_tokens: int):
    """Greedy think block: stop on </think> (fed) or <|im_end|> (not fed); then append "\\n\\n<img>"."""
    ids: list[int] = []
    logits = model.lm_logits(hidden[-1:])[0]
    for _ in range(max_think_tokens):
        nxt = int(torch.argmax(logits))
        if nxt == tok.im_end_id:
            break
        ids.append(nxt)
        hidden, t_last = _append_text(model, cache, [nxt], t_last)
        if nxt == tok.end_think_id:
            break
        logits = model.lm_logits(hidden[-1:])[0]
    from .prompts import THINK_TAIL
    _, t_last = _append_text(model, cache, tok.encode(THINK_TAIL), t_last)
    return ids, t_last


@torch.no_grad()
def build_prefix(model: NeoModel, tok: NeoTokenizer, inp: P.PromptInput, think: bool = False,
                 max_think_tokens: int = 1024) -> PrefixKV:
    cache, positions, hidden = prefill(model, inp)
    t_last = int(positions[0].max())
    think_text, think_ids = None, []
    if think:
        think_ids, t_last = think_decode(model, tok, cache, hidden, t_last, max_think_tokens)
        think_text = tok.decode(think_ids)
    return PrefixKV(cache.stacked(), t_last + 1, think_text, list(inp.input_ids), think_ids)


@torch.no_grad()
def image_prefixes(model: NeoModel, tok: NeoTokenizer, kind: str, prompt: str, images, params: S.Sampling,
                   think: bool = False, max_think_tokens: int = 1024, system_message: str | None = None,
                   image_offsets: list[int] | None = None) -> dict[str, PrefixKV]:
    """Every CFG branch's prefix KV for a T2I (`kind="t2i"`) or edit request (`image_offsets`: where each input
    image stands in the prompt, prompts.edit_inputs). Think only on cond."""
    from . import prompts as P
    if kind == "t2i":
        inputs = P.t2i_inputs(tok, prompt, S.Sampling.of(params).branches, think, system_message)
    elif kind == "edit":
        inputs = P.edit_inputs(tok, prompt, images, S.Sampling.of(params).branches, think, system_message,
                               image_offsets)
    else:
        raise ValueError(f"kind must be t2i or edit, got {kind!r}")
    return {b: build_prefix(model, tok, inp, think and b == "cond", max_think_tokens) for b, inp in inputs.items()}


def gen_velocity(model: NeoModel, prefix_kv: torch.Tensor, t_offset: int, x_in: torch.Tensor, z: torch.Tensor,
                 t: torch.Tensor, th: int, tw: int, t_eps: float, cache: StepCache | None = None) -> torch.Tensor:
    """One gen-branch forward for B images against one prefix: x_in [B, N, H] -> v [B, N, 3072]."""
    B, N, _ = x_in.shape
    positions = image_token_positions(th, tw, t_offset, device=model.device).repeat(1, B)
    scale = model.head_dim ** -0.5
    rep = model.num_heads // model.num_kv_heads

    def attend(i, q, k, v):
        pk = prefix_kv[i, 0].unsqueeze(0).expand(B, -1, -1, -1)
        pv = prefix_kv[i, 1].unsqueeze(0).expand(B, -1, -1, -1)
        kk = torch.cat([pk, k.view(B, N, *k.shape[1:])], 1).transpose(1, 2).repeat_interleave(rep, 1)
        vv = torch.cat([pv, v.view(B, N, *v.shape[1:])], 1).transpose(1, 2).repeat_interleave(rep, 1)
        qq = q.view(B, N, *q.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qq, kk, vv, scale=scale)
        return o.transpose(1, 2).reshape(B * N, *q.shape[1:])

    hidden = model.gen_forward(x_in.reshape(B * N, -1), model.rope(positions), attend, cache)
    x_hat = model.gen_head(hidden.view(B, N, -1), th, tw)
    return S.velocity(x_hat, z, t, t_eps)


@torch.no_grad()
def denoise(model: NeoModel, prefixes: dict[str, PrefixKV], width: int, height: int, params: S.Sampling,
            seed: int = 0, n: int = 1, on_step=None, cache: StepCacheOptions | None = None,
            branch_steps: dict | None = None, noise_draws=(), on_estimate=None,
            observe=None) -> torch.Tensor:
    """Euler flow-matching loop -> [n, 3, H, W] in [-1, 1].

    `cache`: step caching (services/model/step_cache.py), per branch; `branch_steps`, if given, is
    filled with {branch: (computed, reused)} steps; `noise_draws`: the (width, height) of the seeded generator's
    draws before this noise (S.initial_noise); `on_estimate(i, x0)` sees step i's estimate of the clean image
    z + (1 - t) v; `observe(branch)`: the step-cache object of that branch's forward in place of `cache`'s
    (StepCache's `forward` interface; bench/calibrate_teacache.py records the stack's input and residual with it)."""
    cache = StepCacheOptions.of(cache)
    params = S.Sampling.of(params)
    params = params.with_interval(truncated_interval(params.cfg_interval, cache))
    if width % S.BLOCK or height % S.BLOCK:
        raise ValueError(f"width and height must be multiples of {S.BLOCK}")
    th, tw = height // S.BLOCK, width // S.BLOCK
    s = S.noise_scale(model.cfg, th * tw)
    x = S.initial_noise(n, height, width, seed, model.device, model.dtype, s, noise_draws)
    grid = S.timesteps(params.num_inference_steps, params.timestep_shift, device=model.device)
    needed = list(params.branches)
    kvs = {b: prefixes[b].kv.to(model.device, model.dtype) for b in needed}
    states = {b: BranchState() for b in needed}
    for i in range(params.num_inference_steps):
        t, t_next = grid[i], grid[i + 1]
        z = S.patchify(x)
        x_in = model.gen_embed(x, t, s)
        active = needed if S.uses_cfg(params, float(t)) else ["cond"]
        v = {}
        for b in active:
            sc = StepCache([CacheGroup(0, n * th * tw, states[b], cache, i, tokens=th * tw)]) \
                if cache.mode != "off" else None
            v[b] = gen_velocity(model, kvs[b], prefixes[b].t_offset, x_in, z, t, th, tw, params.t_eps,
                                observe(b) if observe is not None else sc)
            if cache.mode == "off":
                states[b].computed += 1
        v = S.combine(v, params, i, float(t))
        if on_estimate is not None:
            on_estimate(i, S.unpatchify(z + (1 - t) * v, th, tw))
        z = S.euler(z, v, t, t_next)
        x = S.unpatchify(z, th, tw)
        if on_step is not None:
            on_step(i + 1, params.num_inference_steps)
    if branch_steps is not None:
        branch_steps.update({b: (st.computed, st.reused) for b, st in states.items()})
    return x


def to_pil(x: torch.Tensor) -> list:
    from PIL import Image
    return [Image.fromarray(a.numpy()) for a in S.to_uint8(x)]


@torch.no_grad()
def text_to_image(model, tok, prompt: str, width: int, height: int, params: S.Sampling,
                  seed: int = 0, n: int = 1, think: bool = False, max_think_tokens: int = 1024):
    """One-call T2I: returns (images [n, 3, H, W] in [-1, 1], think_text)."""
    params = S.Sampling.of(params)
    pre = image_prefixes(model, tok, "t2i", prompt, [], params, think, max_think_tokens)
    return denoise(model, pre, width, height, params, seed, n), pre["cond"].think_text


@torch.no_grad()
def edit(model, tok, prompt: str, images: list, width: int, height: int, params: S.Sampling,
         seed: int = 0, n: int = 1, think: bool = False, max_think_tokens: int = 1024,
         image_offsets: list[int] | None = None):
    params = S.Sampling.of(params)
    pre = image_prefixes(model, tok, "edit", prompt, images, params, think, max_think_tokens,
                         image_offsets=image_offsets)
    return denoise(model, pre, width, height, params, seed, n), pre["cond"].think_text


# ---- interleaved text-and-image answers: the spec's loop, one persistent cache per branch -------------------
@dataclass
class InterleaveAnswer:
    segments: list[list[int]]          # the text token ids between images (greedy)
    images: list[torch.Tensor]         # [1, 3, H, W] in [-1, 1], unclamped (the final Euler states)
    finish_reason: str                 # "stop" (<|im_end|>, or <img> past the cap) | "length"
    stop_token: int | None = None      # the token that ended a "stop" answer (predicted, never fed)


def _append_image(model: NeoModel, tok: NeoTokenizer, cache: _Cache, image, t_img: int):
    """A re-encoded image + `</img>` into a branch's cache at the positions its gen tokens had: image rows
    t_img + 1 (grid h, w) seeing each other and the whole cache, `</img>` at t_img + 2 (spec §2.6, §3.3)."""
    ids = torch.tensor([tok.img_context_id] * image.num_tokens + [tok.img_end_id])
    positions = thw_indexes(ids, tok.img_context_id, [image.grid_hw], t_start=t_img + 1).to(model.device)
    hidden = _forward_und(model, cache, model.embed(ids, [image]), positions, prefill_mask(positions))
    return hidden, t_img + 2


@torch.no_grad()
def interleave(model: NeoModel, tok: NeoTokenizer, messages: list[dict], params: S.Sampling, width: int,
               height: int, seed: int = 0, think: bool = False, max_new_tokens: int = 8192, max_images: int = 10,
               system_message: str | None = None, logit_bias: dict[int, float] | None = None,
               on_image=None, sizes: list[tuple[int, int]] | None = None) -> InterleaveAnswer:
    """interleave_gen as interleave_spec §2.8 describes it: cond and tu caches that grow, a static iu; greedy text
    until `<img>` / `<|im_end|>` / the budget; each image denoised over the CFG branches of `params` (edit rule:
    cond, img_cond = tu, uncond = iu), its noise the k-th draw of one seeded generator, re-encoded from the float
    image into cond and tu. `messages` as prompts.chat_input takes them (PIL images); `logit_bias` is added to the
    logits before the argmax (tests force `<img>` with it); `on_image(k, prefixes)` sees each image's prefixes;
    `sizes` [(W, H), ...] one per image, the last repeated (the official image_size list), else width x height."""
    from . import prompts as P
    system = P.interleave_system_message() if system_message is None else system_message
    heads = P.interleave_heads(tok, messages, think, system)
    return _interleave_loop(model, tok, *heads, params, width, height, seed, max_new_tokens, max_images,
                            logit_bias, on_image, sizes)


@torch.no_grad()
def interleave_gen(model: NeoModel, tok: NeoTokenizer, prompt: str, images: list, params: S.Sampling,
                   width: int, height: int, seed: int = 0, think: bool = False, max_new_tokens: int = 8192,
                   max_images: int = 10, system_message: str | None = None,
                   logit_bias: dict[int, float] | None = None, on_image=None,
                   sizes: list[tuple[int, int]] | None = None) -> InterleaveAnswer:
    """`interleave` called as the official interleave_gen(prompt, images) is: a trusted prompt whose `<image>`
    placeholders mark where the input images (PIL) go (prompts.official_interleave_heads), not messages."""
    from . import prompts as P
    system = P.interleave_system_message() if system_message is None else system_message
    heads = P.official_interleave_heads(tok, prompt, images, think, system)
    return _interleave_loop(model, tok, *heads, params, width, height, seed, max_new_tokens, max_images,
                            logit_bias, on_image, sizes)


def _interleave_loop(model, tok, cond_head, tu_head, params, width, height, seed, max_new_tokens, max_images,
                     logit_bias, on_image, sizes) -> InterleaveAnswer:
    from . import prompts as P
    from .images import generated_image_tensor
    cond, pos, hidden = prefill(model, cond_head)
    t_cond = int(pos[0].max())
    tu, pos_tu, _ = prefill(model, tu_head)
    t_tu = int(pos_tu[0].max())
    iu = build_prefix(model, tok, P.PromptInput(tok.encode(P.UNCOND_TEXT)))
    bias = torch.zeros(model.cfg.llm.vocab_size)
    for t, b in (logit_bias or {}).items():
        bias[t] += b

    def argmax(h) -> int:
        return int(torch.argmax(model.lm_logits(h[-1:])[0].cpu() + bias))

    def size(k: int) -> tuple[int, int]:
        return sizes[min(k, len(sizes) - 1)] if sizes else (width, height)

    segments, images, text_tokens = [], [], 0
    nxt = argmax(hidden)
    while True:
        seg: list[int] = []
        while nxt not in (tok.im_end_id, tok.img_start_id) and text_tokens < max_new_tokens:
            seg.append(nxt)
            text_tokens += 1
            hidden, t_cond = _append_text(model, cond, [nxt], t_cond)
            nxt = argmax(hidden)
        segments.append(seg)
        if text_tokens >= max_new_tokens:
            return InterleaveAnswer(segments, images, "length")
        if nxt == tok.im_end_id or len(images) >= max_images:
            return InterleaveAnswer(segments, images, "stop", nxt)
        _, t_cond = _append_text(model, cond, [tok.img_start_id], t_cond)
        _, t_tu = _append_text(model, tu, [tok.img_start_id], t_tu)
        prefixes = {"cond": PrefixKV(cond.stacked(), t_cond + 1), "img_cond": PrefixKV(tu.stacked(), t_tu + 1),
                    "uncond": iu}
        if on_image is not None:
            on_image(len(images), prefixes)
        x = denoise(model, prefixes, *size(len(images)), params, seed, 1,
                    noise_draws=[size(k) for k in range(len(images))])
        images.append(x)
        image = generated_image_tensor(x[0])
        hidden, t_cond = _append_image(model, tok, cond, image, t_cond)
        _, t_tu = _append_image(model, tok, tu, image, t_tu)
        nxt = argmax(hidden)
