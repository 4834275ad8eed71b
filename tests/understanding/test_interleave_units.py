"""Pieces of interleaved answers and previews that need no server: the prompts of the growing branches, the
float-image round trip through pool-shaped tensors, the bf16 re-encoding input, the reasoning split across
segments, the preview steps, the k-th noise draw."""
from __future__ import annotations

import pytest
import torch

from services.model import prompts as PR
from services.model.images import IMAGENET_MEAN, IMAGENET_STD, generated_image_tensor, patchify16


def test_heads_follow_the_spec(ref):
    _, tok = ref
    msgs = [{"role": "user", "content": "draw"}]
    cond, tu = PR.interleave_heads(tok, msgs, think=False, system_message="SYS")
    assert tok.decode(cond.input_ids) == ("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\ndraw<|im_end|>\n"
                                          "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(tu.input_ids) == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    think_cond, _ = PR.interleave_heads(tok, msgs, think=True, system_message="SYS")
    assert tok.decode(think_cond.input_ids).endswith("<|im_start|>assistant\n")
    # a system message of the conversation wins over the default one
    own, _ = PR.interleave_heads(tok, [{"role": "system", "content": "MINE"}, *msgs], False, "SYS")
    assert "MINE" in tok.decode(own.input_ids) and "SYS" not in tok.decode(own.input_ids)
    assert "Think Mode" in PR.interleave_system_message()


def test_generated_images_extend_only_the_image_branch_without_text(ref):
    _, tok = ref
    cond, tu = PR.interleave_heads(tok, [{"role": "user", "content": "x"}], False, "")
    image = generated_image_tensor(torch.zeros(3, 64, 32))
    items = [[1, 2, 3], image, [4]]
    full = PR.extend_prompt(tok, cond, items)
    images_only = PR.extend_prompt(tok, tu, items, with_text=False)
    span = [tok.img_start_id] + [tok.img_context_id] * 2 + [tok.img_end_id]
    assert full.input_ids == cond.input_ids + [1, 2, 3] + span + [4] and full.images == [image]
    assert images_only.input_ids == tu.input_ids + span


def test_generated_image_tensor_is_bf16_rounded():
    torch.manual_seed(0)
    x = torch.randn(3, 64, 96) * 1.7            # unclamped, as the final Euler state
    it = generated_image_tensor(x)
    bf = torch.bfloat16
    y = x.to(bf) * 0.5 + 0.5
    y = (y - torch.tensor(IMAGENET_MEAN, dtype=bf).view(3, 1, 1)) / torch.tensor(IMAGENET_STD, dtype=bf).view(3, 1, 1)
    assert it.grid_hw == (4, 6) and it.pixel_values.dtype == torch.float32
    assert torch.equal(it.pixel_values, patchify16(y).float())
    assert torch.equal(it.pixel_values, it.pixel_values.to(bf).float())     # exactly bf16 values
    with pytest.raises(ValueError):
        generated_image_tensor(torch.zeros(3, 48, 64))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensors_round_trip_through_a_handle_shape(dtype):
    from shm_transfer import KVLayout
    from shm_transfer.tensors import pack, tokens_for, unpack
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, page_tokens=16)
    x = torch.randn(3, 64, 96).to(lay.torch_dtype)
    kv = pack(x, lay)
    assert kv.shape == lay.kv_shape(tokens_for(lay, x.numel())) and kv.is_contiguous()
    assert torch.equal(unpack(kv, (3, 64, 96)), x)
    with pytest.raises(ValueError):
        unpack(kv, (3, 640, 960))


def test_reasoning_state_across_segments(ref):
    from services.understanding.interleave import reasoning_state
    _, tok = ref
    assert reasoning_state(tok, False, []) is False                       # non-think: never split
    assert reasoning_state(tok, True, []) is None                         # the answer starts: the model decides
    assert reasoning_state(tok, True, [[tok.think_id, 5, 6]]) is True      # inside the think block
    assert reasoning_state(tok, True, [[tok.think_id, 5], [tok.end_think_id, 7]]) is False
    assert reasoning_state(tok, True, [[], [tok.think_id]]) is False      # an image came first: no block opened


def test_preview_steps_are_evenly_spaced():
    from services.generation.previews import preview_format, preview_steps
    assert preview_steps(50, 3) == [11, 24, 36]
    assert preview_steps(8, 1) == [3]
    assert preview_steps(4, 3) == [0, 1, 2]
    assert preview_steps(2, 3) == [0]            # too few steps: fewer previews, never the final step
    assert preview_steps(1, 2) == [] and preview_steps(50, 0) == []
    assert preview_format("png") == "jpeg" and preview_format("webp") == "webp"


def test_noise_draw_is_the_kth_draw_of_one_generator():
    """Image k's noise follows the draws of images 0..k-1, each at its own size (an answer's size list)."""
    from services.model.sampler import initial_noise
    sizes = [(64, 32), (32, 32), (96, 64)]          # (W, H)
    g = torch.Generator().manual_seed(7)
    draws = [torch.randn((1, 3, h, w), generator=g) for w, h in sizes]
    for k, (w, h) in enumerate(sizes):
        torch.testing.assert_close(initial_noise(1, h, w, 7, "cpu", torch.float32, 2.0, draws=sizes[:k]),
                                   2.0 * draws[k], rtol=0, atol=0)
