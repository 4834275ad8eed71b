"""fp8 (e4m3) weights and activations for the dense Linear layers of a decoder branch.

Scheme (W8A8, dynamic): each weight row (output channel) has its own fp32 scale, computed at load
or read from an fp8 checkpoint; each activation row (token) is quantised on the fly with its own
scale (`kernels.fp8_quant`). On CUDA the GEMM is `torch._scaled_mm` with row-wise scales (fp32
accumulate, bf16 out); elsewhere the same fp8 values are multiplied in fp32 and scaled the same way
(emulation: same quantised operands, only the summation order differs), so the path runs and is
tested on CPU.

`quantize_model` swaps modules of a decoder layer; the model's forward code is the same for bf16 and fp8:
  input_layernorm           -> Fp8RMSNorm: RMSNorm + per-token quantisation in one kernel (its output
                               feeds only the q and k|v GEMMs, which share that one quantised activation);
                               `add_forward` runs the residual add before it in the same kernel
  q_proj, k_proj, v_proj    -> qkv_proj (Fp8QKV): a q GEMM and one k|v GEMM (concatenated output
                               channels). q keeps its own GEMM so it leaves contiguous ([T, Hq, D]):
                               cuDNN attention reuses one plan for every prefix length only for
                               contiguous q (services/generation/attention.py)
  o_proj                    -> Fp8Linear (quantises the attention output itself)
  post_attention_layernorm  -> Fp8RMSNorm
  mlp (SwiGLU)              -> Fp8SwiGLU: one gate|up GEMM, silu(gate) * up quantised in one kernel for
                               the down GEMM
Layers whose dims are not multiples of 16 (`_scaled_mm`'s rule) stay in the model dtype.

Each distinct activation is quantised once, by its producer where we own the kernel (RMSNorm, add + RMSNorm,
silu*mul: the fp8 row and its per-token scale written in the kernel that computes the activation, handed to
the GEMMs as an `Fp8Activation`), by the one standalone quantiser pass otherwise (o_proj: cuDNN attention
writes its input). `GemmPolicy.fused` False (U1SERVE_FP8_FUSED=0; for comparing) runs the producers in the
model dtype and quantises in the GEMM layers instead (still once per input: q and k|v share it), the same
values to the fp8 rounding rule (kernels/norm_act.py says which producers are bit-exact).

`GemmPolicy` decides per GEMM from its row count M alone (a pure function of the shape, so the same
batch shape always gets the same numerics): below `min_tokens` rows the layer runs the model-dtype
weights it kept (fp8 loses there: quantiser passes and `_scaled_mm` launch costs are not repaid by the
faster GEMM; measured 1024² single-branch, 1,024 rows: fp8 0.042 s/step vs bf16 0.035 s), at or above
`fast_accum_min_tokens` rows `_scaled_mm` uses fast accumulation (faster at 4,096 rows, much slower at
1,024 on H200, run 1). Keeping the model-dtype weights costs their memory (2x the fp8 weights); with
`min_tokens` 0 they are dropped. Env: U1SERVE_FP8_MIN_TOKENS, U1SERVE_FP8_FAST_ACCUM (0 | 1 | auto),
U1SERVE_FP8_FUSED (1 | 0).

What stays in bf16: attention itself (softmax(QK^T)V), RoPE, the gen embedder convs, the time
embedders, the output head (fm_head: it writes the pixels), and MoE experts and routers (A3B: only the
attention projections of a MoE layer are quantised).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_quant import FP8_DTYPE, quant_fp8_rowwise
from kernels.norm_act import add_rms_norm_fp8, rms_norm_fp8, silu_mul, silu_mul_fp8
from services.base import knobs

from .modules import BRANCH_SUFFIX, RMSNorm, SwiGLU

MIN_CAPABILITY = (8, 9)           # fp8 tensor cores: Ada (8.9) and Hopper (9.0)
CUDA_MIN_TOKENS = 2048            # H200 run 1: fp8 lost at 1,024 rows (see module doc)
GRAPHED_MIN_TOKENS = 1024         # ... where the steps replay CUDA graphs (no launch gaps): 1024² single-branch
                                  # step, fp8 on every GEMM, graphs: 0.0219 s = 1.43x bf16 (eager: 0.79x);
                                  # H200, 2026-12-02
CUDA_FAST_ACCUM_MIN_TOKENS = 4096
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class Fp8Unsupported(RuntimeError):
    """fp8 was asked for where it cannot run (GPU generation, dtype, torch)."""


@dataclass(frozen=True)
class GemmPolicy:
    """Which GEMM a quantised layer runs for M rows: model dtype below `min_tokens`, else fp8, with
    `_scaled_mm`'s fast accumulation from `fast_accum_min_tokens` rows (None: never). `fused`: the
    activation producers (RMSNorm, silu*mul) write the fp8 activation themselves (else the GEMM layers
    quantise their input: the comparison of U1SERVE_FP8_FUSED=0)."""
    min_tokens: int = 0
    fast_accum_min_tokens: int | None = None
    fused: bool = True

    def fused_producer(self, rows: int) -> bool:
        """Whether a producer of `rows` rows quantises what it computes."""
        return self.fused and self.fp8(rows)

    def fp8(self, rows: int) -> bool:
        return rows >= self.min_tokens

    def fast_accum(self, rows: int) -> bool:
        return self.fast_accum_min_tokens is not None and rows >= self.fast_accum_min_tokens

    @classmethod
    def for_device(cls, device, graphed: bool = False) -> "GemmPolicy":
        """The serving default: the thresholds above on CUDA (env overrides; `graphed`: the steps replay CUDA
        graphs, fp8 pays from GRAPHED_MIN_TOKENS rows), plain fp8 elsewhere (the CPU emulation has no launch
        costs to avoid and no fast accumulation)."""
        cuda = torch.device(device).type == "cuda"
        min_tokens = knobs.FP8_MIN_TOKENS.get(
            default=(GRAPHED_MIN_TOKENS if graphed else CUDA_MIN_TOKENS) if cuda else 0)
        fast = knobs.FP8_FAST_ACCUM.get().lower()
        if fast not in ("0", "1", "auto"):
            raise ValueError(f"{knobs.FP8_FAST_ACCUM.name} must be 0, 1 or auto, got {fast!r}")
        fast_min = {"0": None, "1": 0, "auto": CUDA_FAST_ACCUM_MIN_TOKENS if cuda else None}[fast]
        return cls(max(0, min_tokens), fast_min, knobs.FP8_FUSED.get())


def fp8_policy(model) -> GemmPolicy | None:
    """The policy the model's fp8 layers run under (None: no fp8 layer; int8 layers are not fp8)."""
    return next((m.policy for m in model.modules() if type(m) is Fp8Linear), None)


def use_policy(model, policy: GemmPolicy) -> None:
    """Run every 8-bit layer of the model under `policy` (its min_tokens > 0 needs the kept model-dtype weights:
    only a policy that had min_tokens > 0 may be replaced by another with min_tokens > 0)."""
    for m in model.modules():
        old = getattr(m, "policy", None)
        if isinstance(old, GemmPolicy):
            if policy.min_tokens > 0 and old.min_tokens == 0:
                raise ValueError("the model-dtype weights were dropped (min_tokens 0): cannot raise min_tokens")
            m.policy = policy


class Fp8Activation:
    """A [rows, K] activation already quantised by its producer (q e4m3, scale [rows, 1] fp32), standing
    in for the tensor of shape `lead + (K,)` and dtype `dtype` it replaces."""
    __slots__ = ("q", "scale", "dtype", "lead")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, lead: tuple = ()):
        self.q, self.scale, self.dtype = q, scale, dtype
        self.lead = tuple(lead) or (q.shape[0],)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.lead + (self.q.shape[1],))


def quantize_input(x, policy: GemmPolicy, quantize_rows=quant_fp8_rowwise):
    """x for the quantised GEMMs of one input: an Fp8Activation (quantised here by `quantize_rows` unless
    its producer did), or x itself when its row count runs in the model dtype."""
    if isinstance(x, Fp8Activation):
        return x
    x2 = x.reshape(-1, x.shape[-1])
    if not policy.fp8(x2.shape[0]):
        return x
    return Fp8Activation(*quantize_rows(x2), x.dtype, x.shape[:-1])


def scaled_mm_emulated(q_x, q_w, scale_x, scale_w, out_dtype) -> torch.Tensor:
    """What `_scaled_mm` computes, in fp32 on any device: (q_x @ q_w^T) * scale_x * scale_w.
    q_x [M, K] / q_w [N, K] fp8; scale_x [M, 1], scale_w [1, N] fp32. Products of two e4m3 values are
    exact in fp32, so only the accumulation order can differ from the tensor-core result (whose
    epilogue also multiplies by scale_x first, then scale_w, then rounds once)."""
    acc = q_x.float() @ q_w.float().t()
    return (acc * scale_x * scale_w).to(out_dtype)


def scaled_mm(q_x, q_w, scale_x, scale_w, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    if q_x.is_cuda:
        # mat2 column-major: the transpose of the row-major [N, K] weight; row-wise scales
        # scale_a [M, 1] and scale_b [1, N], both fp32 (the torch >= 2.5 row-wise contract)
        return torch._scaled_mm(q_x, q_w.t(), scale_a=scale_x, scale_b=scale_w, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return scaled_mm_emulated(q_x, q_w, scale_x, scale_w, out_dtype)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and one fp32 scale per output channel. With `splits` the weight
    holds several Linear layers' rows (one GEMM for all of them) and the result is their outputs.
    `weight_hp` (model dtype, kept when the policy has a `min_tokens`) serves the row counts that run
    unquantised: one GEMM per part there, exactly the unquantised layers' computation.
    Subclasses for another 8-bit scheme (quant_int8.Int8Linear) override WEIGHT_DTYPE, `quantize_rows`
    and `gemm`."""
    WEIGHT_DTYPE = FP8_DTYPE
    quantize_rows = staticmethod(quant_fp8_rowwise)   # x [M, K] -> (q, scale [M, 1])

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 policy: GemmPolicy = GemmPolicy(), weight_hp: torch.Tensor | None = None,
                 splits: tuple[int, ...] | None = None):
        super().__init__()
        if weight_q.dtype != self.WEIGHT_DTYPE:
            raise ValueError(f"weight must be {self.WEIGHT_DTYPE}, got {weight_q.dtype}")
        if policy.min_tokens > 0 and weight_hp is None:
            raise ValueError("a policy with min_tokens > 0 needs the model-dtype weights (weight_hp)")
        self.out_features, self.in_features = weight_q.shape
        self.splits = tuple(splits) if splits else None
        if self.splits and sum(self.splits) != self.out_features:
            raise ValueError(f"splits {self.splits} do not add up to {self.out_features} rows")
        self.register_buffer("weight", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float().contiguous())
        self.register_buffer("weight_hp", None if weight_hp is None else weight_hp.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.policy = policy

    @classmethod
    def from_linears(cls, linears: list[nn.Linear], quantized: list | None = None,
                     policy: GemmPolicy = GemmPolicy()) -> "Fp8Linear":
        """One layer from the rows of `linears` (one: a plain layer). `quantized`: per linear its
        (q, scale) from an fp8 checkpoint, or None to quantise its weight here."""
        qs, ss = [], []
        for lin, pre in zip(linears, quantized or [None] * len(linears)):
            q, s = pre if pre is not None else cls.quantize_rows(lin.weight.detach())
            qs.append(q.to(lin.weight.device))
            ss.append(s.reshape(-1).to(lin.weight.device))
        biases = [lin.bias for lin in linears]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("fused layers must all have a bias or none")
        hp = _cat([lin.weight.detach() for lin in linears]) if policy.min_tokens > 0 else None
        bias = None if biases[0] is None else _cat([b.detach() for b in biases])
        splits = tuple(q.shape[0] for q in qs) if len(linears) > 1 else None
        return cls(_cat(qs), _cat(ss), bias, policy, hp, splits)

    @classmethod
    def from_linear(cls, linear: nn.Linear, policy: GemmPolicy = GemmPolicy()) -> "Fp8Linear":
        return cls.from_linears([linear], policy=policy)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.t()

    def forward(self, x):
        """x: a tensor [..., K] or an Fp8Activation. Returns [..., N] (or one tensor per split)."""
        x = self.quantize_input(x)
        if not isinstance(x, Fp8Activation):
            return self._forward_unquantized(x)
        y = self.gemm(x)
        if self.bias is not None:
            y = y + self.bias
        y = y.view(*x.lead, self.out_features)
        return y.split(self.splits, dim=-1) if self.splits else y

    def quantize_input(self, x):
        return quantize_input(x, self.policy, self.quantize_rows)

    def gemm(self, x: Fp8Activation) -> torch.Tensor:
        """[rows, out_features] in x.dtype, before the bias."""
        fast = self.policy.fast_accum(x.q.shape[0])
        return scaled_mm(x.q, self.weight, x.scale, self.weight_scale, x.dtype, fast)

    def _forward_unquantized(self, x: torch.Tensor):
        if not self.splits:
            return F.linear(x, self.weight_hp, self.bias)
        ws = self.weight_hp.split(self.splits)
        bs = self.bias.split(self.splits) if self.bias is not None else [None] * len(ws)
        return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))

    def extra_repr(self) -> str:
        parts = f", parts={list(self.splits)}" if self.splits else ""
        return f"in={self.in_features}, out={self.out_features}{parts}, fp8 e4m3 row-wise, {self.policy}"


class Fp8QKV(nn.Module):
    """The q, k and v projections of one attention on one (quantised once) activation: a q GEMM and a
    k|v GEMM. `MoTAttention.qkv` calls it in place of the three Linear layers."""

    def __init__(self, q_proj: Fp8Linear, kv_proj: Fp8Linear):
        super().__init__()
        self.q_proj, self.kv_proj = q_proj, kv_proj

    def forward(self, x):
        x = self.q_proj.quantize_input(x)
        k, v = self.kv_proj(x)
        return self.q_proj(x), k, v


class Fp8SwiGLU(nn.Module):
    """SwiGLU with gate|up as one fp8 GEMM and silu(gate) * up quantised in the same kernel (its
    only consumer is the down GEMM)."""

    def __init__(self, gate_up_proj: Fp8Linear, down_proj: Fp8Linear):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def forward(self, x):
        gate, up = self.gate_up_proj(x)
        lead, n = gate.shape[:-1], gate.shape[-1]
        g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
        if self.down_proj.policy.fused_producer(g2.shape[0]):
            return self.down_proj(Fp8Activation(*self.silu_mul_quantized(g2, u2), gate.dtype, lead))
        return self.down_proj(silu_mul(gate, up))

    def silu_mul_quantized(self, gate: torch.Tensor, up: torch.Tensor):
        """(q, scale) of silu(gate) * up in the down GEMM's format."""
        return silu_mul_fp8(gate, up)


class Fp8RMSNorm(RMSNorm):
    """RMSNorm whose output feeds only fp8 GEMMs: normalised and quantised per token in one kernel."""

    def __init__(self, norm: RMSNorm, policy: GemmPolicy):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.policy = policy

    def forward(self, x: torch.Tensor):
        if not self._fp8(x):
            return super().forward(x)
        return Fp8Activation(*rms_norm_fp8(x, self.weight, self.eps), x.dtype, x.shape[:-1])

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor):
        """(x + delta, its norm quantised) in one kernel (`add_rms_norm_fp8`: the sum is torch's x + delta, the
        quantised norm `rms_norm_fp8`'s of it). Below the fp8 row threshold: the bf16 norm, add fused too."""
        if not self._fp8(x):
            return super().add_forward(x, delta)
        s, q, scale = add_rms_norm_fp8(x, delta, self.weight, self.eps)
        return s, Fp8Activation(q, scale, x.dtype, x.shape[:-1])

    def _fp8(self, x: torch.Tensor) -> bool:
        return self.policy.fused_producer(x.numel() // max(x.shape[-1], 1))


def require_fp8(capability: tuple[int, int], name: str) -> None:
    """Raise Fp8Unsupported on a GPU without fp8 tensor cores."""
    if tuple(capability) < MIN_CAPABILITY:
        raise Fp8Unsupported(
            f"--quantization fp8 needs an fp8 GPU (compute capability >= 8.9: Ada, Hopper or newer); "
            f"{name} has {capability[0]}.{capability[1]}. Serve it in bf16 (--quantization none).")


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """Fail early and clearly where the fp8 path cannot run; on CUDA also run one tiny GEMM
    against the emulation (catches a torch whose `_scaled_mm` contract moved)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    require_fp8(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    if dtype != torch.bfloat16:
        raise Fp8Unsupported(f"--quantization fp8 on CUDA needs --dtype bfloat16 (row-wise _scaled_mm "
                             f"writes bf16), got {dtype}")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(32, 64, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 64, device=device, generator=g).to(torch.bfloat16)
    qx, sx = quant_fp8_rowwise(x)
    qw, sw = quant_fp8_rowwise(w)
    try:
        got = scaled_mm(qx, qw, sx, sw.t().contiguous(), torch.bfloat16).float()
    except Exception as e:
        raise Fp8Unsupported(f"torch._scaled_mm with row-wise scales failed on "
                             f"{torch.cuda.get_device_name(device)} with torch {torch.__version__}: {e}") from e
    want = scaled_mm_emulated(qx, qw, sx, sw.t(), torch.float32)
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    if not err < 2e-2:
        raise Fp8Unsupported(f"torch._scaled_mm disagrees with its emulation (max rel err {err:.3g}) "
                             f"with torch {torch.__version__}")


def target_linears(model, branches=("gen",)):
    """(owner module, attribute name, full parameter name) of every dense Linear to quantise: the targets as a
    list, read by memory_plan (bytes per format) and bench/bench_format_accuracy.py (one group at a time)."""
    out = []
    for i, layer in enumerate(model.language_model.model.layers):
        prefix = f"language_model.model.layers.{i}."
        for b in branches:
            sfx = BRANCH_SUFFIX[b]
            attn = layer.self_attn
            if hasattr(attn, "q_proj" + sfx):
                out += [(attn, n + sfx, f"{prefix}self_attn.{n}{sfx}") for n in _ATTN]
            mlp = getattr(layer, "mlp" + sfx, None)
            if isinstance(mlp, SwiGLU):  # MoE experts stay bf16 (see module doc)
                out += [(mlp, n, f"{prefix}mlp{sfx}.{n}") for n in _MLP]
    return out


def fp8_eligible(lin) -> bool:
    """A Linear the fp8 GEMM takes: both dims multiples of 16 (`_scaled_mm`'s rule)."""
    return isinstance(lin, nn.Linear) and lin.in_features % 16 == 0 and lin.out_features % 16 == 0


@dataclass(frozen=True)
class Scheme:
    """The layer classes of one 8-bit scheme; `norm` None: the norms stay (the GEMMs quantise their input)."""
    linear: type
    qkv: type
    swiglu: type
    norm: type | None
    policy: object        # device -> GemmPolicy


def quantize_model(model, branches=("gen",), prequantized: dict | None = None,
                   policy: GemmPolicy | None = None, scheme: Scheme | None = None) -> int:
    """Swap the branch's dense Linear layers (and the norms / activation feeding them) for their 8-bit
    versions (`scheme`: FP8_SCHEME when None; by name: quant_schemes.scheme) in place (module doc).
    `prequantized`: {param name without '.weight': (q, scale)} from a quantised checkpoint of that scheme (used
    as is). `policy`: the scheme's default for the model's device. Returns the Linear layers now running
    quantised."""
    sch = scheme or FP8_SCHEME
    policy = policy or sch.policy(model.device)
    return sum(quantize_layer(layer, i, branches, prequantized, policy, sch)
               for i, layer in enumerate(model.language_model.model.layers))


def quantize_layer(layer, i: int, branches, prequantized: dict | None, policy: GemmPolicy, sch: Scheme) -> int:
    """quantize_model's swap for decoder layer `i` alone (the loader quantises each layer as soon as its weights
    are in place: services/model/layerwise_load.py). Returns the Linear layers now running quantised."""
    pre = prequantized or {}
    n = 0
    prefix = f"language_model.model.layers.{i}."
    for b in branches:
        sfx = BRANCH_SUFFIX[b]
        attn, mlp = layer.self_attn, getattr(layer, "mlp" + sfx, None)
        qkv = [x + sfx for x in ("q_proj", "k_proj", "v_proj")]
        if hasattr(attn, qkv[0]) and all(fp8_eligible(getattr(attn, x)) for x in qkv):
            attn_pre = prefix + "self_attn."
            setattr(attn, "qkv_proj" + sfx, sch.qkv(_fp8_layer(sch, attn, qkv[:1], attn_pre, pre, policy),
                                                    _fp8_layer(sch, attn, qkv[1:], attn_pre, pre, policy)))
            for x in qkv:
                delattr(attn, x)
            attn.fused.pop(sfx, None)        # a bf16 q|k|v fused at load (model/fused_rows.py) goes with them
            _quantize_norm(sch, layer, "input_layernorm" + sfx, policy)
            n += 3
        o = "o_proj" + sfx
        if hasattr(attn, o) and fp8_eligible(getattr(attn, o)):
            setattr(attn, o, _fp8_layer(sch, attn, [o], prefix + "self_attn.", pre, policy))
            n += 1
        if isinstance(mlp, SwiGLU) and all(fp8_eligible(getattr(mlp, x)) for x in _MLP):
            mlp_pre = f"{prefix}mlp{sfx}."
            gate_up = _fp8_layer(sch, mlp, ["gate_proj", "up_proj"], mlp_pre, pre, policy)
            down = _fp8_layer(sch, mlp, ["down_proj"], mlp_pre, pre, policy)
            setattr(layer, "mlp" + sfx, sch.swiglu(gate_up, down))
            _quantize_norm(sch, layer, "post_attention_layernorm" + sfx, policy)
            n += 3
    return n


def _fp8_layer(sch: Scheme, owner, names: list[str], prefix: str, prequantized: dict,
               policy: GemmPolicy) -> Fp8Linear:
    """One quantised layer from the Linear layers `names` of `owner` (checkpoint names `prefix + name`)."""
    return sch.linear.from_linears([getattr(owner, x) for x in names],
                                   [prequantized.get(prefix + x) for x in names], policy)


def _quantize_norm(sch: Scheme, layer, name: str, policy: GemmPolicy) -> None:
    norm = getattr(layer, name)
    if sch.norm is not None and type(norm) is RMSNorm:
        setattr(layer, name, sch.norm(norm, policy))


FP8_SCHEME = Scheme(Fp8Linear, Fp8QKV, Fp8SwiGLU, Fp8RMSNorm, GemmPolicy.for_device)
