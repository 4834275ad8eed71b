"""Weight streaming (services/model/weight_streaming.py) on the CPU, where the same code copies into the slot tensors:
the streamed gen stack equals the resident one bit for bit (fp32 and int8 W8A8 layers, 1 to 3 slots), through
forwards that stop early and restart at layer 0 or call layers out of order; at rest the layers hold their host copies
(so a weight update's in-place copy reaches them) and the slots are refilled after `invalidate`."""
from __future__ import annotations

import pytest
import torch

from services.model import reference as R
from services.model.loader import load_model
from services.model.weight_streaming import WeightStreamer, stream_decoder_layers

from tests.model.stack_forward import stack_forward


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """The tiny u1 geometry with 5 decoder layers: more layers than slots, so slots are reused within a forward."""
    from services.model.tiny import write_tiny_checkpoint
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-deep")), "u1", seed=0, num_hidden_layers=5)


def _gen(path, quantization="none", layers_to_host=False):
    return load_model(path, branch="gen", dtype=torch.float32, quantization=quantization,
                      layers_to_host=layers_to_host)


def _partial(model, start, stop, rows=5, seed=1):
    """Layers [start, stop) on random rows (a forward that stops early, or starts late)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, model.cfg.llm.hidden_size, generator=g)
    t = torch.arange(rows)
    rope = model.rope(torch.stack([t, t % 3, t % 2]))
    causal = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    attend = lambda i, q, k, v: R.masked_attention(q, k, v, causal, model.head_dim ** -0.5)  # noqa: E731
    with torch.no_grad():
        return model.gen_layers(x, rope, attend, start=start, stop=stop)


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_streamed_stack_is_the_resident_one(deep_dir, quantization, slots):
    model = _gen(deep_dir, quantization)
    want = [stack_forward(model, "gen", seed=s) for s in (0, 1)]
    n = model.num_layers
    want_parts = [_partial(model, 0, 1), _partial(model, 1, n), _partial(model, 2, 3)]
    # the streaming load (each layer handed to the host as it completes) gives the resident load's bits
    model = _gen(deep_dir, quantization, layers_to_host=True)
    streamer = stream_decoder_layers(model, slots)
    for _ in range(2):      # the second round starts from whatever the first left in the slots
        assert [torch.equal(a, b) for a, b in zip(want, [stack_forward(model, "gen", seed=s) for s in (0, 1)])] \
            == [True, True]
        # the step cache's shape: layer 0 alone (every branch reused), then the rest, then layer 2 out of order
        got = [_partial(model, 0, 1), _partial(model, 1, n), _partial(model, 2, 3)]
        assert all(torch.equal(a, b) for a, b in zip(want_parts, got))
    rep = streamer.report()
    assert rep["device_slots"] == min(slots, n) and rep["layers"] == n
    assert rep["loads"]["on_demand"] > 0 and (slots == 1 or rep["loads"]["prefetched"] > 0)
    if quantization == "int8":      # the host holds the served format: int8 weights and their scales
        dtypes = {t.dtype for t in streamer.host[0]}
        assert torch.int8 in dtypes and torch.float32 in dtypes


def test_layers_hold_their_host_copies_at_rest(deep_dir):
    model = _gen(deep_dir)
    streamer = stream_decoder_layers(model, 2)
    stack_forward(model, "gen")
    slot_ptrs = {t.data_ptr() for slot in streamer.slots for t in slot}
    layer = model.language_model.model.layers[1]
    assert all(p.data_ptr() not in slot_ptrs for p in layer.parameters())
    assert [p.data_ptr() for p in layer.parameters()] == [t.data_ptr() for t in streamer.host[1]][:len(
        list(layer.parameters()))]
    # an update copies into the host copies in place (weights_io's commit); after invalidate the slots carry it
    before = stack_forward(model, "gen")
    with torch.no_grad():
        for p in model.language_model.model.layers[0].parameters():
            p.mul_(0.5)
    streamer.invalidate()
    after = stack_forward(model, "gen")
    assert not torch.equal(before, after)
    streamer.detach()
    assert torch.equal(stack_forward(model, "gen"), after)      # resident again, same weights


def test_a_forward_that_raised_mid_layer_releases_its_slot(deep_dir):
    model = _gen(deep_dir)
    want = stack_forward(model, "gen")
    stream_decoder_layers(model, 2)
    with pytest.raises(RuntimeError, match="boom"):
        def attend(i, q, k, v):
            raise RuntimeError("boom")
        x = torch.zeros(2, model.cfg.llm.hidden_size)
        model.gen_layers(x, model.rope(torch.zeros(3, 2, dtype=torch.long)), attend)
    assert torch.equal(stack_forward(model, "gen"), want)


def test_layers_of_different_layouts_are_refused():
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)]
    with pytest.raises(ValueError, match="layer 1 differs from layer 0"):
        WeightStreamer(layers, 2, "cpu")
    with pytest.raises(ValueError, match="at least 1"):
        WeightStreamer(layers[:1], 0, "cpu")


@pytest.mark.parametrize("random_weights,quantization", [(False, "int8"), (True, "none"), (True, "int8")])
def test_the_streaming_load_hands_each_layer_over_before_the_next_completes(deep_dir, monkeypatch, random_weights,
                                                                           quantization):
    """load_model(layers_to_host=True): when a layer is handed to the host, no other layer is complete and still
    unhanded (the device holds at most one decoder layer during the load), and every layer is handed once; from a
    checkpoint and with random weights (the GPU benchmarks' load: built whole on the device, a streamed 24 GiB
    plan ran out of memory at load)."""
    import services.model.weight_streaming as ws
    handed, real = [], ws.layer_to_host

    def spy(layer, pin):
        layers = list(layer_list[0])
        for j, other in enumerate(layers):
            if other is not layer and j not in handed:
                assert any(p.is_meta for p in other.parameters()), f"layer {j} complete and still on the device"
        handed.append(layers.index(layer))
        return real(layer, pin)

    layer_list = []
    from services.model import layerwise_load
    init = layerwise_load.LayerwiseQuantizer.__init__

    def remember(self, model, *a, **kw):
        layer_list.append(model.language_model.model.layers)
        init(self, model, *a, **kw)
    monkeypatch.setattr(layerwise_load.LayerwiseQuantizer, "__init__", remember)
    monkeypatch.setattr(ws, "layer_to_host", spy)
    model = load_model(deep_dir, branch="gen", dtype=torch.float32, quantization=quantization, layers_to_host=True,
                       random_weights=random_weights)
    assert sorted(handed) == list(range(model.num_layers))
