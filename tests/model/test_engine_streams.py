"""services/model/streams.py: the engine loop's stream. Off CUDA every choice is a no-op (the CPU suite runs the
fused mode through it); on CUDA a green context's stream runs kernels on the tensors of the primary context."""
import pytest
import torch

from services.model.streams import SM_GRANULE, engine_stream, green_sm_count


@pytest.mark.parametrize("priority, pct", [("default", 0), ("high", 0), ("low", 0), ("low", 75)])
def test_off_cuda_nothing_changes(priority, pct):
    before = torch.ones(3)
    with engine_stream("cpu", priority, pct):
        assert torch.equal(before * 2, torch.full((3,), 2.0))


def test_an_unknown_priority_is_refused():
    with pytest.raises(ValueError, match="stream priority"):
        engine_stream("cpu", "urgent")


@pytest.mark.parametrize("total, pct, want", [(132, 75, 96), (132, 100 - 1, 128), (132, 1, SM_GRANULE),
                                              (114, 50, 56), (16, 60, 8)])
def test_green_sm_count_is_a_granule_multiple_below_the_share(total, pct, want):
    got = green_sm_count(total, pct)
    assert got == want and got % SM_GRANULE == 0 and got <= max(SM_GRANULE, total * pct / 100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_green_stream_computes_on_primary_context_tensors():
    x = torch.randn(256, 256, device="cuda")
    want = x @ x
    with engine_stream("cuda", "low", 50):
        got = x @ x
        torch.cuda.current_stream().synchronize()
    assert torch.allclose(got, want)
