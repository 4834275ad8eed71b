"""Building blocks of NEO-unify: norms, 3-D RoPE, vision embedder, time embedders, MLP/MoE, heads.

Module and parameter names follow the official checkpoint keys exactly, so a state dict loads 1:1 — except the
A3B experts, stacked per MoE block (moe.py: each per-expert key is a view of its rows, `checkpoint_views`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from services.base import knobs

from .fused_rows import RowFusion, hooked   # q|k|v and gate|up as one weight (decode on CUDA)
from .moe import SparseMoE   # the A3B MLP (its own module: stacked experts, the fused kernel)
from .parallel import TPContext


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, cast back, then multiply by the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm) in one kernel pass: the bits of `x + delta` then `forward`."""
        return kernels.add_rms_norm(x, delta, self.weight, self.eps)


def fused_add_norm() -> bool:
    """Whether a residual add runs fused into the RMSNorm that follows it (`RMSNorm.add_forward`;
    default); U1SERVE_FUSED_ADD_NORM=0 runs the add and the norm separately (the same bits: for
    comparing speed and bits on the GPU)."""
    return knobs.FUSED_ADD_NORM.get()


def add_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None, fused: bool):
    """(x + delta, norm of it); delta None: (x, norm(x)). `fused`: in one kernel (`fused_add_norm`)."""
    if delta is None:
        return x, norm(x)
    if fused:
        return norm.add_forward(x, delta)
    x = x + delta
    return x, norm(x)


# ----------------------------------------------------------------------------- linear layers
class Linear(nn.Linear):
    """nn.Linear (no bias) whose forwards with few rows (a decode step: at most kernels.skinny_gemm.MAX_ROWS)
    take the skinny GEMM kernel on CUDA, which reads the weight nearer the HBM bound than cuBLAS does for
    such shapes (docs/benchmarks/kernels.md). Autograd (the RL trainer's copy) and other shapes use torch's
    linear; hooks (LoRA) and quantised replacements (model/quant.py) see an nn.Linear as before.
    U1SERVE_SKINNY_GEMM=0 (read when the model is built) turns the kernel off, to compare."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.skinny = knobs.SKINNY_GEMM.get()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.skinny and x.is_cuda and x.dim() == 2 and x.shape[0] <= kernels.SKINNY_MAX_ROWS
                and not torch.is_grad_enabled()):
            return kernels.skinny_linear(x, self.weight)
        return F.linear(x, self.weight)


# ----------------------------------------------------------------------------- 3-D RoPE
class Rope:
    """Positions [3, T] (t, h, w) and the two bases; the fused Q/K norm + RoPE op reads them.
    Head layout: t-part = first D/2 dims (base theta_t), h and w = D/4 each (base theta_hw)."""

    def __init__(self, positions: torch.Tensor, head_dim: int, theta_t: float, theta_hw: float):
        self.positions = positions
        self.head_dim = head_dim
        self.theta_t = theta_t
        self.theta_hw = theta_hw
        self._table: torch.Tensor | None = None

    def table(self, dtype: torch.dtype) -> torch.Tensor:
        """cos / sin of these positions ([T, 2, D], kernels.rope_table): built by the first layer of a forward,
        read by every layer."""
        if self._table is None or self._table.dtype != dtype:
            self._table = kernels.rope_table(self.positions, self.head_dim, self.theta_t, self.theta_hw, dtype)
        return self._table


# ----------------------------------------------------------------------------- MLPs
class SwiGLU(RowFusion, nn.Module):
    """With `decodes` (the und branch's MLP) gate|up may run as one GEMM (`fuse_rows`, model/fused_rows.py); then,
    for one row with `gated_down` (U1SERVE_GATED_DOWN, read when built), silu(gate) * up is computed inside the
    down GEMM (kernels.gated_linear: the same bits, one launch fewer)."""

    def __init__(self, hidden: int, inter: int, decodes: bool = True):
        super().__init__()
        self.gate_proj = Linear(hidden, inter)
        self.up_proj = Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)
        self.decodes = decodes
        self.gated_down = knobs.GATED_DOWN.get()
        self.init_row_fusion()

    def fused_groups(self) -> dict[str, list[str]]:
        return {"gate_up": ["gate_proj", "up_proj"]} if self.decodes else {}

    def forward(self, x):
        rows = self.fused.get("gate_up")
        gate_up = rows.output(x) if rows is not None else None
        if gate_up is None:
            return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))
        if self.gated_down and self.down_proj.skinny and not hooked(self.down_proj):
            y = kernels.gated_linear(gate_up, self.down_proj.weight)
            if y is not None:
                return y
        return self.down_proj(kernels.silu_mul(*gate_up.split(rows.splits, dim=1)))


# ----------------------------------------------------------------------------- attention + layer
class MoTAttention(RowFusion, nn.Module):
    """Both branches' attention weights; `branch` picks und (no suffix) or gen (`_mot_gen`). The und branch's
    q|k|v may run as one GEMM (`fuse_rows`, model/fused_rows.py): decode steps are its; the gen branch's forwards
    have hundreds of rows, where the layers run one by one anyway."""

    def __init__(self, cfg, branches, tp: TPContext | None):
        super().__init__()
        llm = cfg.llm
        ws = tp.world_size if tp else 1
        if llm.num_attention_heads % ws or llm.num_key_value_heads % ws:
            raise ValueError(f"TP {ws} must divide q heads {llm.num_attention_heads} and kv heads "
                             f"{llm.num_key_value_heads}")
        self.num_heads = llm.num_attention_heads // ws
        self.num_kv_heads = llm.num_key_value_heads // ws
        self.head_dim = d = llm.head_dim
        h = llm.hidden_size
        for sfx in branches:
            setattr(self, "q_proj" + sfx, Linear(h, self.num_heads * d))
            setattr(self, "k_proj" + sfx, Linear(h, self.num_kv_heads * d))
            setattr(self, "v_proj" + sfx, Linear(h, self.num_kv_heads * d))
            setattr(self, "o_proj" + sfx, Linear(self.num_heads * d, h))
            for n in ("q_norm", "q_norm_hw", "k_norm", "k_norm_hw"):
                setattr(self, n + sfx, RMSNorm(d // 2, llm.rms_norm_eps))
        self.suffixes = tuple(branches)
        self.init_row_fusion()

    def fused_groups(self) -> dict[str, list[str]]:
        return {sfx: [n + sfx for n in ("q_proj", "k_proj", "v_proj")] for sfx in self.suffixes
                if sfx == BRANCH_SUFFIX["und"]}

    def qkv(self, x: torch.Tensor, rope: Rope, sfx: str):
        T = x.shape[0]
        d = self.head_dim
        quantized = getattr(self, "qkv_proj" + sfx, None)   # fp8: one module for all three (model/quant.py)
        qkv = quantized(x) if quantized is not None else self.fused_call(sfx, x)
        q, k, v = qkv if qkv is not None else (getattr(self, n + sfx)(x) for n in ("q_proj", "k_proj", "v_proj"))
        q = q.view(T, self.num_heads, d)
        k = k.view(T, self.num_kv_heads, d)
        v = v.view(T, self.num_kv_heads, d)
        norm = lambda n: getattr(self, n + sfx)  # noqa: E731
        # split Q/K RMSNorm (t half, hw half) + 3-D RoPE, fused and in place (torch reference on CPU; new
        # tensors under autograd, hence the assignment)
        q, k = kernels.qk_norm_rope_(q, k, norm("q_norm").weight, norm("q_norm_hw").weight,
                                     norm("k_norm").weight, norm("k_norm_hw").weight, rope.positions, rope.theta_t,
                                     rope.theta_hw, norm("q_norm").eps, rope.table(q.dtype))
        return q, k, v


BRANCH_SUFFIX = {"und": "", "gen": "_mot_gen"}


class MoTDecoderLayer(nn.Module):
    def __init__(self, cfg, branches, tp: TPContext | None):
        super().__init__()
        llm = cfg.llm
        ws = tp.world_size if tp else 1
        self.tp = tp
        self.self_attn = MoTAttention(cfg, branches, tp)
        for sfx in branches:
            setattr(self, "input_layernorm" + sfx, RMSNorm(llm.hidden_size, llm.rms_norm_eps))
            setattr(self, "post_attention_layernorm" + sfx, RMSNorm(llm.hidden_size, llm.rms_norm_eps))
            gen = sfx == BRANCH_SUFFIX["gen"]
            if llm.is_moe:
                n_exp = llm.gen_num_experts if gen else llm.num_experts
                k = llm.gen_num_experts_per_tok if gen else llm.num_experts_per_tok
                inter = llm.gen_moe_intermediate_size if gen else llm.moe_intermediate_size
                if inter % ws:
                    raise ValueError(f"TP {ws} must divide the expert width {inter}")
                mlp = SparseMoE(llm.hidden_size, inter // ws, n_exp, k, llm.norm_topk_prob)
            else:
                if llm.intermediate_size % ws:
                    raise ValueError(f"TP {ws} must divide intermediate_size {llm.intermediate_size}")
                mlp = SwiGLU(llm.hidden_size, llm.intermediate_size // ws, decodes=not gen)
            setattr(self, "mlp" + sfx, mlp)

    def _reduce(self, x):
        if self.tp is not None and self.tp.world_size > 1:
            self.tp.all_reduce(x)
        return x

    def forward(self, x: torch.Tensor, rope: Rope, attend, layer_idx: int, branch: str,
                pending: torch.Tensor | None = None, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual x + `pending` (the previous layer's MLP output, not added yet; None:
        x is the whole residual). Returns (the residual after attention, the MLP output): the caller
        adds them, in the next layer's input norm or after the last layer. `fused`: each residual add
        runs in the kernel of the norm after it (`add_norm`)."""
        sfx = BRANCH_SUFFIX[branch]
        x, h = add_norm(getattr(self, "input_layernorm" + sfx), x, pending, fused)
        q, k, v = self.self_attn.qkv(h, rope, sfx)
        o = attend(layer_idx, q, k, v)
        o = getattr(self.self_attn, "o_proj" + sfx)(o.reshape(x.shape[0], -1))
        x, h = add_norm(getattr(self, "post_attention_layernorm" + sfx), x, self._reduce(o), fused)
        return x, self._reduce(getattr(self, "mlp" + sfx)(h))


# ----------------------------------------------------------------------------- vision embedder
class VisionEmbeddings(nn.Module):
    """16-px patch conv -> GELU -> interleaved 2-D RoPE (fp32) -> 2x2 stride-2 conv into LLM width."""

    def __init__(self, vcfg, llm_hidden: int):
        super().__init__()
        self.patch_size = vcfg.patch_size
        self.embed_dim = vcfg.hidden_size
        self.merge = int(round(1 / vcfg.downsample_ratio))
        self.rope_theta = vcfg.rope_theta
        self.patch_embedding = nn.Conv2d(vcfg.num_channels, vcfg.hidden_size, self.patch_size, self.patch_size)
        self.dense_embedding = nn.Conv2d(vcfg.hidden_size, llm_hidden, self.merge, self.merge)

    def _rope_2d(self, x: torch.Tensor, grids) -> torch.Tensor:
        xs, ys = [], []
        for gh, gw in grids:
            idx = torch.arange(gh * gw, device=x.device)
            xs.append(idx % gw)
            ys.append(idx // gw)
        px, py = torch.cat(xs), torch.cat(ys)
        half = self.embed_dim // 2
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, device=x.device).float() / half))
        xf = x.float()

        def rot(part, pos):
            ang = torch.outer(pos.float(), inv)
            cos, sin = ang.cos(), ang.sin()
            a, b = part[..., 0::2], part[..., 1::2]
            out = torch.empty_like(part)
            out[..., 0::2] = a * cos - b * sin
            out[..., 1::2] = a * sin + b * cos
            return out

        out = torch.cat([rot(xf[:, :half], px), rot(xf[:, half:], py)], dim=-1)
        return out.to(self.patch_embedding.weight.dtype)

    def forward(self, pixel_values: torch.Tensor, grids) -> torch.Tensor:
        p = self.patch_size
        x = pixel_values.to(self.patch_embedding.weight.dtype).view(-1, 3, p, p)
        x = F.gelu(self.patch_embedding(x)).view(-1, self.embed_dim)
        x = self._rope_2d(x, grids)
        outs, pos = [], 0
        for gh, gw in grids:
            img = x[pos:pos + gh * gw].view(1, gh, gw, -1).permute(0, 3, 1, 2)
            y = self.dense_embedding(img).permute(0, 2, 3, 1)
            outs.append(y.reshape(-1, y.shape[-1]))
            pos += gh * gw
        return torch.cat(outs, dim=0)


class VisionModel(nn.Module):
    def __init__(self, vcfg, llm_hidden: int):
        super().__init__()
        self.embeddings = VisionEmbeddings(vcfg, llm_hidden)

    def forward(self, pixel_values, grids):
        return self.embeddings(pixel_values, grids)


# ----------------------------------------------------------------------------- generation heads
class TimestepEmbedder(nn.Module):
    """Sinusoid of the raw value (256 wide, [cos | sin], fp32) -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half).to(values.device)
        args = values[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


def token_mlp_head(hidden: int, out_dim: int) -> nn.Sequential:
    """U1 head: Linear(H -> 4096) -> GELU -> Linear(4096 -> 3072) per token (width is a literal 4096)."""
    return nn.Sequential(nn.Linear(hidden, 4096), nn.GELU(), nn.Linear(4096, out_dim))


class ConvDecoder(nn.Module):
    """U1.5 pixel head on the token map: PixelShuffle 2 -> conv3x3 -> GELU -> PixelShuffle 2 -> conv3x3
    -> PixelShuffle 8. Mixes neighbouring tokens (removes U1's grid artifacts)."""

    def __init__(self, hidden: int, width: int = 1024):
        super().__init__()
        self.conv1 = nn.Conv2d(hidden // 4, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width // 4, 192, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(F.pixel_shuffle(x, 2)))
        return F.pixel_shuffle(self.conv2(F.pixel_shuffle(x, 2)), 8)
