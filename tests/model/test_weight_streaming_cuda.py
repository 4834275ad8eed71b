"""Weight streaming on CUDA (services/model/weight_streaming.py): pinned host copies, the side-stream prefetch and its
events give the resident forward bit for bit, forward after forward (a missing wait would read a half-copied slot);
after the first layer every load is a prefetch; the device gives back all but K layers. Skipped without CUDA (the
CPU runs the same code with synchronous copies: test_weight_streaming.py).

    python -m pytest -q tests/model/test_weight_streaming_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from services.model.loader import load_model
from services.model.weight_streaming import stream_decoder_layers

from tests.model.stack_forward import stack_forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    from services.model.tiny import write_tiny_checkpoint
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-deep")), "u1", seed=0, num_hidden_layers=6,
                                 hidden_size=256, intermediate_size=1024)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_streamed_forwards_on_cuda_are_the_resident_ones(deep_dir, quantization):
    dev = torch.device("cuda")
    load = lambda **kw: load_model(deep_dir, branch="gen", dtype=torch.bfloat16, device=dev,  # noqa: E731
                                   quantization=quantization, **kw)
    resident = load()
    want = [stack_forward(resident, "gen", rows=64, seed=s) for s in range(3)]
    layer = sum(t.numel() * t.element_size() for t in resident.language_model.model.layers[0].state_dict().values())
    full = torch.cuda.memory_allocated(dev)
    del resident
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    model = load(layers_to_host=True)
    streamer = stream_decoder_layers(model, 2)
    assert all(t.is_pinned() for host in streamer.host for t in host)
    slack = 1 << 20     # the allocator's rounding
    assert torch.cuda.memory_allocated(dev) - base <= full - base - (model.num_layers - 2) * layer + slack
    for _ in range(3):
        got = [stack_forward(model, "gen", rows=64, seed=s) for s in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    loads = streamer.report()["loads"]
    # 9 forwards: only the very first layer waits for a copy; each layer's hook prefetches the next (the last layer's
    # the next forward's layer 0)
    assert loads["on_demand"] == 1 and loads["prefetched"] == 9 * model.num_layers, loads
