"""The memory plan of a deployment (`u1serve plan`): per engine, what its GPU holds, from config.json alone.

Every figure is derived from the code's own layout, not from a table:
- weights: the engine's branch built on the meta device (model.NeoModel: und = text + vision + lm_head,
  gen = the `_mot_gen` layers + fm_modules), its quantised layers picked by the same rule that swaps them at load
  (quant.target_linears + fp8_eligible), each format's bytes per layer as its layer classes store them:
    bf16 (model dtype)  numel x itemsize
    fp8 / int8 (W8A8)   1 byte a weight + an fp32 scale per output row; fp8 on CUDA also keeps the model-dtype
                        copy (GemmPolicy.for_device: below 1,024 / 2,048 rows the bf16 GEMM runs) unless
                        U1SERVE_FP8_MIN_TOKENS=0 ("fp8-only"); int8 never keeps one
    gguf q8_0 / q4_k    dequantised to the model dtype at load (gguf_io.py): on the GPU exactly bf16; only the
                        file shrinks (Q8_0 34 B / 32 weights, Q4_K 144 B / 256)
- understanding KV: ModelRunner's pool, layers x 2 x (slots + 1) x kv heads x head_dim x itemsize, the page table
  (max_running + 1) x (max_model_len + 1) int32, and the engine's own reserve for activations / CUDA graphs /
  sampling (`und_runtime_reserve`, what engine._fit_kv_cache subtracts before it sizes the KV cache);
- the shared KV pool: host shared memory, not GPU (shm_transfer.pool.segment_bytes);
- generation: one job's KV buffer at the largest allowed image (capacity.py's layout: layers x 2 x (prefix +
  image tokens) x kv heads x head_dim, per CFG branch), the activations of one denoise step of that job (rows =
  image tokens x CFG branches, at most --max-batch-tokens: the widest live tensors of one decoder layer),
  the CUDA graphs' private pool (one more copy of those activations when graphs are on);
- runtime overhead: the CUDA context + library workspaces of each process, outside torch's allocator and so
  outside `set_per_process_memory_fraction` (CUDA_CONTEXT_BYTES, an estimate the GPU run checks:
  bench/gpu_memcap.sh).
The activation and context figures are the only estimates; weights and KV are exact (tests/model/test_memory_plan.py
checks them against what the tiny checkpoint allocates in each format).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20
CUDA_CONTEXT_BYTES = 768 * MiB          # per engine process: CUDA context, cuBLAS / cuDNN workspaces (estimate)
UND_MIN_RESERVE = 2 * GiB               # understanding: activations, decode CUDA graphs, sampling ...
UND_RESERVE_SHARE = 0.1                 # ... or this share of its budget, whichever is more (engine._fit_kv_cache)
UND_MIN_KV_TOKENS = 1024                # the engine never sizes its KV cache below this
REFERENCE_PREFIX_TOKENS = 512           # a job's text prefix (generation/capacity.py's reference job)
RUNTIME_FORMATS = ("bf16", "fp8", "fp8-only", "int8")   # what a GPU holds
FILE_FORMATS = ("q8_0", "q4_k")                          # GGUF: dequantised at load
GGUF_BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_k": 144 / 256}
IMAGE_SIDES = (4096, 3072, 2048, 1792, 1536, 1280, 1024, 768, 512)   # fallbacks the plan tries, largest first


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V of one token in every layer (the understanding KV pool, a generation job's buffer, a pool page)."""
    return num_layers * 2 * kv_heads * head_dim * itemsize


def job_kv_bytes(llm, itemsize: int, tokens: int, branches: int) -> int:
    """A generation job's KV buffer on the device: `tokens` (prefix + images) in each of its `branches`."""
    return kv_bytes_per_token(llm.num_hidden_layers, llm.num_key_value_heads, llm.head_dim, itemsize) * tokens * branches


def und_runtime_reserve(budget: float) -> int:
    """What the understanding engine keeps free of KV inside its budget (activations, CUDA graphs, sampling)."""
    return int(max(UND_MIN_RESERVE, UND_RESERVE_SHARE * budget))


def parse_bytes(text: str) -> int:
    """"24GiB", "24G", "24 GB" (GB read as GiB, as nvidia-smi and torch report cards), "1.5TiB", "512MiB"."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text or "")
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 24GiB)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}[m.group(2).lower()])


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


# ----------------------------------------------------------------------------------------------- weights
@dataclass
class BranchWeights:
    """One engine's weights: `plain` bytes that stay in the model dtype whatever the format, and per quantisable
    Linear (layer index, rows, cols) the shape the formats price."""
    branch: str
    plain_numel: int
    targets: list[tuple[int, int, int]]            # (layer, out_features, in_features)

    def gpu_bytes(self, fmt: str, itemsize: int = 2) -> int:
        """Bytes on the device when served as `fmt` (RUNTIME_FORMATS, or a GGUF type: bf16's)."""
        n = self.plain_numel * itemsize
        for _, rows, cols in self.targets:
            n += self._layer_bytes(fmt, rows, cols, itemsize)
        return n

    def layer_bytes(self, fmt: str, itemsize: int = 2) -> dict[int, int]:
        out: dict[int, int] = {}
        for layer, rows, cols in self.targets:
            out[layer] = out.get(layer, 0) + self._layer_bytes(fmt, rows, cols, itemsize)
        return out

    @staticmethod
    def _layer_bytes(fmt: str, rows: int, cols: int, itemsize: int) -> int:
        if fmt in ("bf16",) + FILE_FORMATS:
            return rows * cols * itemsize
        if fmt in ("int8", "fp8-only"):
            return rows * cols + 4 * rows
        if fmt == "fp8":
            return rows * cols + 4 * rows + rows * cols * itemsize
        raise ValueError(f"unknown format {fmt!r} ({', '.join(RUNTIME_FORMATS + FILE_FORMATS)})")

    def file_bytes(self, layer_types: dict[int, str] | str, itemsize: int = 2) -> int:
        """The GGUF file's tensor bytes with each layer's targets in `layer_types` (a GGUF type, or "bf16";
        one type for all layers as a string), everything else in the source precision."""
        n = self.plain_numel * itemsize
        for layer, rows, cols in self.targets:
            typ = layer_types if isinstance(layer_types, str) else layer_types.get(layer, "bf16")
            n += int(rows * cols * GGUF_BYTES_PER_WEIGHT.get(typ, itemsize))
        return n

    @property
    def num_params(self) -> int:
        return self.plain_numel + sum(r * c for _, r, c in self.targets)


def branch_weights(cfg, branch: str) -> BranchWeights:
    """The weights of an engine's branch ("und" / "gen"), from the model built on the meta device."""
    import torch

    from .model import BRANCHES, NeoModel
    from .quant import fp8_eligible, target_linears
    with torch.device("meta"):
        model = NeoModel(cfg, branch)
    targets, target_ids = [], set()
    for owner, name, full in target_linears(model, BRANCHES[branch]):
        lin = getattr(owner, name)
        if not fp8_eligible(lin):
            continue
        layer = int(full.split(".")[3])
        targets.append((layer, lin.out_features, lin.in_features))
        target_ids.add(id(lin.weight))
    plain = sum(p.numel() for p in model.parameters() if id(p) not in target_ids)
    plain += sum(b.numel() for b in model.buffers())
    return BranchWeights(branch, plain, targets)


# ----------------------------------------------------------------------------------------------- engines
@dataclass
class Settings:
    """What a deployment runs with (the `u1serve up` flags the plan reads)."""
    und_format: str = "bf16"
    gen_format: str = "bf16"
    itemsize: int = 2                     # model dtype
    max_image_side: int = 2048            # the largest allowed side (the caller passes the checkpoint's trained one)
    cfg_branches: int = 2                 # CFG: cond + uncond rows per step
    edit_branches: int = 3                # an edit: cond, text-uncond, image-uncond, each with the input image
    max_running_jobs: int = 16            # generation's --max-running-jobs: jobs whose KV buffers live at once
    cuda_graphs: bool = True
    kv_cache_tokens: int = 65536          # understanding's --kv-cache-tokens (lowered to fit under a fraction)
    max_running: int = 256
    max_model_len: int = 32768
    kv_pool_gb: float = 16.0
    kv_page_tokens: int = 64
    max_batch_tokens: int = 8192          # generation's --max-batch-tokens (generation config.BATCH_TOKENS)
    context_bytes: int = CUDA_CONTEXT_BYTES


@dataclass
class EnginePlan:
    name: str
    fmt: str
    parts: dict[str, int] = field(default_factory=dict)   # name -> bytes on the GPU
    notes: list[str] = field(default_factory=list)
    fits: bool = True
    kv_tokens: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def image_tokens(side: int) -> int:
    from services.contract.limits import IMAGE_BLOCK
    return (side // IMAGE_BLOCK) ** 2


def und_plan(cfg, w: BranchWeights, s: Settings, kv_tokens: int | None = None) -> EnginePlan:
    """The understanding engine with `kv_tokens` KV slots (default --kv-cache-tokens)."""
    llm = cfg.llm
    per_token = kv_bytes_per_token(llm.num_hidden_layers, llm.num_key_value_heads, llm.head_dim, s.itemsize)
    slots = s.kv_cache_tokens if kv_tokens is None else kv_tokens
    weights = w.gpu_bytes(s.und_format, s.itemsize)
    e = EnginePlan("understanding", s.und_format)
    e.parts = {"weights": weights, "kv_cache": per_token * (slots + 1),
               "page_table": 4 * (s.max_running + 1) * (min(s.max_model_len, slots) + 1),
               "activations_graphs": UND_MIN_RESERVE, "cuda_context": s.context_bytes}
    e.kv_tokens = slots
    e.notes.append(f"KV cache {slots} tokens x {per_token / 1024:.0f} KiB")
    return e


def und_fit(cfg, w: BranchWeights, s: Settings, share: int, capped: bool = True) -> EnginePlan:
    """What engine._fit_kv_cache does under a memory share (`capped`: colocate, U1SERVE_GPU_MEMORY_FRACTION): the
    reserve, then as many KV tokens as fit (at least UND_MIN_KV_TOKENS, at most --kv-cache-tokens). Uncapped
    (separate) the engine takes --kv-cache-tokens as given: the tokens that fit, page table included, are what
    `--kv-cache-tokens` must say (up_flags)."""
    llm = cfg.llm
    per_token = kv_bytes_per_token(llm.num_hidden_layers, llm.num_key_value_heads, llm.head_dim, s.itemsize)
    alloc_share = share - s.context_bytes           # the fraction caps torch's allocator, not the context
    budget = alloc_share - w.gpu_bytes(s.und_format, s.itemsize)
    reserve = und_runtime_reserve(budget)
    fit = int((budget - reserve) // per_token)
    if not capped:      # the plan picks the flag: leave room for the page table and the scratch slot too
        fit -= 1 + -(-4 * (s.max_running + 1) * (s.max_model_len + 1) // per_token)
    e = und_plan(cfg, w, s, int(min(s.kv_cache_tokens, max(UND_MIN_KV_TOKENS, fit))))
    # the page table and the scratch slot are allocated after the engine's fit: they come out of its reserve
    e.parts["activations_graphs"] = reserve - (e.parts["page_table"] + per_token if capped else 0)
    e.fits = fit >= UND_MIN_KV_TOKENS       # else the engine's smallest KV cache overflows the share
    return e


def gen_plan(cfg, w: BranchWeights, s: Settings, side: int) -> EnginePlan:
    """The generation engine at its worst case with images of at most `side`²: the KV buffers of the running batch
    (the larger of one edit at `side`² with a `side`² input, each branch holding prefix + input + output tokens, and a
    full batch of --max-running-jobs small CFG jobs sharing --max-batch-tokens rows, each with its prefix), one
    step's activations (a job larger than --max-batch-tokens runs alone with all its rows), the CUDA graphs' pool."""
    llm = cfg.llm
    tokens = image_tokens(side)
    rows = max(tokens * s.edit_branches, s.max_batch_tokens)
    edit_kv = job_kv_bytes(llm, s.itemsize, REFERENCE_PREFIX_TOKENS + 2 * tokens, s.edit_branches)
    small = max(1, s.max_batch_tokens // (s.cfg_branches * s.max_running_jobs))
    batch_kv = s.max_running_jobs * job_kv_bytes(llm, s.itemsize, REFERENCE_PREFIX_TOKENS + min(small, tokens),
                                                 s.cfg_branches)
    h, inter = llm.hidden_size, llm.intermediate_size or llm.gen_moe_intermediate_size * llm.gen_num_experts_per_tok
    qkv = (llm.num_attention_heads + 2 * llm.num_key_value_heads) * llm.head_dim
    # live at a layer's widest point: residual, its norm, q|k|v, attention out, gate|up, silu*up, MLP out;
    # plus the fm head's pixels (3 x 32² per token, fp32) and the latent in fp32
    per_row = (3 * h + qkv + llm.num_attention_heads * llm.head_dim + 3 * inter) * s.itemsize
    head = tokens * 3 * cfg.token_pixels ** 2 * 4 * 2
    acts = rows * per_row + head
    e = EnginePlan("generation", s.gen_format)
    e.parts = {"weights": w.gpu_bytes(s.gen_format, s.itemsize),
               "job_kv": max(edit_kv, batch_kv),
               "activations": acts, "cuda_graphs": acts if s.cuda_graphs else 0, "cuda_context": s.context_bytes}
    e.notes.append(f"{side}x{side}: {tokens} image tokens, {rows} rows a step; KV: "
                   + ("an edit with a same-size input" if edit_kv >= batch_kv else
                      f"{s.max_running_jobs} small jobs x {s.cfg_branches} branches"))
    return e


# ----------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    mode: str
    budget: int
    side: int
    und: EnginePlan
    gen: EnginePlan
    fits: bool
    settings: Settings
    host_pool_bytes: int
    why: str = ""

    def as_dict(self, total: int | None = None) -> dict:
        """JSON-able; `total`: the card's bytes for the memory fractions (default: the budget)."""
        eng = lambda e: {"format": e.fmt, "total_bytes": e.total, "parts": e.parts, "notes": e.notes}  # noqa: E731
        env, argv = up_flags(self, total)
        return {"mode": self.mode, "budget_bytes": self.budget, "max_image_side": self.side, "fits": self.fits,
                "why": self.why, "env": env, "flags": argv, "host_kv_pool_bytes": self.host_pool_bytes,
                "understanding": eng(self.und), "generation": eng(self.gen)}


def host_pool_bytes(cfg, s: Settings) -> int:
    from shm_transfer import KVLayout
    from shm_transfer.pool import segment_bytes
    llm = cfg.llm
    dtype = {2: "bfloat16", 4: "float32"}[s.itemsize]
    layout = KVLayout(num_layers=llm.num_hidden_layers, num_kv_heads=llm.num_key_value_heads,
                      head_dim=llm.head_dim, dtype=dtype, page_tokens=s.kv_page_tokens)
    return segment_bytes(layout, int(s.kv_pool_gb * GiB))


def evaluate(cfg, weights: dict[str, BranchWeights], s: Settings, budget: int, mode: str) -> Plan:
    """One setting on one budget (colocate: both engines share `budget`; separate: each has a card of it)."""
    side = s.max_image_side
    gen = gen_plan(cfg, weights["gen"], s, side)
    colocate = mode == "colocate"
    und = und_fit(cfg, weights["und"], s, budget - gen.total if colocate else budget, capped=colocate)
    fits = und.fits and gen.total <= budget
    need = gen.total + und.total if mode == "colocate" else max(gen.total, und.total)
    why = "" if fits else f"needs {gib(need)} GiB with the smallest KV cache, for {gib(budget)} GiB"
    return Plan(mode, budget, side, und, gen, fits, s, host_pool_bytes(cfg, s), why)


def up_flags(p: "Plan", total: int | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment, `u1serve up` argv) of a plan: the formats, graphs, the largest image (the gateway refuses larger
    ones with a 400; below the size table's largest, generation's start-up warm-up of the table is off and the
    default size is the largest), and in colocate the memory fractions on a card of `total` bytes (default: the budget): each
    engine's share of the budget less the CUDA context, which the fraction (torch's allocator cap) does not cover."""
    s, env, argv = p.settings, {}, []
    if "fp8-only" in (s.gen_format, s.und_format):
        env["U1SERVE_FP8_MIN_TOKENS"] = "0"
    name = lambda f: f.replace("-only", "")   # noqa: E731
    if s.gen_format != "bf16":
        argv += ["--quantization", name(s.gen_format)]
    und_args = [f"--quantization {name(s.und_format)}"] if s.und_format != "bf16" else []
    if p.mode != "colocate" and p.und.kv_tokens < s.kv_cache_tokens:   # uncapped: the engine takes the flag as is
        und_args.append(f"--kv-cache-tokens {p.und.kv_tokens}")
    if und_args:
        argv += ["--und-args", " ".join(und_args)]
    if not s.cuda_graphs:
        argv += ["--cuda-graphs", "off"]
    gen_args = [f"--max-running-jobs {s.max_running_jobs}"] if s.max_running_jobs != Settings.max_running_jobs else []
    from services.contract.limits import SIZE_TABLE
    if any(w * h > p.side * p.side for w, h in SIZE_TABLE):    # generation warms the table at start (CUDA)
        gen_args.append("--warmup-table off")
        argv += ["--default-size", f"{p.side}x{p.side}"]
    if gen_args:
        argv += ["--gen-args", " ".join(gen_args)]
    argv += ["--gateway-args", f"--max-pixels {p.side * p.side}"]
    if p.mode == "colocate":
        total = total or p.budget
        gen = (p.gen.total - p.gen.parts["cuda_context"]) / total
        und = (p.budget - p.gen.total - p.und.parts["cuda_context"]) / total
        argv += ["--gen-memory-fraction", f"{gen:.3f}", "--und-memory-fraction", f"{und:.3f}"]
    return env, argv


def candidates(s: Settings):
    """Settings to try when the asked one does not fit, best first: the formats (each engine int8 alone, then both;
    fp8 without its bf16 copy), CUDA graphs off, fewer running generation jobs, then smaller images."""
    import dataclasses
    top = s.max_image_side
    formats = [(s.und_format, s.gen_format)]
    for pair in (("bf16", "int8"), ("int8", "bf16"), ("int8", "int8"), ("fp8-only", "fp8-only")):
        if pair not in formats:
            formats.append(pair)
    for side in [top] + [x for x in IMAGE_SIDES if x < top]:
        for und_f, gen_f in formats:
            for graphs in dict.fromkeys((s.cuda_graphs, False)):
                for jobs in dict.fromkeys((s.max_running_jobs, 8, 4, 2)):
                    yield dataclasses.replace(s, und_format=und_f, gen_format=gen_f, cuda_graphs=graphs,
                                              max_image_side=side, max_running_jobs=jobs)


def plan(cfg, s: Settings, budget: int, mode: str = "colocate", weights: dict | None = None) -> dict:
    """The plan of `s` on `budget` and, when it does not fit, the first setting of `candidates` that does (None:
    nothing fits: weight streaming would be needed, out of scope here)."""
    weights = weights or {b: branch_weights(cfg, b) for b in ("und", "gen")}
    asked = evaluate(cfg, weights, s, budget, mode)
    fix = None
    if not asked.fits:
        fix = next((p for p in (evaluate(cfg, weights, c, budget, mode) for c in candidates(s)) if p.fits), None)
    return {"asked": asked, "fix": fix, "weights": weights}


def weight_table(weights: dict[str, BranchWeights], itemsize: int = 2, groups: int = 6) -> list[dict]:
    """Per branch and format: GPU bytes and file bytes, and the quantised layers' GPU bytes per layer group."""
    rows = []
    for branch, w in weights.items():
        for fmt in RUNTIME_FORMATS + FILE_FORMATS:
            per_layer = w.layer_bytes(fmt, itemsize)
            n = max(per_layer) + 1 if per_layer else 0
            step = max(1, -(-n // groups))
            by_group = {f"{a}-{min(a + step, n) - 1}": sum(per_layer.get(i, 0) for i in range(a, min(a + step, n)))
                        for a in range(0, n, step)}
            file_fmt = fmt if fmt in FILE_FORMATS else "bf16"
            rows.append({"branch": branch, "format": fmt, "gpu_bytes": w.gpu_bytes(fmt, itemsize),
                         "file_bytes": w.file_bytes(file_fmt, itemsize) if fmt in FILE_FORMATS + ("bf16",)
                         else None, "layer_groups": by_group})
    return rows


def load_peak_note(e: EnginePlan, w: BranchWeights, itemsize: int = 2) -> str | None:
    """A format quantised at load from a float checkpoint: the engine holds the float weights on the GPU before it
    quantises them (services/model/loader.py), so its load peaks at those. Where that is over the engine's cap the
    checkpoint must be converted first (measured: int8 / int8 under a 24 GiB cap on an H100 ran out of memory at
    load, 2026-12-06)."""
    if e.fmt == "bf16" or e.fmt in FILE_FORMATS:
        return None
    float_bytes = w.gpu_bytes("bf16", itemsize)
    cap = e.total - e.parts.get("cuda_context", 0)
    if float_bytes <= cap:
        return None
    scheme = e.fmt.replace("-only", "")
    return (f"  {e.name}: loading a float checkpoint peaks at its {gib(float_bytes)} GiB of float weights, over "
            f"this engine's {gib(cap)} GiB: convert it first (`u1serve convert MODEL OUT --to {scheme}`) and "
            f"serve OUT")


def render(result: dict, total: int | None = None, itemsize: int = 2) -> str:
    """The plan as text: the weights table, then each engine's parts, fit, and the flags that make it fit."""
    lines = ["weights by branch and format (GiB on the GPU; GGUF: the file, dequantised to bf16 at load)"]
    lines.append(f"  {'branch':6} {'format':9} {'GPU':>7} {'file':>7}  quantised layers by group (GPU GiB)")
    for r in weight_table(result["weights"], itemsize):
        groups = " ".join(f"{k}:{gib(v)}" for k, v in r["layer_groups"].items())
        file_ = gib(r["file_bytes"]) if r["file_bytes"] is not None else "-"
        lines.append(f"  {r['branch']:6} {r['format']:9} {gib(r['gpu_bytes']):>7} {file_:>7}  {groups}")
    for title, p in (("asked", result["asked"]), ("fits with", result["fix"])):
        if p is None:
            if not result["asked"].fits:
                lines.append("\nnothing fits this budget in any format, size or graph setting: the branches' weights "
                             "alone exceed it (weight streaming is not implemented)")
            continue
        lines.append(f"\n{title}: mode {p.mode}, budget {gib(p.budget)} GiB, largest image {p.side}x{p.side}: "
                     f"{'FITS' if p.fits else 'DOES NOT FIT (' + p.why + ')'}")
        for e in (p.und, p.gen):
            parts = ", ".join(f"{k} {gib(v)}" for k, v in e.parts.items())
            lines.append(f"  {e.name:13} {e.fmt:8} {gib(e.total):>6} GiB = {parts}; {'; '.join(e.notes)}")
        lines.append(f"  host shared memory: KV pool {gib(p.host_pool_bytes)} GiB (not GPU)")
        lines += [n for n in (load_peak_note(p.und, result["weights"]["und"], itemsize),
                              load_peak_note(p.gen, result["weights"]["gen"], itemsize)) if n]
        env, argv = up_flags(p, total)
        lines.append("  flags: " + " ".join([f"{k}={v}" for k, v in env.items()] + ["u1serve up", shlex.join(argv)]))
    return "\n".join(lines) + "\n"
