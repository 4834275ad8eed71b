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
- the shared KV pool: host shared memory, not GPU (shm_transfer.pool.segment_bytes); in the fused colocate mode
  (`--colocate-engines fused`: one process, both engines, `--kv-transport device`) its pages are device memory,
  allocated in understanding's share before it fits its KV cache, and the process has ONE runtime overhead; a
  plan fits only where one request's share of the pool holds the largest image request's prefixes
  (`prefix_pool_pages`), else that request is 400 kv_request_too_large;
- generation: one job's KV buffer at the largest allowed image (capacity.py's layout: layers x 2 x (prefix +
  image tokens) x kv heads x head_dim, per CFG branch), the activations of one denoise step of that job (rows =
  image tokens x CFG branches, at most --max-batch-tokens: the widest live tensors of one decoder layer),
  the CUDA graphs' private pool (one more copy of those activations when graphs are on);
- runtime overhead: the CUDA context + library workspaces of each process, outside torch's allocator and so
  outside `set_per_process_memory_fraction` (CUDA_CONTEXT_BYTES, an estimate the GPU run checks:
  bench/gpu_memcap.sh);
- the load peak of a format quantised at load (int8 / fp8 from a float checkpoint): the quantised weights plus one
  decoder layer's float weights (the loader quantises each layer as it reads it: layerwise_load.py);
- generation with weight streaming (--weight-streaming-layers K, services/model/weight_streaming.py): on the device
  the weights outside the decoder layers + K layers' slots (no CUDA graphs: streaming turns them off), every layer in
  pinned host memory (not GPU); the fit search tries K = STREAMING_LAYERS only where the largest size asked fits in
  no other format, graph or batch setting, before it tries a smaller size.
The API's image limits (the token block, the size table generation warms) come in from the caller (ImageLimits:
the launcher passes services.contract.limits' values), so this model-layer module does not import the contract.
The activation and context figures are the only estimates; weights and KV are exact (tests/model/test_memory_plan.py
checks them against what the tiny checkpoint allocates in each format).
"""
from __future__ import annotations

import math

import re
import shlex
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20
CUDA_CONTEXT_BYTES = 768 * MiB          # per engine process: CUDA context, cuBLAS / cuDNN workspaces (estimate)
UND_MIN_RESERVE = 2 * GiB               # understanding: activations, decode and prefill CUDA graphs (the prefill
                                        # graphs up to 1,024 tokens: 584 MiB on an H100, 8B), sampling ...
INT8_PRODUCT_BYTES = 4                   # an int8 GEMM's int32 product, made fp32 in place (kernels/int8_gemm.py)
UND_RESERVE_SHARE = 0.1                 # ... or this share of its budget, whichever is more (engine._fit_kv_cache)
UND_MIN_KV_TOKENS = 1024                # the engine never sizes its KV cache below this
REFERENCE_PREFIX_TOKENS = 512           # a job's text prefix (generation/capacity.py's reference job)
# understanding's context must hold the largest prompt an image request brings at the largest size: an edit (or an
# interleaved turn) with one side² input image and up to this much text (measured on the 8B tokenizer at 1024²:
# an edit prefix 1,469 tokens, an interleaved turn 1,824, a thinking text-to-image cond prefix 1,218)
UND_PROMPT_TEXT_TOKENS = 2 * REFERENCE_PREFIX_TOKENS
RUNTIME_FORMATS = ("bf16", "fp8", "fp8-only", "int8")   # what a GPU holds
FILE_FORMATS = ("q8_0", "q4_k")                          # GGUF: dequantised at load
GGUF_BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_k": 144 / 256}
FUSED_POOL_GB = (1.0, 0.5)               # smaller device KV pools the fused plan tries (fewer prefixes in flight)
IMAGE_SIDES = (4096, 3072, 2048, 1792, 1536, 1280, 1024, 768, 512)   # fallbacks the plan tries, largest first
STREAMING_LAYERS = 2    # device slots the fit search tries for generation's weight streaming (one computing, one ahead)


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
    layer_plain_numel: int = 0                     # of plain_numel: inside the decoder layers (their norms)
    num_layers: int = 0

    def one_layer_bytes(self, fmt: str, itemsize: int = 2) -> int:
        """One decoder layer in `fmt` (every layer has the same layout): what a weight-streaming slot holds."""
        plain = self.layer_plain_numel // max(self.num_layers, 1) * itemsize
        return plain + max(self.layer_bytes(fmt, itemsize).values(), default=0)

    def streamed_gpu_bytes(self, fmt: str, slots: int, itemsize: int = 2) -> int:
        """Device bytes with weight streaming: everything outside the decoder layers + `slots` layers."""
        one = self.one_layer_bytes(fmt, itemsize)
        return self.gpu_bytes(fmt, itemsize) - self.num_layers * one + min(slots, self.num_layers) * one

    def host_layer_bytes(self, fmt: str, itemsize: int = 2) -> int:
        """Pinned host bytes with weight streaming: every decoder layer."""
        return self.num_layers * self.one_layer_bytes(fmt, itemsize)

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

    from .model import BRANCHES
    from .skeleton import skeleton
    from .quant import fp8_eligible, target_linears
    model = skeleton(cfg, branch)
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
    layers = model.language_model.model.layers
    in_layers = sum(p.numel() for p in layers.parameters() if id(p) not in target_ids)
    in_layers += sum(b.numel() for b in layers.buffers())
    return BranchWeights(branch, plain, targets, in_layers, len(layers))


# ----------------------------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class ImageLimits:
    """The API's image limits the plan sizes generation by (services/contract/limits.py, passed in by the launcher)."""
    block: int                            # pixels per image-token side (IMAGE_BLOCK)
    sizes: tuple                          # the size table generation warms at start ((w, h), ...: SIZE_TABLE)


@dataclass
class Settings:
    """What a deployment runs with (the `u1serve up` flags the plan reads)."""
    images: ImageLimits
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
    max_prefix_pool_share: float = 0.5   # understanding's --max-prefix-pool-share: one request's share of the pool
    engines: str = "processes"            # colocate: --colocate-engines (fused: one process, the pool on the device)
    max_batch_tokens: int = 8192          # generation's --max-batch-tokens (generation config.BATCH_TOKENS)
    weight_streaming_layers: int = 0      # generation's --weight-streaming-layers (0: every layer resident)
    streaming_fallback: int = STREAMING_LAYERS   # what the fit search may try for it (0: never)
    rl_waiting_bytes: int = 0             # with --enable-rl: rollouts' states waiting for their segments (generation
                                          # config.RL_WAITING_BYTES, passed in by the launcher)
    context_bytes: int = CUDA_CONTEXT_BYTES


@dataclass
class EnginePlan:
    name: str
    fmt: str
    parts: dict[str, int] = field(default_factory=dict)   # name -> bytes on the GPU
    notes: list[str] = field(default_factory=list)
    fits: bool = True
    kv_tokens: int = 0
    step_rows: int = 0          # generation: the most rows one denoise step may take (the gateway's --max-step-pixels)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def image_tokens(side: int, block: int) -> int:
    """Image tokens of a `side`² image with `block`-pixel tokens."""
    return (side // block) ** 2


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


def und_prompt_tokens(side: int, block: int) -> int:
    """The KV tokens understanding needs for the largest image request at `side`² (UND_PROMPT_TEXT_TOKENS)."""
    return UND_PROMPT_TEXT_TOKENS + image_tokens(side, block)


def prefix_pool_pages(side: int, block: int, page_tokens: int) -> int:
    """KV pool pages the largest image request's prefixes take at `side`²: an edit with a `side`² input over its
    three branches (cond: the image and up to UND_PROMPT_TEXT_TOKENS of text; img_cond: the image; uncond: a
    page of template). A smaller device pool refuses that request 400 kv_request_too_large."""
    pages = lambda t: -(-t // page_tokens)   # noqa: E731
    img = image_tokens(side, block)
    return pages(img + UND_PROMPT_TEXT_TOKENS) + pages(img + page_tokens) + 1


def page_bytes(cfg, s: Settings) -> int:
    llm = cfg.llm
    return s.kv_page_tokens * kv_bytes_per_token(llm.num_hidden_layers, llm.num_key_value_heads, llm.head_dim,
                                                 s.itemsize)


def pool_gb_for_prefixes(cfg, s: Settings, side: int) -> float:
    """The smallest KV pool (in steps of 0.5 GiB) where one request's share holds the largest prefixes at side²."""
    need = prefix_pool_pages(side, s.images.block, s.kv_page_tokens) / s.max_prefix_pool_share
    return math.ceil(need * page_bytes(cfg, s) / (GiB / 2)) / 2


def und_fit(cfg, w: BranchWeights, s: Settings, share: int, capped: bool = True, pool: int = 0,
            need_tokens: int = UND_MIN_KV_TOKENS) -> EnginePlan:
    """What engine._fit_kv_cache does under a memory share (`capped`: colocate, U1SERVE_GPU_MEMORY_FRACTION): the
    reserve, then as many KV tokens as fit (at least UND_MIN_KV_TOKENS, at most --kv-cache-tokens). Uncapped
    (separate) the engine takes --kv-cache-tokens as given: the tokens that fit, page table included, are what
    `--kv-cache-tokens` must say (up_flags). `pool`: device KV pool pages allocated in this share before the fit
    (fused: the understanding service creates the pool before its engine loads). `need_tokens`: the context the
    largest image request needs (und_prompt_tokens): a KV cache below it does not fit."""
    llm = cfg.llm
    per_token = kv_bytes_per_token(llm.num_hidden_layers, llm.num_key_value_heads, llm.head_dim, s.itemsize)
    alloc_share = share - s.context_bytes           # the fraction caps torch's allocator, not the context
    budget = alloc_share - w.gpu_bytes(s.und_format, s.itemsize) - pool
    reserve = und_runtime_reserve(budget)
    fit = int((budget - reserve) // per_token)
    if not capped:      # the plan picks the flag: leave room for the page table and the scratch slot too
        fit -= 1 + -(-4 * (s.max_running + 1) * (s.max_model_len + 1) // per_token)
    e = und_plan(cfg, w, s, int(min(s.kv_cache_tokens, max(UND_MIN_KV_TOKENS, fit))))
    # the page table and the scratch slot are allocated after the engine's fit: they come out of its reserve
    e.parts["activations_graphs"] = reserve - (e.parts["page_table"] + per_token if capped else 0)
    e.fits = fit >= max(UND_MIN_KV_TOKENS, need_tokens)   # else the smallest KV cache overflows the share, or
    if fit >= UND_MIN_KV_TOKENS and not e.fits:              # the context cannot hold the largest image prompt
        e.notes.append(f"the largest image request's prompt needs {need_tokens} tokens of context")
    return e


def gen_plan(cfg, w: BranchWeights, s: Settings, side: int) -> EnginePlan:
    """The generation engine at its worst case with images of at most `side`²: the KV buffers of the running batch
    (the larger of one edit at `side`² with a `side`² input, each branch holding prefix + input + output tokens, and a
    full batch of --max-running-jobs small CFG jobs sharing --max-batch-tokens rows, each with its prefix), one
    step's activations (a job larger than --max-batch-tokens runs alone with all its rows), the CUDA graphs' pool."""
    llm = cfg.llm
    tokens = image_tokens(side, s.images.block)
    # a forward's rows: jobs batch up to --max-batch-tokens, but no more than the running jobs bring (a job larger
    # than that budget runs alone with all its rows). One request of n images x its branches is one job: the plan
    # counts the larger of one edit at `side`² and that batch, and the gateway refuses a request whose one job
    # would take more (--max-step-pixels: 400 request_too_large, e.g. n = 4 at the largest size)
    rows = max(tokens * s.edit_branches, min(s.max_batch_tokens, s.max_running_jobs * s.edit_branches * tokens))
    edit_kv = job_kv_bytes(llm, s.itemsize, REFERENCE_PREFIX_TOKENS + 2 * tokens, s.edit_branches)
    small = max(1, s.max_batch_tokens // (s.cfg_branches * s.max_running_jobs))
    batch_kv = s.max_running_jobs * job_kv_bytes(llm, s.itemsize, REFERENCE_PREFIX_TOKENS + min(small, tokens),
                                                 s.cfg_branches)
    h, inter = llm.hidden_size, llm.intermediate_size or llm.gen_moe_intermediate_size * llm.gen_num_experts_per_tok
    qkv = (llm.num_attention_heads + 2 * llm.num_key_value_heads) * llm.head_dim
    # live at a layer's widest point: residual, its norm, q|k|v, attention out, gate|up, silu*up, MLP out;
    # plus the fm head's pixels (3 x 32² per token, fp32) and the latent in fp32
    per_row = (3 * h + qkv + llm.num_attention_heads * llm.head_dim + 3 * inter) * s.itemsize
    from kernels.int8_gemm import PRODUCT_BLOCK_ROWS
    product = 0
    if s.gen_format == "int8":   # W8A8's widest GEMM (gate|up) also holds its int32 product beside the output,
        product = min(rows, PRODUCT_BLOCK_ROWS) * max(2 * inter, qkv) * INT8_PRODUCT_BYTES   # made in row blocks
    head = tokens * 3 * cfg.token_pixels ** 2 * 4 * 2
    acts = rows * per_row + product + head
    e = EnginePlan("generation", s.gen_format, step_rows=rows)
    k = s.weight_streaming_layers
    e.parts = {"weights": w.streamed_gpu_bytes(s.gen_format, k, s.itemsize) if k else w.gpu_bytes(s.gen_format, s.itemsize),
               "job_kv": max(edit_kv, batch_kv),
               "activations": acts, "cuda_graphs": acts if s.cuda_graphs and not k else 0,
               "cuda_context": s.context_bytes}
    if s.rl_waiting_bytes:
        # RL rollouts' states waiting for their segments: the budget, or one state of a step's largest job alone
        # (n x 3 f32 a pixel, and a step's rows >= n x pixels / token_pixels²)
        e.parts["rl_states"] = max(s.rl_waiting_bytes, rows * cfg.token_pixels ** 2 * 3 * 4)
    e.notes.append(f"{side}x{side}: {tokens} image tokens, {rows} rows a step; KV: "
                   + ("an edit with a same-size input" if edit_kv >= batch_kv else
                      f"{s.max_running_jobs} small jobs x {s.cfg_branches} branches"))
    if k:
        e.notes.append(f"weight streaming: {min(k, w.num_layers)} of {w.num_layers} decoder layers on the device, "
                       f"all in pinned host memory, no CUDA graphs")
    return e


def host_pinned_bytes(w: BranchWeights, s: Settings) -> int:
    """Generation's pinned host memory: its decoder layers with weight streaming, else none."""
    return w.host_layer_bytes(s.gen_format, s.itemsize) if s.weight_streaming_layers else 0


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
    process: dict[str, int] = field(default_factory=dict)   # fused: the one process's device bytes beside the engines
    load_peaks: dict[str, int] = field(default_factory=dict)  # engine name -> its load peak (quantised at load)
    host_pinned: int = 0      # generation's decoder layers in pinned host memory (weight streaming)

    @property
    def device_total(self) -> int:
        """What the card holds (colocate: both engines and the fused process's parts; separate: the larger card)."""
        if self.mode != "colocate":
            return max(self.und.total, self.gen.total)
        return self.und.total + self.gen.total + sum(self.process.values())

    def as_dict(self, total: int | None = None) -> dict:
        """JSON-able; `total`: the card's bytes for the memory fractions (default: the budget)."""
        eng = lambda e: {"format": e.fmt, "total_bytes": e.total, "parts": e.parts, "notes": e.notes,  # noqa: E731
                         "load_peak_bytes": self.load_peaks.get(e.name), "step_rows": e.step_rows}
        env, argv = up_flags(self, total)
        return {"mode": self.mode, "colocate_engines": self.settings.engines, "budget_bytes": self.budget,
                "max_image_side": self.side, "fits": self.fits, "why": self.why, "env": env, "flags": argv,
                "device_total_bytes": self.device_total, "host_kv_pool_bytes": self.host_pool_bytes,
                "host_pinned_bytes": self.host_pinned, "weight_streaming_layers": self.settings.weight_streaming_layers,
                "process": self.process, "understanding": eng(self.und), "generation": eng(self.gen)}


def fused(s: Settings, mode: str) -> bool:
    return mode == "colocate" and s.engines == "fused"


def pool_bytes(cfg, s: Settings, on_device: bool = False) -> tuple[int, int]:
    """(host shared memory, device) bytes of the KV pool: its segment in host shared memory, and with
    `on_device` (the fused mode's device transport) its pages in device memory and only the header and page table
    in the segment (shm_transfer.pool.segment_bytes)."""
    from shm_transfer import KVLayout
    from shm_transfer.pool import segment_bytes
    llm = cfg.llm
    dtype = {2: "bfloat16", 4: "float32"}[s.itemsize]
    layout = KVLayout(num_layers=llm.num_hidden_layers, num_kv_heads=llm.num_key_value_heads,
                      head_dim=llm.head_dim, dtype=dtype, page_tokens=s.kv_page_tokens)
    size = int(s.kv_pool_gb * GiB)
    host = segment_bytes(layout, size, device_pages=on_device)
    return host, (segment_bytes(layout, size) - host if on_device else 0)


def host_pool_bytes(cfg, s: Settings) -> int:
    return pool_bytes(cfg, s)[0]


def evaluate(cfg, weights: dict[str, BranchWeights], s: Settings, budget: int, mode: str) -> Plan:
    """One setting on one budget (colocate: both engines share `budget`; separate: each has a card of it). Fused:
    one process holds both engines, the device KV pool (in understanding's share, before its KV fit) and one
    runtime overhead; the engines' own parts carry no context then."""
    import dataclasses
    side = s.max_image_side
    one = fused(s, mode)
    host, device_pool = pool_bytes(cfg, s, on_device=one)
    process = {"kv_pool": device_pool, "cuda_context": s.context_bytes} if one else {}
    es = dataclasses.replace(s, context_bytes=0) if one else s
    gen = gen_plan(cfg, weights["gen"], es, side)
    colocate = mode == "colocate"
    share = budget - gen.total - sum(process.values()) if colocate else budget
    und = und_fit(cfg, weights["und"], es, share + device_pool, capped=colocate, pool=device_pool,
                  need_tokens=und_prompt_tokens(side, s.images.block))
    p = Plan(mode, budget, side, und, gen, False, s, host, process=process)
    need_pages = prefix_pool_pages(side, s.images.block, s.kv_page_tokens)
    pool_pages = int(s.kv_pool_gb * GiB) // page_bytes(cfg, s)
    pool_ok = need_pages <= max(1, int(s.max_prefix_pool_share * pool_pages))
    p.fits = und.fits and pool_ok and gen.total + sum(process.values()) <= budget
    if not p.fits:
        p.why = (f"needs {gib(p.device_total)} GiB with the smallest KV cache, for {gib(budget)} GiB"
                 if p.device_total > budget else
                 f"understanding's KV cache ({und.kv_tokens} tokens) cannot hold the largest image request's prompt at "
                 f"{side}x{side} ({und_prompt_tokens(side, s.images.block)} tokens)" if not und.fits else
                 f"the KV pool ({pool_pages} pages of {s.kv_page_tokens} tokens; one request may take "
                 f"{s.max_prefix_pool_share:g} of it) cannot hold the largest image request's prefixes at "
                 f"{side}x{side} ({need_pages} pages)")
    p.load_peaks = {e.name: peak for e, w, k in ((und, weights["und"], 0),
                                                 (gen, weights["gen"], s.weight_streaming_layers))
                    if (peak := load_peak(e, w, s.itemsize, k)) is not None}
    p.host_pinned = host_pinned_bytes(weights["gen"], s)
    return p


def up_flags(p: "Plan", total: int | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment, `u1serve up` argv) of a plan: the formats, graphs, the largest image (the gateway refuses larger
    ones with a 400; below the size table's largest, generation's start-up warm-up of the table is off and the
    default size is the largest), and in colocate the memory fractions on a card of `total` bytes (default: the budget): each
    engine's share of the budget less the CUDA context, which the fraction (torch's allocator cap) does not cover."""
    s, env, argv = p.settings, {}, []
    if fused(s, p.mode):
        argv += ["--colocate-engines", "fused", "--kv-pool-gb", f"{s.kv_pool_gb:g}"]
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
    if s.weight_streaming_layers:
        gen_args.append(f"--weight-streaming-layers {s.weight_streaming_layers}")
    if any(w * h > p.side * p.side for w, h in s.images.sizes):    # generation warms the table at start (CUDA)
        gen_args.append("--warmup-table off")
        argv += ["--default-size", f"{p.side}x{p.side}"]
    if gen_args:
        argv += ["--gen-args", " ".join(gen_args)]
    argv += ["--gateway-args", f"--max-pixels {p.side * p.side} "
             f"--max-step-pixels {p.gen.step_rows * s.images.block ** 2}"]
    if p.mode == "colocate":
        total = total or p.budget
        # each engine's share less the runtime overhead (fused: one, the process's; understanding's share holds
        # the device pool, created before its KV fit)
        gen = (p.gen.total - p.gen.parts["cuda_context"]) / total
        und = (p.budget - p.gen.total - p.process.get("cuda_context", 0) - p.und.parts["cuda_context"]) / total
        # printed to 3 places: generation's share rounded up (its plan is what it needs), understanding's (the rest,
        # its KV cache fits itself to it) down, so the two never add up to more than the budget
        gen_up = math.ceil(gen * 1000) / 1000
        und_down = math.floor((und - (gen_up - gen)) * 1000) / 1000
        argv += ["--gen-memory-fraction", f"{gen_up:.3f}", "--und-memory-fraction", f"{und_down:.3f}"]
    return env, argv


def candidates(s: Settings, cfg=None):
    """Settings to try when the asked one does not fit, best first: the formats (each engine int8 alone, then both;
    fp8 without its bf16 copy), CUDA graphs off, fewer running generation jobs, (fused: a smaller device KV pool,
    FUSED_POOL_GB), then all of those again with generation's weight streaming (`streaming_fallback` layers; graphs
    off anyway), then smaller images."""
    import dataclasses
    top = s.max_image_side
    formats = [(s.und_format, s.gen_format)]
    for pair in (("bf16", "int8"), ("int8", "bf16"), ("int8", "int8"), ("fp8-only", "fp8-only")):
        if pair not in formats:
            formats.append(pair)
    streams = dict.fromkeys((s.weight_streaming_layers,) + ((s.streaming_fallback,) if s.streaming_fallback else ()))
    for side in [top] + [x for x in IMAGE_SIDES if x < top]:
        # fused: the pool the largest request's prefixes need at this size, then the asked one and smaller ones
        pools = dict.fromkeys(((pool_gb_for_prefixes(cfg, s, side),) if cfg is not None else ()) + (s.kv_pool_gb,)
                              + tuple(g for g in FUSED_POOL_GB if g < s.kv_pool_gb)
                              if s.engines == "fused" else (s.kv_pool_gb,))
        for k in streams:
            for und_f, gen_f in formats:
                for graphs in dict.fromkeys((s.cuda_graphs, False) if not k else (s.cuda_graphs,)):
                    for jobs in dict.fromkeys((s.max_running_jobs, 8, 4, 2)):
                        for pool in pools:
                            yield dataclasses.replace(s, und_format=und_f, gen_format=gen_f, cuda_graphs=graphs,
                                                      max_image_side=side, max_running_jobs=jobs, kv_pool_gb=pool,
                                                      weight_streaming_layers=k)


def plan(cfg, s: Settings, budget: int, mode: str = "colocate", weights: dict | None = None) -> dict:
    """The plan of `s` on `budget` and, when it does not fit, the first setting of `candidates` that does (None:
    nothing fits, not even with weight streaming)."""
    weights = weights or {b: branch_weights(cfg, b) for b in ("und", "gen")}
    asked = evaluate(cfg, weights, s, budget, mode)
    fix = None
    if not asked.fits:
        fix = next((p for p in (evaluate(cfg, weights, c, budget, mode) for c in candidates(s, cfg)) if p.fits), None)
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


def load_peak(e: EnginePlan, w: BranchWeights, itemsize: int = 2, streaming: int = 0) -> int | None:
    """A format quantised at load from a float checkpoint: the loader quantises each decoder layer as soon as its
    weights are read (services/model/layerwise_load.py), so the load peaks at the quantised weights plus the largest
    layer's float weights (CPU-measured: tests/model/test_layerwise_load.py). With weight `streaming` each layer
    leaves for host memory once quantised: the weights outside the layers + one layer float and quantised. None:
    nothing is quantised at load."""
    if e.fmt == "bf16" or e.fmt in FILE_FORMATS:
        return None
    if streaming:
        return w.streamed_gpu_bytes(e.fmt, 0, itemsize) + w.one_layer_bytes("bf16", itemsize) + \
            w.one_layer_bytes(e.fmt, itemsize)
    return quantized_load_peak(w, e.fmt, itemsize)


def quantized_load_peak(w: BranchWeights, fmt: str, itemsize: int = 2) -> int:
    """`fmt`'s weights plus the largest decoder layer's float weights (what a layer-by-layer load holds at most)."""
    return w.gpu_bytes(fmt, itemsize) + max(w.layer_bytes("bf16", itemsize).values(), default=0)


def load_peak_line(p: Plan, e: EnginePlan) -> str | None:
    peak = p.load_peaks.get(e.name)
    if peak is None:
        return None
    pool = p.process.get("kv_pool", 0) if e.name == "understanding" else 0   # fused: made before the load
    cap = e.total - e.parts.get("cuda_context", 0) + pool
    # a converted checkpoint loads the same way (its tensors dequantised one at a time): no convert step helps here
    over = "" if peak + pool <= cap else f": OVER this engine's {gib(cap)} GiB share (give it a larger share)"
    if e.name == "generation" and p.settings.weight_streaming_layers:
        how = (f"the weights outside the decoder layers + one layer in float and {e.fmt}: each layer is quantised as "
               f"it loads, then leaves for host memory")
    else:
        how = f"the {e.fmt} weights + one layer's float weights: each layer is quantised as it loads"
    return f"  {e.name}: load peak {gib(peak)} GiB from a float checkpoint ({how}){over}"


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
                lines.append("\nnothing fits this budget in any format, size or graph setting, not even with "
                             "generation's weight streaming")
            continue
        lines.append(f"\n{title}: mode {p.mode}, budget {gib(p.budget)} GiB, largest image {p.side}x{p.side}: "
                     f"{'FITS' if p.fits else 'DOES NOT FIT (' + p.why + ')'}")
        for e in (p.und, p.gen):
            parts = ", ".join(f"{k} {gib(v)}" for k, v in e.parts.items())
            lines.append(f"  {e.name:13} {e.fmt:8} {gib(e.total):>6} GiB = {parts}; {'; '.join(e.notes)}")
        if p.process:
            lines.append(f"  fused process {gib(sum(p.process.values())):>15} GiB = KV pool pages on the device "
                         f"{gib(p.process['kv_pool'])} (in understanding's share), cuda_context "
                         f"{gib(p.process['cuda_context'])} (one process)")
            lines.append(f"  device total {gib(p.device_total)} GiB; host shared memory: the KV pool's page table "
                         f"{gib(p.host_pool_bytes)} GiB")
        else:
            lines.append(f"  host shared memory: KV pool {gib(p.host_pool_bytes)} GiB (not GPU)")
        if p.host_pinned:
            lines.append(f"  pinned host memory: generation's decoder layers {gib(p.host_pinned)} GiB (weight "
                         f"streaming; not GPU)")
        lines += [n for n in (load_peak_line(p, p.und), load_peak_line(p, p.gen)) if n]
        env, argv = up_flags(p, total)
        lines.append("  flags: " + " ".join([f"{k}={v}" for k, v in env.items()] + ["u1serve up", shlex.join(argv)]))
    return "\n".join(lines) + "\n"
