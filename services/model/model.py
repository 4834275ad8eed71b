"""NeoModel: the NEO-unify MoT model over packed tokens, with attention supplied by the caller.

The module tree mirrors the checkpoint keys (`language_model.model.layers.{i}...`, `vision_model...`,
`fm_modules...`), and is built only for the branch a process needs: "und" (text + input images,
lm_head), "gen" (denoising: `*_mot_gen` + `fm_modules`) or "both" (the reference pipeline).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import NeoConfig
from .modules import (BRANCH_SUFFIX, ConvDecoder, Linear, MoTDecoderLayer, RMSNorm, Rope, TimestepEmbedder,
                      VisionModel, add_norm, fused_add_norm, token_mlp_head)
from .parallel import TPContext

# attend(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

BRANCHES = {"und": ("und",), "gen": ("gen",), "both": ("und", "gen")}


class DecoderStack(nn.Module):
    def __init__(self, cfg: NeoConfig, branches, tp):
        super().__init__()
        llm = cfg.llm
        sfx = [BRANCH_SUFFIX[b] for b in branches]
        if "und" in branches:
            self.embed_tokens = nn.Embedding(llm.vocab_size, llm.hidden_size)
            self.norm = RMSNorm(llm.hidden_size, llm.rms_norm_eps)
        if "gen" in branches:
            self.norm_mot_gen = RMSNorm(llm.hidden_size, llm.rms_norm_eps)
        self.layers = nn.ModuleList(MoTDecoderLayer(cfg, sfx, tp) for _ in range(llm.num_hidden_layers))


class LanguageModel(nn.Module):
    def __init__(self, cfg: NeoConfig, branches, tp):
        super().__init__()
        self.model = DecoderStack(cfg, branches, tp)
        if "und" in branches:
            self.lm_head = Linear(cfg.llm.hidden_size, cfg.llm.vocab_size)


class NeoModel(nn.Module):
    def __init__(self, cfg: NeoConfig, branch: str = "both", tp: TPContext | None = None):
        super().__init__()
        if branch not in BRANCHES:
            raise ValueError(f"branch must be one of {sorted(BRANCHES)}, got {branch!r}")
        self.cfg = cfg
        self.branch = branch
        self.tp = tp
        branches = BRANCHES[branch]
        h = cfg.llm.hidden_size
        self.language_model = LanguageModel(cfg, branches, tp)
        if "und" in branches:
            self.vision_model = VisionModel(cfg.vision, h)
        if "gen" in branches:
            fm = {
                "vision_model_mot_gen": VisionModel(cfg.vision, h),
                "timestep_embedder": TimestepEmbedder(h),
                "fm_head": ConvDecoder(h) if cfg.use_pixel_head else token_mlp_head(h, 3 * cfg.token_pixels ** 2),
            }
            if cfg.add_noise_scale_embedding:
                fm["noise_scale_embedder"] = TimestepEmbedder(h)
            self.fm_modules = nn.ModuleDict(fm)
        self._img_context_id: int | None = None  # set by the loader from the checkpoint's tokenizer
        attn = self.language_model.model.layers[0].self_attn
        self.num_layers = cfg.llm.num_hidden_layers
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim

    # ------------------------------------------------------------------ shared pieces
    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def rope(self, positions: torch.Tensor) -> Rope:
        llm = self.cfg.llm
        return Rope(positions.to(self.device, torch.long), self.head_dim, llm.rope_theta, llm.rope_theta_hw)

    def _run_layers(self, x, rope, attend: Attend, branch: str, start: int = 0, stop: int | None = None,
                    norm: RMSNorm | None = None) -> torch.Tensor:
        """Decoder layers [start, stop) of `branch` on the residual x -> the residual after them, or with
        `norm` its norm. Each layer's MLP output is added in the next layer's input norm (and the last one
        in `norm`), fused into its kernel (`modules.fused_add_norm`); without `norm` the last add is plain."""
        layers = self.language_model.model.layers
        fused = fused_add_norm()
        pending = None
        for i in range(start, len(layers) if stop is None else stop):
            x, pending = layers[i](x, rope, attend, i, branch, pending, fused)
        if norm is not None:
            return add_norm(norm, x, pending, fused)[1]
        return x if pending is None else x + pending

    # ------------------------------------------------------------------ understanding branch
    def embed(self, input_ids: torch.Tensor, images=(), image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids -> [T, H]; the image rows are replaced, in order, by the und vision embedder. `image_rows`:
        [T] bool, which rows the images fill (default: every <IMG_CONTEXT> row). The understanding engine passes
        its input images' rows, so an <IMG_CONTEXT> the model generated stays text, as the reference decodes it."""
        ids = torch.as_tensor(input_ids, device=self.device).flatten()
        x = self.language_model.model.embed_tokens(ids)
        if images:
            pv = torch.cat([im.pixel_values for im in images]).to(self.device)
            vis = self.vision_model(pv, [im.grid_hw for im in images]).to(x.dtype)
            ctx = self._img_context_id
            if ctx is None:
                raise ValueError("image context token id unknown: call set_image_context_id()")
            rows = (ids == ctx) if image_rows is None else torch.as_tensor(image_rows, device=ids.device).flatten()
            sel = rows.nonzero().flatten()
            if sel.numel() != vis.shape[0]:
                raise ValueError(f"{sel.numel()} <IMG_CONTEXT> tokens but {vis.shape[0]} image tokens")
            x = x.clone()
            x[sel] = vis
        return x

    def set_image_context_id(self, token_id: int) -> None:
        self._img_context_id = token_id

    def und_forward(self, x: torch.Tensor, rope: Rope, attend: Attend) -> torch.Tensor:
        return self._run_layers(x, rope, attend, "und", norm=self.language_model.model.norm)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.lm_head(hidden).float()

    # ------------------------------------------------------------------ generation branch
    def gen_layers(self, x: torch.Tensor, rope: Rope, attend: Attend, start: int = 0,
                   stop: int | None = None, final_norm: bool = False) -> torch.Tensor:
        """Gen-branch decoder layers [start, stop) over packed tokens -> the residual, or with
        `final_norm` its `norm_mot_gen` (the last residual add fused into that norm)."""
        if x.shape[0] == 0:
            # A sequence-parallel rank may hold no rows of a tiny forward yet must join every
            # layer's collectives (inside `attend`): run one zero row that attention never shows to
            # anyone (its own attention output is zero), then drop it.
            def ghost_attend(i, q, k, v):
                return torch.cat([attend(i, q[:0], k[:0], v[:0]), torch.zeros_like(q)])
            one = self.rope(torch.zeros((3, 1), dtype=torch.long))
            return self.gen_layers(x.new_zeros((1, x.shape[1])), one, ghost_attend, start, stop, final_norm)[:0]
        norm = self.language_model.model.norm_mot_gen if final_norm else None
        return self._run_layers(x, rope, attend, "gen", start, stop, norm)

    def gen_forward(self, x: torch.Tensor, rope: Rope, attend: Attend, cache=None) -> torch.Tensor:
        """Gen-branch forward -> hidden after `norm_mot_gen`.

        `cache` (step_cache.StepCache): per CFG branch, a first-block or TeaCache decision whether the
        stack (after layer 0 for first-block) runs on the branch's rows or its last computed residual is
        reused; the layers run on the computing rows only (StepCache.forward).
        """
        if cache is None:
            return self.gen_layers(x, rope, attend, final_norm=True)
        return self.gen_norm(cache.forward(self, x, rope, attend))

    def gen_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.norm_mot_gen(h)

    def time_embeddings(self, t: torch.Tensor, noise_scale: float, rows: int = 1) -> torch.Tensor:
        """TE(t) + TE'(s / cap), [rows, H]: the same vector for every image token. The official code embeds one
        copy of t per token; a GEMM of `rows` = N identical rows rounds as it does (one row does not, in fp32)."""
        fm = self.fm_modules
        t = torch.as_tensor(t, dtype=torch.float32, device=self.device).reshape(1).expand(rows)
        emb = fm["timestep_embedder"](t)
        if self.cfg.add_noise_scale_embedding:
            s = torch.full_like(t, noise_scale / self.cfg.noise_scale_max_value)
            emb = emb + fm["noise_scale_embedder"](s)
        return emb

    def gen_embed(self, x_t: torch.Tensor, t, noise_scale: float) -> torch.Tensor:
        """x_t [B, 3, H, W] (the Euler state as an image) -> [B, N, hidden] gen input tokens."""
        B, _, H, W = x_t.shape
        p = self.cfg.patch_size
        gh, gw = H // p, W // p
        patches = x_t.reshape(B, 3, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(B * gh * gw, 3 * p * p)
        tok = self.fm_modules["vision_model_mot_gen"](patches, [(gh, gw)] * B)
        tok = tok.view(B, -1, tok.shape[-1])
        return tok + self.time_embeddings(t, noise_scale, tok.shape[1]).to(tok.dtype)

    def gen_head(self, hidden: torch.Tensor, th: int, tw: int) -> torch.Tensor:
        """[B, N, hidden] -> x_hat [B, N, 3072] in (row, col, channel) order per 32-px block."""
        head = self.fm_modules["fm_head"]
        B, N, C = hidden.shape
        if not self.cfg.use_pixel_head:
            return head(hidden)
        p = self.cfg.token_pixels
        img = head(hidden.view(B, th, tw, C).permute(0, 3, 1, 2).contiguous())  # [B, 3, H, W]
        return img.view(B, 3, th, p, tw, p).permute(0, 2, 4, 3, 5, 1).reshape(B, N, 3 * p * p)
