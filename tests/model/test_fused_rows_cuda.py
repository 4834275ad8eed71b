"""The fused q|k|v and gate|up GEMMs on CUDA (services/model/fused_rows.py) give the separate layers' outputs within
bf16 tolerance: at the 8B decode shapes (the skinny kernels on the fused weights, 1-16 rows, eager and in a CUDA
graph; silu*mul inside the down GEMM bit for bit) and through a whole tiny model loaded fused vs U1SERVE_FUSED_PROJ=0. Skipped without CUDA (the CPU checks of
the layout: test_fused_rows.py).

    python -m pytest -q tests/model/test_fused_rows_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from kernels import gated_linear
from kernels.norm_act import silu_mul, silu_mul_ref
from services.model.fused_rows import FusedRows, fused_bytes
from services.model.loader import load_model
from services.model.modules import Linear, SwiGLU

from tests.model.stack_forward import stack_forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def _close(got, want, tol=1e-2):
    scale = want.float().abs().max().item() + 1e-6
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


def _linears(shapes, seed=0):
    torch.manual_seed(seed)
    out = []
    for n, k in shapes:
        lin = Linear(k, n).cuda().bfloat16().requires_grad_(False)
        torch.nn.init.normal_(lin.weight, std=0.02)
        out.append(lin)
    return out


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("shapes", [[(4096, 4096), (1024, 4096), (1024, 4096)],      # 8B q|k|v
                                    [(12288, 4096), (12288, 4096)],                  # 8B gate|up
                                    [(4096, 2048), (512, 2048), (512, 2048)]])       # A3B q|k|v
def test_fused_gemm_matches_the_separate_layers(rows, shapes):
    lins = _linears(shapes)
    want_x = torch.randn(rows, shapes[0][1], device="cuda").bfloat16()
    before = [lin.weight.clone() for lin in lins]
    with torch.no_grad():
        want = [lin(want_x) for lin in lins]
        fused = FusedRows(lins)
        got = fused(want_x)
        again = [lin(want_x) for lin in lins]               # the layers, now views of the fused weight
    assert got is not None
    for g, w, a, lin, b in zip(got, want, again, lins, before):
        _close(g, w)
        _close(a, w, 1e-3)
        assert torch.equal(lin.weight, b)                   # the views hold the same bits as before


def test_fused_gemm_in_a_cuda_graph():
    lins = _linears([(4096, 4096), (1024, 4096), (1024, 4096)])
    fused = FusedRows(lins)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    with torch.no_grad():
        fused(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q, k, v = fused(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        for got, lin in zip((q, k, v), lins):
            _close(got, lin(x))


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_swiglu_fused_and_strided_silu(rows):
    torch.manual_seed(rows)
    mlp = SwiGLU(4096, 12288).cuda().bfloat16().requires_grad_(False)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(rows, 4096, device="cuda").bfloat16()
    with torch.no_grad():
        want = mlp(x)
        assert mlp.fuse_rows() == 1
        fused = mlp(x)
        _close(fused, want)
        mlp.gated_down = True                      # silu*mul inside the down GEMM (one row): the same bits
        assert torch.equal(mlp(x), fused)
        if rows == 1:
            assert gated_linear(mlp.fused["gate_up"].output(x), mlp.down_proj.weight) is not None
        gu = torch.randn(rows, 2 * 12288, device="cuda").bfloat16()
        g, u = gu.split(12288, dim=1)
        assert torch.equal(silu_mul(g, u), silu_mul(g.contiguous(), u.contiguous()))
        _close(silu_mul(g, u), silu_mul_ref(g, u))


@pytest.mark.parametrize("branch", ["und", "gen"])
def test_tiny_model_fused_vs_separate(tiny_dir, branch, monkeypatch):
    monkeypatch.setenv("U1SERVE_FUSED_PROJ", "0")
    plain = load_model(tiny_dir, "both", dtype=torch.bfloat16, device="cuda", lora=[])
    monkeypatch.delenv("U1SERVE_FUSED_PROJ")
    fused = load_model(tiny_dir, "both", dtype=torch.bfloat16, device="cuda", lora=[])
    assert fused_bytes(plain) == 0 and fused_bytes(fused) > 0
    for rows in (1, 7, 16):
        _close(stack_forward(fused, branch, rows).float(), stack_forward(plain, branch, rows).float(), 3e-2)
