import math

import pytest
import torch

from kernels.prefill_attention import prefill_attention, prefill_attention_ref, prefill_attention_triton

from tests.kernels.kernel_testutil import PREFILL_CASES, Seq, assert_close, build_prefill, poisoned

CASES = {**PREFILL_CASES, "mixed_batch": [Seq(0, 17, ((1, 16),)), Seq(3, 33), Seq(0, 5, ((0, 5),))]}


def _run_both(case, hq, hkv, d, dtype, with_images=True):
    inp = build_prefill(case, hq, hkv, d, dtype, with_images)
    scale = 1.0 / math.sqrt(d)
    ref = prefill_attention_ref(**inp, scale=scale)
    out = prefill_attention_triton(**inp, scale=scale, out=poisoned(inp["q"]))
    return out, ref


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 16), (8, 1, 128)])
def test_triton_matches_reference(rng, name, hq, hkv, d):
    out, ref = _run_both(CASES[name], hq, hkv, d, torch.float32)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_text_only_batch(rng, dtype):
    case = [Seq(0, 37), Seq(11, 20), Seq(0, 1)]
    out, ref = _run_both(case, 8, 2, 16, dtype, with_images=False)
    assert_close(out, ref, dtype)


def test_half_precision_with_images(rng):
    out, ref = _run_both(CASES["several_images"] + CASES["prefix_cache_offsets"], 8, 2, 128, torch.float16)
    assert_close(out, ref, torch.float16)


def test_image_rows_that_are_text_only_equal_causal(rng):
    """A zero image_end tensor must give exactly the causal result."""
    inp = build_prefill([Seq(4, 30), Seq(0, 9)], 4, 1, 16, torch.float32)
    a = prefill_attention_triton(**{**inp, "image_end": torch.zeros_like(inp["image_end"])}, scale=0.3)
    b = prefill_attention_triton(**{**inp, "image_end": None}, scale=0.3)
    assert torch.equal(a, b)


def test_dispatch_forced_triton(rng, monkeypatch):
    inp = build_prefill(CASES["several_images"], 8, 2, 16, torch.float32)
    ref = prefill_attention_ref(**inp, scale=0.25)
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    assert_close(prefill_attention(**inp, scale=0.25), ref)


@pytest.mark.parametrize("mode", [0, 1])
def test_kv_modes_gather_and_block_loads(rng, mode):
    """kv_mode 0 gathers every key row; 1 block-loads sequences whose slots are one run (NaN pool
    rows outside the sequences must not leak in through the masked tail)."""
    case = CASES["prefix_cache_offsets"] + CASES["image_crosses_block"]
    inp = build_prefill(case, 8, 2, 16, torch.float32, contiguous=None)
    unused = torch.ones(inp["k_pool"].shape[0], dtype=torch.bool)
    for b, L in enumerate(inp["b_seq_len"].tolist()):
        unused[inp["req_to_token"][b, :L].long()] = False
    inp["k_pool"][unused] = float("nan")
    inp["v_pool"][unused] = float("nan")
    ref = prefill_attention_ref(**inp, scale=0.25)
    out = prefill_attention_triton(**inp, scale=0.25, out=poisoned(inp["q"]), config=(16, 16, 4, 1, mode, False))
    assert_close(out, ref)


def test_kv_base_flags_contiguous_sequences(rng):
    from kernels.prefill_attention import _kv_base_torch, kv_base
    inp = build_prefill([Seq(0, 70), Seq(3, 5), Seq(0, 1), Seq(0, 33)], 2, 1, 16, torch.float32, contiguous=None)
    r2t = inp["req_to_token"]
    r2t[2, 1:] = -5  # past seq_len: ignored
    got = kv_base(r2t, inp["b_seq_len"])
    assert torch.equal(got, _kv_base_torch(r2t, inp["b_seq_len"]))
    assert got[0] == r2t[0, 0] and got[2] == r2t[2, 0] and got[1] == -1 and got[3] == -1
