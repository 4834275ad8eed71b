"""Correctness on GPU + timings of every kernel in kernels/, written as a markdown report.

Usage (on a CUDA machine): python -m bench.bench_kernels --out DIR [--sweep] [--max-rows N]
Writes DIR/kernels_bench.md (tables) and DIR/kernels_bench.json (raw numbers); prints the tables.
See docs/benchmarks/kernels.md for how inputs are drawn and for the measured results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import importlib
import mmap
import os
import sys
import time
import traceback

if "--smoke" in sys.argv:   # before triton is imported: the interpreter runs the kernels on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

# submodules by path: `kernels` re-exports functions under the same names
dec = importlib.import_module("kernels.decode_attention")
den = importlib.import_module("kernels.denoise_attention")
kvc = importlib.import_module("kernels.kv_copy")
pre = importlib.import_module("kernels.prefill_attention")
nr = importlib.import_module("kernels.qk_norm_rope")

HQ, HKV, D = 32, 8, 128  # SenseNova-U1-8B attention geometry
DT = torch.bfloat16
DEV = "cuda"
SMOKE = False  # --smoke: tiny shapes on CPU through the Triton interpreter (checks the script runs)


def sz(n: int, div: int = 64) -> int:
    """Problem size: as given on the GPU, divided down in --smoke runs."""
    return max(1, n // div) if SMOKE else n


def shapes(seq):
    """A table's shapes: the first (smallest) only in --smoke runs (the interpreter is slow; the script and its
    calls are what the smoke checks; tests/kernels/interpreted checks the kernels)."""
    return list(seq)[:1] if SMOKE else seq


def pinned(t):
    return t.pin_memory() if torch.cuda.is_available() else t
LOG: list[str] = []
RESULTS: dict = {}

# seed 004 table: (batch, max_seq_len, image_token_num, triton ms, fa3 ms)
SEED_ROWS = [
    (8, 4096, 88, 1.95, 0.81), (8, 8192, 171, 6.55, 2.68), (8, 65536, 150, 43.30, 14.95),
    (16, 4096, 379, 4.12, 1.68), (16, 8192, 246, 17.76, 7.40), (16, 65536, 206, 107.74, 33.66),
    (32, 4096, 726, 8.46, 3.46), (32, 8192, 536, 31.74, 13.24), (32, 65536, 417, 171.00, 58.26),
    (64, 4096, 1170, 16.08, 6.88), (64, 8192, 1177, 55.48, 22.91), (64, 65536, 1291, 348.89, 124.82),
    (128, 4096, 2057, 30.89, 12.53), (128, 8192, 2196, 104.73, 43.22), (128, 65536, 2205, 706.60, 241.67),
]


LOG_FILE = None


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)
    if LOG_FILE is not None:  # written as we go: a run cut short still leaves its numbers
        LOG_FILE.write(s + "\n")
        LOG_FILE.flush()


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench(fn, rep=100, graph=True):
    """Median ms; through a captured CUDA graph when possible (no launch gaps)."""
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, False
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            return do_bench(g.replay, warmup=10, rep=rep, return_mode="median"), True
        except Exception as e:  # some paths sync on the host: time them eagerly
            say(f"  (graph capture failed: {type(e).__name__}: {str(e)[:80]}; timing eagerly)")
            torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=rep, return_mode="median"), False


# ---------------------------------------------------------------- inputs


def prefill_inputs(lens, starts, images, hq=HQ, hkv=HKV, d=D, dtype=DT, gen=None, contiguous=False):
    """Packed q, token pool, metadata. images: per seq list of absolute (a, e) spans.
    contiguous=False: slots are a random permutation of the pool (every key row is a gather);
    True: each sequence owns one run of slots (a fresh prefill from the allocator's free run);
    "mixed": even sequences contiguous, odd ones shuffled."""
    totals = [s + n for s, n in zip(starts, lens)]
    S = sum(totals) + 64
    perm = torch.randperm(S, device=DEV, generator=gen)
    r2t = torch.zeros(len(lens), max(totals), dtype=torch.int32, device=DEV)
    used = 0
    for b, L in enumerate(totals):
        run = contiguous is True or (contiguous == "mixed" and b % 2 == 0)
        r2t[b, :L] = (torch.arange(used + 7, used + 7 + L, device=DEV) if run else perm[used:used + L]).int()
        used += L
    kp = torch.randn(S, hkv, d, device=DEV, dtype=dtype, generator=gen)
    vp = torch.randn(S, hkv, d, device=DEV, dtype=dtype, generator=gen)
    Tq = sum(lens)
    q = torch.randn(Tq, hq, d, device=DEV, dtype=dtype, generator=gen)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    img = torch.zeros(Tq, dtype=torch.int32)
    for b, spans in enumerate(images):
        for a, e in spans:
            lo, hi = max(a, starts[b]), min(e, totals[b])
            if hi > lo:
                img[int(cu[b]) + lo - starts[b]:int(cu[b]) + hi - starts[b]] = e
    return dict(q=q, k_pool=kp, v_pool=vp, req_to_token=r2t,
                b_start=torch.tensor(starts, dtype=torch.int32, device=DEV),
                b_seq_len=torch.tensor(totals, dtype=torch.int32, device=DEV),
                cu_seqlens_q=cu.to(DEV), image_end=img.to(DEV))


def seed_row_inputs(batch, max_len, n_img, gen):
    """Lengths ~ U[max_len/8, max_len]; n_img image tokens split over ceil(batch/4) images,
    each placed at a uniform random offset inside its sequence (see docs/benchmarks/kernels.md)."""
    lo = max(1, max_len // 8)
    lens = torch.randint(lo, max_len + 1, (batch,), generator=gen).tolist()
    n_images = max(1, math.ceil(batch / 4))
    sizes = [n_img // n_images + (1 if i < n_img % n_images else 0) for i in range(n_images)]
    who = torch.randperm(batch, generator=gen)[:n_images].tolist()
    images = [[] for _ in range(batch)]
    for b, sz in zip(who, sizes):
        sz = min(sz, lens[b])
        a = int(torch.randint(0, lens[b] - sz + 1, (1,), generator=gen))
        images[b].append((a, a + sz))
    return lens, images


# ---------------------------------------------------------------- correctness


def check_correctness():
    say("## Correctness on GPU (relative Frobenius error vs the fp32-math torch reference)")
    gen = torch.Generator(device=DEV).manual_seed(int(time.time()))
    cpu_gen = torch.Generator().manual_seed(int(time.time()))
    ok = True
    tol = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-4}
    for dtype, (hq, hkv, d) in shapes(((torch.bfloat16, (32, 8, 128)), (torch.bfloat16, (8, 1, 16)),
                                       (torch.float16, (16, 2, 64)))):
        if True:
            lens, starts = [sz(1000), 37, sz(513), 1, sz(2000)], [0, sz(100), sz(300), 5, 0]
            images = [[(10, sz(400)), (sz(600), sz(999))], [], [(sz(290), sz(700))], [(5, 6)],
                      [(sz(1900), sz(2000))]]
            inp = prefill_inputs(lens, starts, images, hq, hkv, d, dtype, gen, contiguous="mixed")
            sc = 1 / math.sqrt(d)
            ref = pre.prefill_attention_ref(**inp, scale=sc)
            inp_t = dict(inp, image_end=None)
            ref2 = pre.prefill_attention_ref(**inp_t, scale=sc)
            cfg0 = pre.default_prefill_config(d, dtype, torch.device(DEV))
            for mode in ((0, 2) if d == 128 else (cfg0[4],)):
                cfg = tuple(cfg0[:4]) + (mode, False)
                out = pre.prefill_attention_triton(**inp, scale=sc, config=cfg,
                                                   out=torch.full_like(inp["q"], float("nan")))
                e1 = rel(out, ref)
                e2 = rel(pre.prefill_attention_triton(**inp_t, scale=sc, config=cfg), ref2)
                good = e1 < tol[dtype] and e2 < tol[dtype] and not out.isnan().any()
                ok &= good
                say(f"prefill {dtype} H{hq}/{hkv} D{d} kv_mode {mode}: hybrid {e1:.2e} text-only {e2:.2e} "
                    f"{'OK' if good else 'FAIL'}")
            if dtype != torch.float32 and d == 128:
                inp_c = prefill_inputs(lens, [0] * len(lens), [[]] * len(lens), hq, hkv, d, dtype, gen,
                                       contiguous=True)
                inp_c["image_end"] = None
                o = pre.prefill_attention_text_sdpa(**{k: v for k, v in inp_c.items() if k != "image_end"},
                                                    scale=sc)
                e3 = rel(o, pre.prefill_attention_ref(**inp_c, scale=sc)) if o is not None else float("nan")
                good = e3 < tol[dtype]
                ok &= good
                say(f"prefill text-only SDPA path {dtype}: {e3:.2e} {'OK' if good else 'FAIL'}")
    for dtype in (torch.bfloat16,):
        # denoise: two requests, prefix 9 and 365, 1024 and 4096 image tokens
        n1, n2 = sz(1024), sz(4096)
        cq = torch.tensor([0, n1, n1 + n2], dtype=torch.int32, device=DEV)
        ck = torch.tensor([0, n1 + 9, n1 + 9 + n2 + 365], dtype=torch.int32, device=DEV)
        q = torch.randn(n1 + n2, HQ, D, device=DEV, dtype=dtype, generator=gen)
        k = torch.randn(int(ck[-1]), HKV, D, device=DEV, dtype=dtype, generator=gen)
        v = torch.randn_like(k)
        ref = den.denoise_attention_ref(q, k, v, cq, ck)
        for name, fn in (("triton", den.denoise_attention_triton), ("sdpa", den.denoise_attention_sdpa)):
            e = rel(fn(q, k, v, cq, ck), ref)
            ok &= e < tol[dtype]
            say(f"denoise {name} {dtype}: {e:.2e}")
        # decode
        lens = [1, 77, sz(3000), sz(1024), sz(5000), 64, 129, sz(2048)]
        S = sum(lens) + 100
        kp = torch.randn(S, HKV, D, device=DEV, dtype=dtype, generator=gen)
        vp = torch.randn_like(kp)
        perm = torch.randperm(S, device=DEV, generator=gen)
        r2t = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=DEV)
        u = 0
        for b, L in enumerate(lens):
            r2t[b, :L] = perm[u:u + L].int()
            u += L
        qd = torch.randn(len(lens), HQ, D, device=DEV, dtype=dtype, generator=gen)
        bl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        ref = dec.decode_attention_ref(qd, kp, vp, r2t, bl)
        for ns in (None, 1, 7):
            e = rel(dec.decode_attention_triton(qd, kp, vp, r2t, bl, num_splits=ns), ref)
            ok &= e < tol[dtype]
            say(f"decode splits={ns} {dtype}: {e:.2e}")
        # norm + rope
        T = sz(3000)
        qn = torch.randn(T, HQ, D, device=DEV, dtype=dtype, generator=gen)
        kn = torch.randn(T, HKV, D, device=DEV, dtype=dtype, generator=gen)
        ws = [(torch.rand(D // 2, device=DEV, generator=gen) + 0.5).to(dtype) for _ in range(4)]
        pos = torch.stack([torch.randint(0, 30000, (T,), device=DEV, generator=gen),
                           torch.randint(0, 64, (T,), device=DEV, generator=gen),
                           torch.randint(0, 64, (T,), device=DEV, generator=gen)])
        q1, k1, q2, k2 = qn.clone(), kn.clone(), qn.clone(), kn.clone()
        nr.qk_norm_rope_ref_(q1, k1, *ws, pos, 5e6, 1e4, 1e-6)
        nr.qk_norm_rope_triton_(q2, k2, *ws, pos, 5e6, 1e4, 1e-6)
        eq, ek = rel(q2, q1), rel(k2, k1)
        ok &= eq < tol[dtype] and ek < tol[dtype]
        say(f"norm+rope {dtype}: q {eq:.2e} k {ek:.2e}; bitwise-equal fraction "
            f"{(q1 == q2).float().mean().item():.4f}")
    # kv copy: exact, GPU pool <-> pinned host pages
    L, S, T, pt = 4, sz(3000), sz(1000), sz(64, 8)
    kv = torch.randn(L, 2, S, HKV, D, device=DEV, dtype=DT, generator=gen)
    slots = torch.randperm(S, device=DEV, generator=gen)[:T].int()
    npg = -(-T // pt)
    pids = torch.randperm(npg + 5, generator=cpu_gen)[:npg].int().to(DEV)
    pages = pinned(torch.zeros(npg + 5, L, 2, pt, HKV, D, dtype=DT))
    kvc.kv_export_triton(kv, slots, pages, pids)
    if DEV == "cuda":
        torch.cuda.synchronize()
    pages_ref = torch.zeros_like(pages)
    kvc.kv_export_ref(kv, slots, pages_ref, pids)
    e1 = torch.equal(pages, pages_ref)
    dst = torch.full((L, 2, T + 100, HKV, D), float("nan"), device=DEV, dtype=DT)
    kvc.kv_import_triton(pages, pids, T, dst)
    e2 = torch.equal(dst[:, :, :T], kv[:, :, slots.long()]) and dst[:, :, T:].isnan().all().item()
    ok &= e1 and e2
    say(f"kv_export (GPU->pinned host) exact: {e1}; kv_import (pinned host->GPU) exact: {e2}")
    say(f"ALL CORRECT: {ok}")
    RESULTS["correct"] = ok
    return ok


# ---------------------------------------------------------------- prefill


def sdpa_causal_floor(inp, with_mask=False, rep=50):
    """Best torch SDPA backend, one call per sequence, K/V expanded to Hq heads, graph-timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cu = inp["cu_seqlens_q"].tolist()
    G = HQ // HKV
    seqs = []
    for b in range(len(cu) - 1):
        L = cu[b + 1] - cu[b]
        slots = inp["req_to_token"][b, :L].long()
        q = inp["q"][cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0).contiguous()
        k = inp["k_pool"][slots].repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0).contiguous()
        v = inp["v_pool"][slots].repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0).contiguous()
        mask = None
        if with_mask:
            pos = torch.arange(L, device=DEV)
            ie = inp["image_end"][cu[b]:cu[b + 1]]
            mask = (pos[None, :] <= pos[:, None]) | (pos[None, :] < ie[:, None])
        seqs.append((q, k, v, mask))
    outs = [torch.empty_like(s[0]) for s in seqs]

    def run():
        for (q, k, v, m), o in zip(seqs, outs):
            if m is None:
                o.copy_(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            else:
                o.copy_(F.scaled_dot_product_attention(q, k, v, attn_mask=m))

    best = None
    backends = [SDPBackend.EFFICIENT_ATTENTION] if with_mask else \
        [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    for be in backends:
        try:
            with sdpa_kernel([be]):
                t, _ = bench(run, rep=rep)
        except Exception as e:
            say(f"  sdpa {be.name}: {type(e).__name__} {str(e)[:60]}")
            continue
        if best is None or t < best[0]:
            best = (t, be.name)
    return best


def causal_flops(lens):
    return sum(4 * HQ * D * L * (L + 1) / 2 for L in lens)


PREFILL_CFGS = [  # (BLOCK_M, BLOCK_N, warps, stages, kv_mode, warp_specialize)
    (128, 32, 4, 4, 0, False),  # the previous default (gather)
    (128, 32, 4, 4, 1, False), (128, 64, 4, 3, 1, False),
    (128, 32, 4, 4, 2, False), (128, 64, 4, 3, 2, False), (128, 64, 4, 4, 2, False), (128, 64, 8, 3, 2, False),
    (128, 128, 8, 2, 2, False), (128, 128, 8, 3, 2, False),
]


def prefill_cfg_correct(cfg, gen):
    """bf16 hybrid + text-only check of one config (mixed contiguous/shuffled pool, prefix offsets)."""
    lens, starts = [sz(1000), 37, sz(513), 1, sz(2000)], [0, sz(100), sz(300), 5, 0]
    images = [[(10, sz(400)), (sz(600), sz(999))], [], [(sz(290), sz(700))], [(5, 6)], [(sz(1900), sz(2000))]]
    inp = prefill_inputs(lens, starts, images, gen=gen, contiguous="mixed")
    errs = []
    for ie in (inp["image_end"], None):
        x = dict(inp, image_end=ie)
        ref = pre.prefill_attention_ref(**x, scale=D ** -0.5)
        out = pre.prefill_attention_triton(**x, scale=D ** -0.5, config=cfg, out=torch.full_like(x["q"], float("nan")))
        errs.append(rel(out, ref))
    return max(errs) < 1e-2, errs


def prefill_sweep(gen):
    say("\n## Prefill config sweep (bf16, 8B geometry, contiguous pool; hybrid mask)")
    res = {}
    for (batch, max_len, n_img) in ((16, 8192, 246), (128, 4096, 2057)):
        batch, max_len, n_img = sz(batch, 16), sz(max_len), sz(n_img)
        lens, images = seed_row_inputs(batch, max_len, n_img, torch.Generator().manual_seed(batch))
        inp = prefill_inputs(lens, [0] * batch, images, gen=gen, contiguous=True)
        mq = max(lens)
        for cfg in PREFILL_CFGS:
            if cfg in res and len(res[cfg]) == 0:
                continue  # failed on the first row
            try:
                t, _ = bench(lambda: pre.prefill_attention_triton(**inp, scale=D ** -0.5, max_seqlen_q=mq,
                                                                  config=cfg), rep=40)
            except Exception as e:
                say(f"  cfg {cfg}: {type(e).__name__} {str(e)[:120]}")
                res[cfg] = []
                continue
            res.setdefault(cfg, []).append(t)
            say(f"  B{batch} L{max_len} cfg {cfg}: {t:.3f} ms")
        del inp
    ranked = sorted((c for c in res if len(res[c]) == 2), key=lambda c: sum(res[c]))
    RESULTS["prefill_sweep"] = {str(k): v for k, v in res.items()}
    for cfg in ranked[:3]:
        good, errs = prefill_cfg_correct(cfg, gen)
        say(f"  check {cfg}: hybrid {errs[0]:.2e} text-only {errs[1]:.2e} {'OK' if good else 'FAIL'}")
        if good:
            say(f"best prefill config: {cfg}")
            RESULTS["prefill_best_cfg"] = str(cfg)
            return cfg
    return None


PREFILL_TABLE_ROWS = [(8, 4096), (8, 8192), (32, 4096), (32, 8192), (128, 4096), (128, 8192), (8, 65536)]


def prefill_table(gen, cfg, max_rows):
    say(f"\n## Hybrid-mask prefill (bf16, 32 q / 8 kv heads, head_dim 128; ms, median) cfg {cfg}")
    hdr = ("| batch | max_seq_len | image tokens | tokens | ours hybrid (contig pool) | ours text-only (contig) | "
           "ours hybrid (shuffled pool) | text-only SDPA path | SDPA causal floor (backend) | "
           "ours / floor | ours TFLOP/s | seed triton | seed FA3 |")
    rows = [hdr, "|" + "---:|" * 13]
    out = []
    by_row = {(b, l): (n, tr, fa) for b, l, n, tr, fa in SEED_ROWS}
    for i, (batch0, max_len0) in enumerate(shapes(PREFILL_TABLE_ROWS[:max_rows])):
        n_img0, s_tri, s_fa3 = by_row[(batch0, max_len0)]
        if SMOKE and max_len0 == 65536:
            continue
        batch, max_len, n_img = sz(batch0, 16), sz(max_len0), sz(n_img0)
        lens, images = seed_row_inputs(batch, max_len, n_img, torch.Generator().manual_seed(1000 + i))
        inp = prefill_inputs(lens, [0] * batch, images, gen=gen, contiguous=True)
        mq = max(lens)
        rep = 60 if max_len <= 8192 else 200
        t_h, _ = bench(lambda: pre.prefill_attention_triton(**inp, scale=D ** -0.5, max_seqlen_q=mq, config=cfg),
                       rep=rep)
        inp_t = dict(inp, image_end=None)
        t_c, _ = bench(lambda: pre.prefill_attention_triton(**inp_t, scale=D ** -0.5, max_seqlen_q=mq,
                                                            config=cfg), rep=rep)
        # the text-only SDPA path (host metadata read + SDPA per sequence), as the dispatch runs it
        t_d, _ = bench(lambda: pre.prefill_attention_text_sdpa(**{k: v for k, v in inp_t.items() if k != "image_end"},
                                                               scale=D ** -0.5), rep=rep, graph=False)
        floor = sdpa_causal_floor(inp, rep=rep) or (float("nan"), "none")
        perm = torch.randperm(inp["k_pool"].shape[0], device=DEV, generator=gen).int()
        inp_s = dict(inp, req_to_token=perm[inp["req_to_token"].long()])
        t_s, _ = bench(lambda: pre.prefill_attention_triton(**inp_s, scale=D ** -0.5, max_seqlen_q=mq,
                                                            config=cfg), rep=rep)
        tf = causal_flops(lens) / (t_h * 1e-3) / 1e12
        ratio = t_h / floor[0]
        r = dict(batch=batch, max_len=max_len, n_img=n_img, tokens=sum(lens), ours=t_h, ours_text=t_c,
                 ours_shuffled=t_s, dispatch_text=t_d, floor=floor, ratio=ratio, tflops=tf)
        out.append(r)
        row = (f"| {batch} | {max_len} | {n_img} | {sum(lens)} | {t_h:.2f} | {t_c:.2f} | {t_s:.2f} | {t_d:.2f} | "
               f"{floor[0]:.2f} ({floor[1]}) | {ratio:.2f}x | {tf:.0f} | {s_tri} | {s_fa3} |")
        rows.append(row)
        say(row)
        del inp, inp_t, inp_s
        torch.cuda.empty_cache()
    RESULTS["prefill"] = out
    return rows


# ---------------------------------------------------------------- denoise


def denoise_table(gen, sweep):
    say("\n## Denoise attention (bf16, 4096 image tokens = 2048x2048, non-causal over [prefix ; image])")
    rows = ["| requests | prefix | ours Triton ms | SDPA ms (backend) | ours / best | ours TFLOP/s | SDPA TFLOP/s |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    cfgs = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)] if sweep else [None]
    out = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for nreq, prefix in shapes(((1, 9), (1, 365), (1, 1024), (2, 365), (4, 365))):
        N = sz(4096)
        cq = torch.arange(nreq + 1, dtype=torch.int32, device=DEV) * N
        ck = torch.arange(nreq + 1, dtype=torch.int32, device=DEV) * (N + prefix)
        q = torch.randn(nreq * N, HQ, D, device=DEV, dtype=DT, generator=gen)
        k = torch.randn(nreq * (N + prefix), HKV, D, device=DEV, dtype=DT, generator=gen)
        v = torch.randn_like(k)
        flops = 4 * HQ * D * N * (N + prefix) * nreq
        best_cfg = None
        for cfg in cfgs:
            t, _ = bench(lambda: den.denoise_attention_triton(q, k, v, cq, ck, N, N + prefix, config=cfg), rep=50)
            if sweep:
                say(f"  denoise cfg {cfg}: {t:.3f} ms")
            if best_cfg is None or t < best_cfg[0]:
                best_cfg = (t, cfg)
        t_ours = best_cfg[0]
        best = None
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([be]):
                    t, _ = bench(lambda: den.denoise_attention_sdpa(q, k, v, cq, ck), rep=50, graph=False)
            except Exception as e:
                say(f"  sdpa {be.name} (enable_gqa): {type(e).__name__} {str(e)[:60]}")
                continue
            if best is None or t < best[0]:
                best = (t, be.name)
        if best is None:  # no GQA-capable backend: expand K/V to Hq heads
            ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
            t, _ = bench(lambda: den.denoise_attention_sdpa(q, ke, ve, cq, ck), rep=50, graph=False)
            best = (t, "default, K/V expanded")
        r = dict(nreq=nreq, prefix=prefix, ours=t_ours, cfg=best_cfg[1], sdpa=best,
                 ours_tflops=flops / t_ours / 1e9, sdpa_tflops=flops / best[0] / 1e9 if best else None)
        out.append(r)
        rows.append(f"| {nreq} | {prefix} | {t_ours:.3f} | {best[0]:.3f} ({best[1]}) | "
                    f"{t_ours / min(best[0], t_ours):.2f}x | {r['ours_tflops']:.0f} | {r['sdpa_tflops']:.0f} |")
        say(rows[-1])
    RESULTS["denoise"] = out
    return rows


# ---------------------------------------------------------------- decode, norm+rope, kv copy


def copy_bandwidth():
    x = torch.empty(sz(1 << 30, 1024), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    t, _ = bench(lambda: y.copy_(x), rep=50, graph=False)
    bw = 2 * x.numel() / (t * 1e-3) / 1e12
    say(f"device-to-device copy: {bw:.2f} TB/s (read + write)")
    RESULTS["copy_tbps"] = bw
    return bw


def decode_table(gen, peak, sweep):
    say("\n## Decode attention (bf16, one query token per sequence, shuffled token pool)")
    rows = ["| batch | kv len | splits | ms | GB moved | TB/s | % of copy bw |", "|---:|---:|---:|---:|---:|---:|---:|"]
    out = []
    for B, L in shapes(((1, 1024), (1, 32768), (16, 2048), (16, 8192), (64, 2048), (64, 8192), (128, 4096))):
        B, L = sz(B, 16), sz(L)
        S = B * L + 64
        kp = torch.randn(S, HKV, D, device=DEV, dtype=DT, generator=gen)
        vp = torch.randn_like(kp)
        r2t = torch.randperm(S, device=DEV, generator=gen)[:B * L].view(B, L).int()
        q = torch.randn(B, HQ, D, device=DEV, dtype=DT, generator=gen)
        bl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        outb = torch.empty_like(q)
        nbytes = B * L * HKV * D * 2 * 2 + B * L * 4 + 2 * q.numel() * 2
        variants = [(None, 64, 4, 3)]
        if sweep:
            variants += [(None, 32, 4, 3), (None, 64, 4, 2), (None, 128, 8, 2), (None, 64, 8, 3)]
        best = None
        for (ns, bn, nw, st) in variants:
            try:
                t, _ = bench(lambda: dec.decode_attention_triton(q, kp, vp, r2t, bl, num_splits=ns, block_n=bn,
                                                                 num_warps=nw, num_stages=st, out=outb), rep=50)
            except Exception as e:
                say(f"  decode variant {(bn, nw, st)}: {type(e).__name__} {str(e)[:60]}")
                continue
            if sweep:
                say(f"  B{B} L{L} block_n={bn} warps={nw} stages={st}: {t:.4f} ms")
            if best is None or t < best[0]:
                best = (t, (bn, nw, st))
        t = best[0]
        splits = dec.default_num_splits(B, HKV, L, q.device, best[1][0])
        bw = nbytes / (t * 1e-3) / 1e12
        out.append(dict(B=B, L=L, ms=t, tbps=bw, pct=bw / peak * 100, cfg=best[1], splits=splits))
        rows.append(f"| {B} | {L} | {splits} | {t:.4f} | {nbytes / 1e9:.3f} | {bw:.2f} | {bw / peak * 100:.0f}% |")
        say(rows[-1] + (f" cfg={best[1]}" if sweep else ""))
        del kp, vp
    RESULTS["decode"] = out
    return rows


def norm_rope_table(gen, peak, sweep):
    say("\n## Fused Q/K RMSNorm + 3-D RoPE (bf16, in place, one launch)")
    rows = ["| tokens | ms | GB moved | TB/s | % of copy bw |", "|---:|---:|---:|---:|---:|"]
    out = []
    for T in shapes((1024, 8192, 32768, 131072)):
        T = sz(T, 256)
        q = torch.randn(T, HQ, D, device=DEV, dtype=DT, generator=gen)
        k = torch.randn(T, HKV, D, device=DEV, dtype=DT, generator=gen)
        ws = [(torch.rand(D // 2, device=DEV, generator=gen) + 0.5).to(DT) for _ in range(4)]
        pos = torch.randint(0, 4000, (3, T), device=DEV, generator=gen)
        nbytes = 2 * (q.numel() + k.numel()) * 2 + T * 2 * D * 2   # q, k read + written; the table read
        table = nr.rope_table(pos, D, 5e6, 1e4, DT)   # one per forward in the model
        # (tokens per program, warps, heads per program)
        variants = [(nr.BLOCK_T, nr.NUM_WARPS, nr.HEADS_PER_PROGRAM)] + (
            [(1, 2, 8), (2, 1, 4), (1, 1, 8), (4, 4, 8), (2, 4, 16), (2, 8, 8)] if sweep else [])
        best = None
        for bt, nw, hc in variants:
            t, _ = bench(lambda: nr.qk_norm_rope_triton_(q, k, *ws, pos, 5e6, 1e4, 1e-6, table, block_t=bt,
                                                         num_warps=nw, heads_per_program=hc), rep=50)
            if sweep:
                say(f"  T{T} block_t={bt} warps={nw} heads_per_program={hc}: {t:.4f} ms")
            if best is None or t < best[0]:
                best = (t, (bt, nw, hc))
        t = best[0]
        bw = nbytes / (t * 1e-3) / 1e12
        out.append(dict(T=T, ms=t, tbps=bw, pct=bw / peak * 100, cfg=best[1]))
        rows.append(f"| {T} | {t:.4f} | {nbytes / 1e9:.3f} | {bw:.2f} | {bw / peak * 100:.0f}% |")
        say(rows[-1] + (f" cfg={best[1]}" if sweep else ""))
    RESULTS["norm_rope"] = out
    return rows


def kv_write_table(gen, peak):
    say("\n## A denoising step's K/V rows into the job's KV buffer (bf16, 8 kv heads x 128; k, v strided views of "
        "one fused [q | k | v] projection)")
    rows = ["| rows | torch index_copy_ x2 ms | kv_write_ ms | GB moved | kv_write_ TB/s | % of copy bw | equal |",
            "|---:|---:|---:|---:|---:|---:|---|"]
    out = []
    for T in shapes((1024, 4096, 8192)):
        T = sz(T)
        fused = torch.randn(T, (HQ + 2 * HKV) * D, device=DEV, dtype=DT, generator=gen)
        _, k, v = fused.split([HQ * D, HKV * D, HKV * D], dim=1)
        k, v = k.view(T, HKV, D), v.view(T, HKV, D)
        want = torch.zeros(2, T + 365, HKV, D, device=DEV, dtype=DT)
        got = want.clone()
        slots = torch.arange(T, device=DEV) + 365
        kvc.kv_write_ref_(want, slots, k, v)
        kvc.kv_write_(got, slots, k, v)
        t_ref, _ = bench(lambda: kvc.kv_write_ref_(want, slots, k, v), rep=50)
        t, _ = bench(lambda: kvc.kv_write_(got, slots, k, v), rep=50)
        nbytes = 2 * 2 * k.numel() * k.element_size()
        bw = nbytes / (t * 1e-3) / 1e12
        out.append(dict(T=T, ref_ms=t_ref, ms=t, tbps=bw, equal=torch.equal(got, want)))
        rows.append(f"| {T} | {t_ref:.4f} | {t:.4f} | {nbytes / 1e9:.3f} | {bw:.2f} | {bw / peak * 100:.0f}% | "
                    f"{torch.equal(got, want)} |")
        say(rows[-1])
    RESULTS["kv_write"] = out
    return rows


def shm_tensor(nbytes, dtype, shape):
    """A tensor over a /dev/shm mapping, like shm_transfer's page pool."""
    path = f"/dev/shm/u1bench_{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    os.unlink(path)
    t = torch.frombuffer(mm, dtype=dtype, count=math.prod(shape)).view(shape)
    return t, mm


def kv_copy_table(gen):
    say("\n## KV copy for the handoff (bf16, 42 layers x 8 kv heads x 128, shuffled pool slots, 64-token pages)")
    rows = ["| tokens | MB | pages memory | export GPU->host ms | GB/s | import host->GPU ms | GB/s | "
            "plain pinned memcpy D2H / H2D GB/s |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    out = []
    L, pt = (42, 64) if not SMOKE else (2, 8)
    for T in shapes((365, 4096)):
        T = sz(T)
        S = 2 * T + 64
        kv = torch.randn(L, 2, S, HKV, D, device=DEV, dtype=DT, generator=gen)
        slots = torch.randperm(S, device=DEV, generator=gen)[:T].int()
        npg = -(-T // pt)
        pids = torch.arange(npg, dtype=torch.int32, device=DEV)
        shape = (npg, L, 2, pt, HKV, D)
        nbytes = T * L * 2 * HKV * D * 2
        dst = torch.empty(L, 2, T + sz(4096), HKV, D, device=DEV, dtype=DT)
        kinds = [("torch pinned", pinned(torch.empty(shape, dtype=DT)), None)]
        try:
            t_shm, mm = shm_tensor(math.prod(shape) * 2, DT, shape)
            t_shm.zero_()
            kvc.register_host_memory(t_shm)
            kinds.append(("/dev/shm + cudaHostRegister", t_shm, mm))
        except Exception as e:
            say(f"  shm registration failed: {type(e).__name__}: {e}")
        flat_d = torch.empty(nbytes // 2, device=DEV, dtype=DT)
        flat_h = pinned(torch.empty(nbytes // 2, dtype=DT))
        t_d2h, _ = bench(lambda: flat_h.copy_(flat_d, non_blocking=True), rep=50, graph=False)
        t_h2d, _ = bench(lambda: flat_d.copy_(flat_h, non_blocking=True), rep=50, graph=False)
        for name, pages, mm in kinds:
            t_e, _ = bench(lambda: kvc.kv_export_triton(kv, slots, pages, pids), rep=50, graph=False)
            t_i, _ = bench(lambda: kvc.kv_import_triton(pages, pids, T, dst), rep=50, graph=False)
            ok = torch.equal(dst[:, :, :T], kv[:, :, slots.long()])
            r = dict(T=T, mem=name, export_ms=t_e, import_ms=t_i, export_gbs=nbytes / t_e / 1e6,
                     import_gbs=nbytes / t_i / 1e6, memcpy_d2h=nbytes / t_d2h / 1e6, memcpy_h2d=nbytes / t_h2d / 1e6,
                     exact=ok)
            out.append(r)
            rows.append(f"| {T} | {nbytes / 1e6:.1f} | {name} | {t_e:.3f} | {r['export_gbs']:.1f} | {t_i:.3f} | "
                        f"{r['import_gbs']:.1f} | {r['memcpy_d2h']:.1f} / {r['memcpy_h2d']:.1f} |")
            say(rows[-1] + ("" if ok else "  (MISMATCH)"))
        for name, pages, mm in kinds:
            if mm is not None:
                kvc.unregister_host_memory(pages)
                del pages
        del kv
    RESULTS["kv_copy"] = out
    return rows


FAILED: list[str] = []


def guarded(fn, *a, name: str = ""):
    """Run one section; a failure is logged, the next section still runs, and the exit status is 1."""
    try:
        return fn(*a)
    except Exception:
        FAILED.append(name or fn.__name__)
        say(f"SECTION {FAILED[-1]} FAILED:\n{traceback.format_exc()}")
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    ap.add_argument("--max-rows", type=int, default=len(PREFILL_TABLE_ROWS))
    ap.add_argument("--skip", default="",
                    help="comma list of sections to skip: correct,prefill,denoise,decode,norm,kv,kvwrite")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global LOG_FILE, SMOKE, DEV, HQ, HKV, D
    if args.smoke:
        SMOKE, DEV, HQ, HKV, D = True, "cpu", 8, 2, 16
    os.makedirs(args.out, exist_ok=True)
    LOG_FILE = open(os.path.join(args.out, "kernels_bench.log"), "w")
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.time()
    gpu = "CPU (smoke)"
    if DEV == "cuda":
        p = torch.cuda.get_device_properties(0)
        gpu = f"{p.name} ({p.multi_processor_count} SMs)"
    head = (f"GPU: {gpu}, torch {torch.__version__}, triton {triton.__version__}, "
            f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    say(head)
    RESULTS["env"] = head
    gen = torch.Generator(device=DEV).manual_seed(1234)
    sections = []
    if "correct" not in skip:
        guarded(check_correctness)
    peak = guarded(copy_bandwidth) or 4.3
    cfg = pre.default_prefill_config(D, DT, torch.device(DEV))

    def prefill_section():
        c = (guarded(prefill_sweep, gen) if args.sweep else None) or cfg
        return prefill_table(gen, c, args.max_rows)
    plan = [("norm", lambda: norm_rope_table(gen, peak, args.sweep)),  # quick: first
            ("prefill", prefill_section),
            ("denoise", lambda: denoise_table(gen, args.sweep)),
            ("decode", lambda: decode_table(gen, peak, args.sweep)),
            ("kv", lambda: kv_copy_table(gen)),
            ("kvwrite", lambda: kv_write_table(gen, peak))]
    for name, fn in plan:
        if name not in skip:
            rows = guarded(fn, name=name)
            if rows:
                sections.append((name, rows))
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels_bench.md"), "w") as f:
        f.write(head + "\n\n")
        for name, rows in sections:
            f.write(f"### {name}\n\n" + "\n".join(rows) + "\n\n")
    with open(os.path.join(args.out, "kernels_bench.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    say(f"\ntotal {time.time() - t0:.0f} s")
    for name, rows in sections:
        print(f"\n### {name}\n" + "\n".join(rows))
    if FAILED:
        say(f"failed sections: {', '.join(FAILED)} (tracebacks above)")
        sys.exit(1)


if __name__ == "__main__":
    main()
