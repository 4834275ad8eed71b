import math

import pytest
import torch

from kernels.decode_attention import decode_attention, decode_attention_ref, decode_attention_triton
from kernels.denoise_attention import denoise_attention, denoise_attention_ref, denoise_attention_triton

from tests.kernels.kernel_testutil import assert_close, poisoned


def _decode_inputs(lens, hq, hkv, d, dtype):
    S = sum(lens) + 9
    perm = torch.randperm(S)
    r2t = torch.randint(0, S, (len(lens), max(lens) + 5), dtype=torch.int32)
    used = 0
    for b, L in enumerate(lens):
        r2t[b, :L] = perm[used:used + L].int()
        used += L
    return (torch.randn(len(lens), hq, d).to(dtype), torch.randn(S, hkv, d).to(dtype),
            torch.randn(S, hkv, d).to(dtype), r2t, torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 16), (8, 1, 128), (4, 4, 16)])
@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_decode_matches_reference(rng, hq, hkv, d, splits):
    q, kp, vp, r2t, lens = _decode_inputs([1, 37, 70, 5], hq, hkv, d, torch.float32)
    ref = decode_attention_ref(q, kp, vp, r2t, lens, 1 / math.sqrt(d))
    out = decode_attention_triton(q, kp, vp, r2t, lens, 1 / math.sqrt(d), num_splits=splits, out=poisoned(q))
    assert_close(out, ref)


def test_decode_half_and_dispatch(rng, monkeypatch):
    q, kp, vp, r2t, lens = _decode_inputs([3, 50], 8, 2, 128, torch.float16)
    ref = decode_attention_ref(q, kp, vp, r2t, lens)
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    assert_close(decode_attention(q, kp, vp, r2t, lens), ref, torch.float16)


def _denoise_inputs(q_lens, k_lens, hq, hkv, d, dtype):
    cq = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
    ck = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0).int()
    return (torch.randn(int(cq[-1]), hq, d).to(dtype), torch.randn(int(ck[-1]), hkv, d).to(dtype),
            torch.randn(int(ck[-1]), hkv, d).to(dtype), cq, ck)


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 16), (8, 1, 128)])
def test_denoise_matches_reference(rng, hq, hkv, d):
    # two requests: prefix 9 + 16 image tokens, prefix 30 + 25 image tokens (ragged tiles)
    q, k, v, cq, ck = _denoise_inputs([16, 25], [25, 55], hq, hkv, d, torch.float32)
    ref = denoise_attention_ref(q, k, v, cq, ck, scale=0.2)
    out = denoise_attention_triton(q, k, v, cq, ck, scale=0.2, out=poisoned(q))
    assert_close(out, ref)


def test_denoise_half_forced_triton(rng, monkeypatch):
    q, k, v, cq, ck = _denoise_inputs([1, 33], [10, 40], 8, 2, 16, torch.float16)
    ref = denoise_attention_ref(q, k, v, cq, ck)
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    assert_close(denoise_attention(q, k, v, cq, ck), ref, torch.float16)


@pytest.mark.parametrize("sms", [1, 7, 112, 132])
def test_decode_default_splits_any_sm_count(rng, monkeypatch, sms):
    """The one kernel whose launch reads the SM count (decode attention's split count, 2 programs per SM): under MPS
    a process sees only its share of the SMs (112 of an H100's 132 at 85 %), so the split count it picks must give
    the reference's result at any count, including one far below the work (1) and one above it (132). Each split
    is an independent slice merged by its log-sum-exp: no persistent loop, no partial sum left to another program."""
    import importlib
    da = importlib.import_module("kernels.decode_attention")    # the package exports a function of that name
    monkeypatch.setattr(da, "num_sms", lambda device: sms)
    q, kp, vp, r2t, lens = _decode_inputs([1, 37, 70, 5], 8, 2, 16, torch.float32)
    splits = da.default_num_splits(4, 2, r2t.shape[1], q.device, 16)
    assert splits == max(1, min(-(-2 * sms // 8), -(-r2t.shape[1] // 16), 64))
    ref = decode_attention_ref(q, kp, vp, r2t, lens, 0.25)
    out = decode_attention_triton(q, kp, vp, r2t, lens, 0.25, out=poisoned(q))
    assert_close(out, ref)
