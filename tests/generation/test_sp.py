"""Sequence parallelism at engine level, both modes (Ulysses, kv-gather): real gloo ranks (spawned
processes) run the engine.

- SP2 == SP1 within fp32 tolerance: U1 (MLP head) and U1.5 (pixel head), several jobs of different
  sizes in one forward, token counts that 2 does not divide, n = 2, a 32x32 image (one rank holds no
  rows), step caching (every rank decides the same, with the same counts as SP1);
- CFG2 x SP2 (4 ranks) == the sequential reference, T2I and 3-branch editing;
- kv-gather SP3 on a model with 2 KV heads (which Ulysses cannot split 3 ways) == SP1;
- every rank ends with the same state (no broadcast needed);
- the row bookkeeping (split, rank-major -> canonical) on its own.
"""
from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
import torch

from services.contract.image import SamplerParams
from services.generation.config import SP_MODES as MODES
from services.generation.sequence_parallel import RowLayout, split
from services.base.netutil import free_port

from .genhelp import photo, prefixes

TOL = dict(rtol=1e-4, atol=1e-4)   # fp32: SP changes GEMM row counts and the attention's memory layout


# -- the ranks -----------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, sp: int, mode: str, port: int, model_dir: str, batches, q,
               graphs_on_rank: int | None = None) -> None:
    from services.generation import engine as engine_mod
    from services.generation.cfg_parallel import CfgComm
    from services.generation.engine import Engine
    from services.generation.inputs import parse_job
    from services.model.loader import load_model
    torch.set_num_threads(1)
    try:
        comm = CfgComm.init(rank, world, port, torch.device("cpu"), sp=sp, sp_mode=mode)
        engine = Engine(load_model(model_dir, "gen"), None, comm)
        if rank == graphs_on_rank:     # what `--cuda-graphs on` means on CUDA; on a CPU every capture fails
            engine_mod.graphable = lambda *a: True
            engine.graphs.enabled = True
        out = {}
        for batch in batches:          # the jobs of a batch run together (packed forwards)
            jobs = []
            for body, kvs, t_offsets in batch:
                job = engine.admit_local(parse_job(body), kvs, t_offsets)
                engine.add(job)
                jobs.append(job)
            while engine.running:
                engine.step()
            # numpy: pickled by value (a tensor would be shared through this process, which exits)
            out.update({j.request_id: (j.x.numpy().copy(), j.branch_steps) for j in jobs})
        if rank == graphs_on_rank:
            g = engine.graphs
            out[GRAPHS] = (g.enabled, g.failure is not None, g.captures, g.replays)
        q.put((rank, out))
        comm.close()
    except BaseException as e:  # surface the failure instead of a silent hang
        q.put((rank, repr(e)))
        raise


GRAPHS = "graphs"    # the forced rank's (enabled, failed, captures, replays), in its results


def run_ranks(model_dir: str, batches, world: int, sp: int, timeout: float = 240.0,
              mode: str = "ulysses", graphs_on_rank: int | None = None) -> dict:
    """Every rank's {request_id: (x, branch_steps)} (and GRAPHS: the state of graphs_on_rank's graphs)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, sp, mode, port, model_dir, batches, q, graphs_on_rank),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, out = q.get(timeout=timeout)
            assert not isinstance(out, str), f"rank {rank} failed: {out}"
            results[rank] = {rid: v if rid == GRAPHS else (torch.from_numpy(v[0]), v[1]) for rid, v in out.items()}
    except queue.Empty:
        raise AssertionError(f"ranks did not finish in {timeout} s (got {sorted(results)})") from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def run_local(model_dir: str, batches) -> dict:
    """The same batches on one rank in this process (SP1, CFG1)."""
    from services.generation.engine import Engine
    from services.generation.inputs import parse_job
    from services.model.loader import load_model
    engine = Engine(load_model(model_dir, "gen"), None)
    out = {}
    for batch in batches:
        jobs = [engine.admit_local(parse_job(b), kvs, t) for b, kvs, t in batch]
        for j in jobs:
            engine.add(j)
        while engine.running:
            engine.step()
        out.update({j.request_id: (j.x.clone(), j.branch_steps) for j in jobs})
    return out


def job(rid: str, pre: dict, **kw):
    body = {"request_id": rid, "handles": {b: {} for b in pre}, "width": 128, "height": 128,
            "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 5}
    body.update(kw)
    return body, {b: p.kv for b, p in pre.items()}, {b: p.t_offset for b, p in pre.items()}


def assert_ranks_agree(results: dict) -> dict:
    """Every rank holds the same final state; returns rank 0's."""
    first = results[0]
    for rank, out in results.items():
        for rid, (x, steps) in out.items():
            assert torch.equal(x, first[rid][0]), (rank, rid)
            assert steps == first[rid][1], (rank, rid)
    return first


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny15(tmp_path_factory):
    from services.model.loader import load_model
    from services.model.tiny import write_tiny_checkpoint
    from services.model.tokenizer import NeoTokenizer
    d = str(tmp_path_factory.mktemp("gen-tiny-u15"))
    write_tiny_checkpoint(d, "u1.5", seed=1)
    return d, (load_model(d, "both"), NeoTokenizer.from_dir(d))


# -- tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seg_lengths,world", [([35], 2), ([35, 35, 12, 1], 2), ([1], 2), ([7, 9], 4),
                                               ([64, 64], 2), ([3], 4)])
def test_row_layout_puts_rank_major_rows_in_canonical_order(seg_lengths, world):
    canon = torch.arange(sum(seg_lengths))
    starts = [sum(seg_lengths[:k]) for k in range(len(seg_lengths))]
    local = []   # what each rank holds: its slice of every segment, segment-major
    for r in range(world):
        parts = []
        for s, n in zip(starts, seg_lengths):
            lo = sum(split(n, world)[:r])
            parts.append(canon[s + lo:s + lo + split(n, world)[r]])
        local.append(torch.cat(parts))
    lay = [RowLayout(seg_lengths, world, r, "cpu") for r in range(world)]
    assert [t.numel() for t in local] == lay[0].counts and sum(lay[0].counts) == canon.numel()
    recv = torch.cat(local)                                     # what an all-to-all delivers
    got = recv if lay[0].recv_to_canon is None else recv[lay[0].recv_to_canon]
    assert torch.equal(got, canon)
    if lay[0].canon_to_recv is not None:
        assert torch.equal(canon[lay[0].canon_to_recv], recv)
    width = max(lay[0].counts)                                  # what a padded all-gather delivers
    padded = torch.cat([torch.cat([t, t.new_full((width - t.numel(),), -1)]) for t in local])
    got = padded if lay[0].gather_index is None else padded[lay[0].gather_index]
    assert torch.equal(got, canon)
    assert split(35, 2) == [18, 17] and split(1, 2) == [1, 0] and split(3, 4) == [1, 1, 1, 0]


@pytest.mark.parametrize("mode", MODES)
def test_sp2_equals_sp1_u1(tiny_dir, ref_model, mode):
    cfg = prefixes(ref_model, guidance_scale=4.0)
    one = prefixes(ref_model, guidance_scale=1.0)
    batches = [
        # two jobs packed: odd token counts (224x160 = 35 tokens), n=2, zero-star CFG
        [job("odd", cfg, width=224, height=160), job("pair", cfg, n=2, cfg_norm="cfg_zero_star",
                                                     width=160, height=128)],
        [job("g1", one, guidance_scale=1.0, width=256, height=192)],
        [job("tiny", one, guidance_scale=1.0, width=32, height=32)],    # rank 1 holds no rows
        # step caching: a threshold that reuses on the tiny model; decisions must match SP1
        [job("cache", cfg, num_inference_steps=5, cache={"mode": "first_block", "threshold": 0.5})],
    ]
    sp1 = run_local(tiny_dir, batches)
    sp2 = assert_ranks_agree(run_ranks(tiny_dir, batches, world=2, sp=2, mode=mode))
    for rid, (x, steps) in sp1.items():
        torch.testing.assert_close(sp2[rid][0], x, **TOL, msg=rid)
        assert sp2[rid][1] == steps, rid
    assert sum(s["reused"] for s in sp1["cache"][1].values()) > 0   # the cache did reuse


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_whose_graph_capture_fails_stays_in_step_with_the_others(tiny_dir, ref_model, mode):
    """SP steps are graphable (their collectives are captured). The fallback, not a claim about CUDA: rank 1
    alone tries to capture (on a CPU the capture fails for real), turns graphs off and computes the step
    eagerly, issuing the same collectives as rank 0: same images as SP1, no hang."""
    one = prefixes(ref_model, guidance_scale=1.0)
    batches = [[job("g1", one, guidance_scale=1.0, width=224, height=160, num_inference_steps=4)]]
    sp1 = run_local(tiny_dir, batches)
    res = run_ranks(tiny_dir, batches, world=2, sp=2, mode=mode, graphs_on_rank=1)
    assert res[1].pop(GRAPHS) == (False, True, 0, 0)          # tried once, failed, off for good
    sp2 = assert_ranks_agree(res)
    torch.testing.assert_close(sp2["g1"][0], sp1["g1"][0], **TOL)


def test_kv_gather_sp3_takes_any_sp(tiny_dir, ref_model):
    """3 ranks on the tiny model's 4 q / 2 KV heads: Ulysses refuses, kv-gather splits rows 12/12/11 of a
    35-token image and 1/1/1 of a 3-token one, packed in one forward with step caching on (first-block and
    TeaCache: the ranks sum the statistic and take SP1's decisions)."""
    from services.generation.engine import Engine
    from services.generation.sequence_parallel import SeqParallel
    from services.generation.cfg_parallel import CfgComm
    with pytest.raises(ValueError, match="sequence parallel 3 must divide"):
        Engine(ref_model[0], None, CfgComm(0, 3, sp=SeqParallel(0, 3, mode="ulysses")))
    cfg = prefixes(ref_model, guidance_scale=4.0)
    batches = [[job("odd3", cfg, width=224, height=160),
                job("strip", cfg, width=96, height=32, cache={"mode": "first_block", "threshold": 0.5}),
                job("tea", cfg, width=64, height=64, num_inference_steps=5,
                    cache={"mode": "teacache", "threshold": 0.1})]]
    sp1 = run_local(tiny_dir, batches)
    sp3 = assert_ranks_agree(run_ranks(tiny_dir, batches, world=3, sp=3, mode="kv-gather"))
    for rid, (x, steps) in sp1.items():
        torch.testing.assert_close(sp3[rid][0], x, **TOL, msg=rid)
        assert sp3[rid][1] == steps, rid
    assert sum(s["reused"] for s in sp1["tea"][1].values()) > 0      # TeaCache did reuse


@pytest.mark.parametrize("mode", MODES)
def test_sp2_equals_sp1_u15_pixel_head(tiny15, mode):
    model_dir, ref = tiny15
    cfg = prefixes(ref, guidance_scale=4.0)
    batches = [[job("u15", cfg, width=224, height=160, n=2), job("u15b", cfg, width=128, height=96)]]
    sp1 = run_local(model_dir, batches)
    sp2 = assert_ranks_agree(run_ranks(model_dir, batches, world=2, sp=2, mode=mode))
    for rid, (x, _) in sp1.items():
        torch.testing.assert_close(sp2[rid][0], x, **TOL, msg=rid)


@pytest.mark.parametrize("mode", MODES)
def test_cfg2_x_sp2_equals_sequential_reference(tiny_dir, ref_model, mode):
    from services.model import reference as R
    t2i = prefixes(ref_model, guidance_scale=4.0)
    edit = prefixes(ref_model, "edit", "make it blue", [photo(5)], guidance_scale=4.0,
                    image_guidance_scale=1.5)
    batches = [[job("t2i", t2i, width=224, height=160, n=2),
                job("edit3", edit, mode="edit", image_guidance_scale=1.5, width=160, height=128)]]
    got = assert_ranks_agree(run_ranks(tiny_dir, batches, world=4, sp=2, mode=mode))
    for rid, pre, mode, w, h, n, gi in [("t2i", t2i, "t2i", 224, 160, 2, 1.0),
                                         ("edit3", edit, "edit", 160, 128, 1, 1.5)]:
        params = SamplerParams(num_inference_steps=3, guidance_scale=4.0, image_guidance_scale=gi,
                                 mode=mode)
        want = R.denoise(ref_model[0], pre, w, h, params, seed=5, n=n)
        torch.testing.assert_close(got[rid][0], want, **TOL, msg=rid)
        assert set(got[rid][1]) == set(pre)     # branch_steps cover every branch over both CFG ranks


def test_trained_size_limit_comes_from_the_checkpoint():
    from services.generation.image_limits import max_image_tokens, size_error
    from services.model.config import parse_config
    from services.model.tiny import full_config, tiny_config
    want = {"u1-8b": 4096, "a3b-full": 4096, "u1.5-8b": 16384}      # 2048², 2048², 4096²
    for variant, tokens in want.items():
        assert max_image_tokens(parse_config(full_config(variant))) == tokens, variant
    assert max_image_tokens(parse_config(tiny_config("u1.5"))) == 16384
    assert size_error(4096, 4096, 16384) is None and size_error(3456, 1152, 4096) is None
    msg = size_error(4096, 4096, 4096)
    assert "16384 image tokens" in msg and "2048x2048" in msg
