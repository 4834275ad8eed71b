"""The skinny GEMM kernels (kernels/skinny_gemm.py): decode-shaped x [M <= 16, K] @ W^T equals torch's linear in fp32
accumulation, on the GPU at the 8B / A3B decode shapes (the interpreted CPU check: tests/kernels/interpreted/check_skinny_gemm.py).

    python -m pytest -q tests/kernels/test_skinny_gemm.py        # the CUDA cases on a GPU machine
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.skinny_gemm import skinny_config, skinny_linear

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def _close(got, x, w, tol):
    want = F.linear(x.float(), w.float())
    scale = want.abs().max().item() + 1e-6
    assert (got.float() - want).abs().max().item() <= tol * scale


@cuda
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096),
                                 (512, 2048), (2048, 4096), (128, 2048)])
def test_skinny_linear_matches_torch_on_gpu(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    _close(skinny_linear(x, w), x, w, 1e-2)


@cuda
def test_skinny_linear_runs_in_a_cuda_graph():
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    skinny_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _close(y, x, w, 1e-2)


def test_config_keeps_cublas_where_it_is_as_fast():
    assert skinny_config(8, 1024, 4096) is None           # several rows, narrow weight: cuBLAS
    assert skinny_config(1, 1024, 4096)[0] == "gemv"
    assert skinny_config(4, 12288, 4096)[0] == "dot"
    x = torch.randn(1, 64)
    assert torch.equal(skinny_linear(x, torch.ones(8, 64)), F.linear(x, torch.ones(8, 64)))   # CPU: torch
