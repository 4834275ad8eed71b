"""row_blocks.per_sequence: packed rows get the bits each sequence's rows get alone (CPU GEMMs round a row by the
block's row count below ~12 rows), whatever else the pack holds; other ops and other row counts pass through."""
import torch
import torch.nn.functional as F

from services.base import knobs
from services.model import row_blocks

CPU = torch.device("cpu")


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1 + 6 + 5, 64, generator=g), torch.randn(96, 64, generator=g)


def test_packed_rows_equal_each_sequence_alone():
    x, w = _rows()
    sizes = [1, 6, 5]
    alone = torch.cat([F.linear(part, w) for part in x.split(sizes)])
    with row_blocks.per_sequence(sizes, CPU):
        packed = torch.nn.Linear(64, 96, bias=False).requires_grad_(False)
        packed.weight.copy_(w)
        got = packed(x)
        other = F.linear(x[:4], w)          # another row count: one GEMM, as without the context
    assert torch.equal(got, alone)
    assert torch.equal(other, F.linear(x[:4], w))


def test_one_block_or_off_is_plain(monkeypatch):
    x, w = _rows(1)
    plain = F.linear(x, w)
    with row_blocks.per_sequence([12], CPU):
        assert torch.equal(F.linear(x, w), plain)
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "0")
    assert not row_blocks.enabled(CPU)
    with row_blocks.per_sequence([1, 6, 5], CPU):
        assert torch.equal(F.linear(x, w), plain)
    monkeypatch.setenv(knobs.EXACT_ROWS.name, "1")
    assert row_blocks.enabled(torch.device("cuda"))


def test_the_a3b_experts_follow_the_blocks_and_each_thread_has_its_own():
    """The experts' GEMMs are not linear layers (one batched GEMM per expert over the rows routed to it): the sparse
    block runs per block too, and a block in force in one thread (the fused process's other engine) is not another's."""
    import threading

    from services.model.moe import SparseMoE
    torch.manual_seed(0)
    moe = SparseMoE(hidden=64, inter=32, num_experts=4, top_k=2, norm_topk_prob=True).requires_grad_(False)
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(3 + 5 + 2, 64)
    sizes = [3, 5, 2]
    alone = torch.cat([moe(part) for part in x.split(sizes)])
    with row_blocks.per_sequence(sizes, CPU):
        assert torch.equal(moe(x), alone)
        seen = []
        t = threading.Thread(target=lambda: seen.append(row_blocks.active_blocks(len(x))))
        t.start()
        t.join()
    assert seen == [None] and row_blocks.active_blocks(len(x)) is None
