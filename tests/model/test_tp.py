"""Tensor parallelism in the model core: 2 gloo ranks give the TP=1 prefix KV and velocities."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.contract.image import SamplerParams
from services.model import reference as R
from services.model.loader import load_model
from services.model.parallel import TPContext
from services.model.tokenizer import NeoTokenizer


def _run(rank, world, ckpt, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tp = TPContext(rank, world)
        model = load_model(ckpt, "both", tp=tp)
        tok = NeoTokenizer.from_dir(ckpt)
        p = SamplerParams(num_inference_steps=2)
        pre = R.image_prefixes(model, tok, "t2i", "a red cube", [], p)
        kv = {b: tp.all_gather_heads(x.kv, dim=3) for b, x in pre.items()}  # heads of every rank
        img = R.denoise(model, pre, 64, 64, p, seed=0)
        if rank == 0:
            torch.save({"kv": kv, "img": img}, os.path.join(out_dir, "tp.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    for variant in ("u1", "a3b"):
        ckpt = tiny_checkpoint(variant)
        mp.spawn(_run, args=(2, ckpt, str(tmp_path / f"init-{variant}"), str(tmp_path)), nprocs=2, join=True)
        got = torch.load(tmp_path / "tp.pt", weights_only=True)
        model = load_model(ckpt, "both")
        tok = NeoTokenizer.from_dir(ckpt)
        p = SamplerParams(num_inference_steps=2)
        pre = R.image_prefixes(model, tok, "t2i", "a red cube", [], p)
        for b in pre:
            torch.testing.assert_close(got["kv"][b], pre[b].kv, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["img"], R.denoise(model, pre, 64, 64, p, seed=0), rtol=1e-4, atol=1e-4)
