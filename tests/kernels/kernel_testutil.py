"""Shared helpers for the kernel tests: tolerances, poisoned outputs, paged-pool scenarios."""
from dataclasses import dataclass

import torch

# relative Frobenius error allowed per dtype (device METHOD.md)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype=None):
    dtype = dtype or ref.dtype
    assert not torch.isnan(out).any(), "output has NaN (unwritten or bad math)"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.1e}"


# (mantissa bits, smallest normal exponent) per dtype: the spacing of representable numbers
_FLOAT_BITS = {torch.float16: (10, -14), torch.bfloat16: (7, -126), torch.float32: (23, -126),
               torch.float64: (52, -1022), torch.float8_e4m3fn: (3, -6)}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance between adjacent `dtype` numbers at |x| (float64)."""
    mantissa, emin = _FLOAT_BITS[dtype]
    exponent = torch.floor(torch.log2(x.double().abs().clamp_min(2.0 ** emin)))
    return torch.pow(2.0, exponent - mantissa)


# Element-wise ULP bounds of the norm/activation kernels vs their references, with margin: over 2000 seeds
# (every shape of check_norm_act.py) the worst was 6 ULP in fp32 (exp/rsqrt differ in the last bits) and 2 ULP
# in fp16 (fp32 math rounded once, summation order differs).
ULPS = {torch.float16: 3, torch.bfloat16: 3, torch.float32: 8, torch.float64: 8}


def assert_close_ulp(out, ref, ulps: float | None = None):
    """Element-wise: |out - ref| <= ulps units in the last place of ref's dtype (default: ULPS[dtype])."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    ulps = ULPS[ref.dtype] if ulps is None else ulps
    assert not torch.isnan(out).any(), "output has NaN"
    diff = (out.double() - ref.double()).abs()
    in_ulps = diff / ulp(ref, ref.dtype)
    worst = float(in_ulps.max()) if in_ulps.numel() else 0.0
    assert worst <= ulps, f"{int((in_ulps > ulps).sum())} element(s) off by more than {ulps} ULP (worst {worst:.2f})"


_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_same_bits(got, want):
    """Bit for bit (the sign of zero too), same shape and dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    diff = got.view(_INT_OF[got.dtype]) != want.view(_INT_OF[want.dtype])
    assert not diff.any(), f"{int(diff.sum())} element(s) differ, first at {diff.nonzero()[0].tolist()}"


def residual_pair(shape, dtype):
    """(x, delta) of `shape` whose sum needs rounding to `dtype` almost everywhere (magnitudes up to 2^16
    apart); the first row, where long enough, holds exact ties both ways (to even: down from an even, up
    from an odd mantissa), a cancellation to +0 and -0 + -0; the last row of several an overflow to +-inf."""
    n = shape[-1]
    x = (torch.randn(shape) * 2.0 ** torch.randint(-8, 9, shape)).to(dtype)
    d = (torch.randn(shape) * 2.0 ** torch.randint(-8, 9, shape)).to(dtype)
    rows_x, rows_d = x.view(-1, n), d.view(-1, n)
    if rows_x.shape[0] and n >= 6:
        half_ulp = torch.finfo(dtype).eps / 2     # of 1.0
        ties = [(1.0, half_ulp), (1.0 + 2 * half_ulp, half_ulp), (-1.0, -half_ulp),
                (-(1.0 + 2 * half_ulp), -half_ulp), (3.0, -3.0), (-0.0, -0.0)]
        for i, (a, b) in enumerate(ties):
            rows_x[0, i], rows_d[0, i] = a, b
    if rows_x.shape[0] > 1:
        big = torch.finfo(dtype).max
        rows_x[-1, :2] = torch.tensor([big, -big])
        rows_d[-1, :2] = torch.tensor([big, -big])
    return x, d


def poisoned(like):
    return torch.full_like(like, float("nan"))


@dataclass
class Seq:
    cached: int                 # tokens already in the KV cache (prefix-cache hit)
    new: int                    # tokens in this prefill
    images: tuple = ()          # absolute (start, end) spans of image tokens


def build_prefill(seqs, hq, hkv, d, dtype, with_images=True, pool_extra=17, contiguous=None):
    """Random q, paged K/V pool and metadata for `seqs`. Pool slots: `contiguous` = None gives
    every other sequence one contiguous run of slots (the kernels' block-load path) and random slots
    to the rest (the gather path); True / False: all contiguous / all random. Reads only, so slots
    shared between sequences are harmless."""
    totals = [s.cached + s.new for s in seqs]
    S = sum(totals) + pool_extra
    perm = torch.randperm(S)
    max_len = max(totals) + 3
    req_to_token = torch.randint(0, S, (len(seqs), max_len), dtype=torch.int32)
    used = 0
    for b, L in enumerate(totals):
        run = contiguous if contiguous is not None else b % 2 == 0
        req_to_token[b, :L] = (torch.arange(used, used + L) if run else perm[used:used + L]).int()
        used += L
    k_pool = torch.randn(S, hkv, d).to(dtype)
    v_pool = torch.randn(S, hkv, d).to(dtype)
    Tq = sum(s.new for s in seqs)
    q = torch.randn(Tq, hq, d).to(dtype)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([s.new for s in seqs]).cumsum(0)
    image_end = torch.zeros(Tq, dtype=torch.int32)
    for b, s in enumerate(seqs):
        for (a, e) in s.images:
            for p in range(max(a, s.cached), min(e, s.cached + s.new)):
                image_end[int(cu[b]) + p - s.cached] = e
    b_start = torch.tensor([s.cached for s in seqs], dtype=torch.int32)
    b_seq_len = torch.tensor(totals, dtype=torch.int32)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, req_to_token=req_to_token, b_start=b_start,
                b_seq_len=b_seq_len, cu_seqlens_q=cu,
                image_end=image_end if with_images else None)

# Mask cases shared by the reference and the interpreted kernel checks (interpreter tiles are 16x16, so the
# spans cross block edges at 16/32/48).
PREFILL_CASES = {
    "image_crosses_block": [Seq(0, 40, ((10, 30),))],
    "several_images": [Seq(0, 53, ((3, 10), (20, 37), (40, 45)))],
    "image_at_start_and_end": [Seq(0, 29, ((0, 12), (20, 29)))],
    "prefix_cache_offsets": [Seq(21, 19, ((25, 33),)), Seq(7, 1), Seq(33, 30, ((30, 50),))],
    "length_one": [Seq(0, 1), Seq(0, 1, ((0, 1),)), Seq(5, 1)],
}
