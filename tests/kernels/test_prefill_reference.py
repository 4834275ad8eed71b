"""Prefill attention reference vs a dense-mask float64 SDPA, and the dispatch on CPU (no Triton)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.prefill_attention import prefill_attention, prefill_attention_ref

from tests.kernels.kernel_testutil import PREFILL_CASES, Seq, build_prefill, rel_err

CASES = {**PREFILL_CASES, "text_only": [Seq(0, 37), Seq(11, 20), Seq(0, 1)]}


def _dense_mask_sdpa(inp, scale):
    """float64 SDPA over each whole sequence with a mask built straight from the rule."""
    q, kp, vp = inp["q"].double(), inp["k_pool"].double(), inp["v_pool"].double()
    G = q.shape[1] // kp.shape[1]
    out = torch.empty_like(q)
    cu = inp["cu_seqlens_q"].tolist()
    for b in range(len(cu) - 1):
        start, L = int(inp["b_start"][b]), int(inp["b_seq_len"][b])
        n = cu[b + 1] - cu[b]
        ends = inp["image_end"][cu[b]:cu[b + 1]].tolist() if inp["image_end"] is not None else [0] * n
        mask = torch.zeros(n, L, dtype=torch.bool)
        for i in range(n):
            p = start + i
            for j in range(L):
                mask[i, j] = j <= p or (ends[i] > 0 and j < ends[i])
        slots = inp["req_to_token"][b, :L].long()
        k = kp[slots].repeat_interleave(G, 1).transpose(0, 1)
        v = vp[slots].repeat_interleave(G, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[cu[b]:cu[b + 1]].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[cu[b]:cu[b + 1]] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_dense_mask_float64(rng, name):
    inp = build_prefill(CASES[name], 8, 2, 16, torch.float64, with_images=name != "text_only")
    ref = prefill_attention_ref(**inp, scale=0.25)
    dense = _dense_mask_sdpa(inp, 0.25)
    assert rel_err(ref, dense) < 1e-5  # the reference computes in fp32


def test_dispatch_modes_on_cpu(rng, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inp = build_prefill(CASES["several_images"], 8, 2, 16, torch.float32)
    ref = prefill_attention_ref(**inp, scale=0.25)
    monkeypatch.delenv("U1SERVE_KERNELS", raising=False)
    assert torch.equal(prefill_attention(**inp, scale=0.25), ref)  # auto on CPU = reference
    monkeypatch.setenv("U1SERVE_KERNELS", "ref")
    assert torch.equal(prefill_attention(**inp, scale=0.25), ref)
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        prefill_attention(**inp, scale=0.25)
    monkeypatch.setenv("U1SERVE_KERNELS", "bogus")
    with pytest.raises(ValueError, match="U1SERVE_KERNELS"):
        prefill_attention(**inp, scale=0.25)


def test_rejects_bad_shapes():
    inp = build_prefill([Seq(0, 4)], 6, 4, 16, torch.float32)  # 6 % 4 != 0
    with pytest.raises(ValueError):
        prefill_attention_ref(**inp, scale=0.25)


def test_text_only_sdpa_path_and_its_conditions(rng):
    """The text-only SDPA path (contiguous slots, no cached prefix) matches the reference; it declines
    (returns None) when a sequence has a cached prefix or scattered slots."""
    from kernels.prefill_attention import prefill_attention_text_sdpa
    inp = build_prefill([Seq(0, 37), Seq(0, 20), Seq(0, 1)], 8, 2, 16, torch.float32, with_images=False,
                        contiguous=True)
    for k in ("q", "k_pool", "v_pool"):
        inp[k] = inp[k].to(torch.bfloat16)
    args = {k: v for k, v in inp.items() if k != "image_end"}
    ref = prefill_attention_ref(**inp, scale=0.25)
    out = prefill_attention_text_sdpa(**args, scale=0.25)
    assert rel_err(out, ref) < 1e-2
    assert prefill_attention_text_sdpa(**{**args, "b_start": torch.tensor([0, 1, 0], dtype=torch.int32)},
                                       scale=0.25) is None
    r2t = args["req_to_token"].clone()
    r2t[1, :2] = r2t[1, :2].flip(0)
    assert prefill_attention_text_sdpa(**{**args, "req_to_token": r2t}, scale=0.25) is None
