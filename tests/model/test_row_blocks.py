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
