"""The generation engine's configuration: one frozen dataclass that every engine rank gets, declared once.

Each field is a flag of `services.generation.server` (kit.flags generates them: `--help` shows the defaults);
`config_from_args` builds it after parsing, resolving what depends on other flags or the environment (the
warm-up size on cpu, the CUDA-graph override). `ServerConfig` is the HTTP process's own settings (listen
address, queue, streams, encoder, RL store, and the slow-reader settings of kit.stream_settings), declared the
same way; the step-caching defaults for requests are perf_options.py's `--cache-*` flags (CacheDefaults).

A leaf: the constants the flags offer (batch budget, SP and CUDA-graph modes, the yield share) are declared here
and the modules that use them import them from here, so reading the config imports no torch
(tests/structure/test_config_leaves.py).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from services.base import knobs, timeouts
from services.kit import flags
from services.kit.flags import flag
from services.kit.stream_settings import StreamSettings
from services.model.constants import DTYPES, QUANTIZATIONS
from services.model.lora_spec import parse_lora_spec

# Image tokens per forward beyond which jobs run in turns (scheduler.py's module doc: the evidence).
BATCH_TOKENS = 8192
SP_MODES = ("ulysses", "kv-gather")        # how sequence-parallel ranks attend (sequence_parallel.py)
CUDA_GRAPH_MODES = ("auto", "on", "off")   # step_graph.py
CUDA_GRAPHS_ENV = knobs.CUDA_GRAPHS.name   # 0 | 1: overrides --cuda-graphs (off | on)
GRAPH_KEYS = ("job", "shape")              # what a step's graphs are keyed by (step_graph.py)
GRAPH_KEY_CHOICES = ("auto",) + GRAPH_KEYS  # --graph-keys: auto = shape where it applies, else job
YIELD_SHARE = 0.5                          # colocate QoS: at most this fraction of wall time yielding (qos.py)
YIELD_MAX_WAIT_S = 0.03                    # one wait for the colocated engine's decode step (~10 ms) (qos.py)
# How long the engine ranks wait for the shm KV pool before ready by default on CUDA (the understanding service
# creates it early in its start, so in `u1serve up` it is there long before generation's warm-up ends).
KV_POOL_WAIT_S = 30.0
# RL rollouts: the device memory the states of every running rollout may hold together while their trajectory
# segments are still being made on the side thread (rollout.py; one state at least; the memory plan counts it with
# --enable-rl). Four 512² rollouts of n = 8 hold five 25 MiB states each before it is reached, as the 128 MiB each
# of the per-rollout bound before.
RL_WAITING_BYTES = 512 << 20


@dataclass(frozen=True)
class GenerationConfig:
    model: str = field(metadata=flag("checkpoint directory"))
    device: str = field(default="cuda", metadata=flag("where the engine ranks run", choices=("cpu", "cuda")))
    dtype: str = field(default="bfloat16", metadata=flag("model dtype", choices=DTYPES))
    kv_pool_name: str = field(default="u1serve-kv", metadata=flag("shm_transfer pool to attach"))
    kv_pool_follow_handles: str = field(default="off", metadata=flag(
        "on: where no pool of --kv-pool-name exists, attach the shm pool each handle names (Ray replicas, whose "
        "understanding neighbours name their own pools); off: such a handle is 503 kv_pool_unavailable",
        choices=("on", "off")))
    kv_pool_wait_s: Optional[float] = field(default=None, metadata=flag(
        "before /health turns 200, wait this long for --kv-pool-name to appear and open it (pinned on CUDA) so the "
        f"first request does not; not there by then: opened on the first request (unset: {KV_POOL_WAIT_S:g} on "
        "cuda, 0 on cpu or with --kv-pool-follow-handles on: one look, no wait)"))
    # ranks
    cfg_parallel: int = field(default=1, metadata=flag("engine ranks; CFG branches are spread over them"))
    sp: int = field(default=1, metadata=flag(
        "sequence-parallel ranks per CFG rank: one image's tokens over N GPUs (engine ranks = --cfg-parallel x "
        "--sp; with --sp-mode ulysses N must divide the head counts)"))
    sp_mode: str = field(default="ulysses", metadata=flag(
        "how the --sp ranks attend: ulysses (two all-to-alls a layer, each rank a slice of the heads) or kv-gather "
        "(one all-gather of K/V a layer, each rank every KV head and its own query rows); no effect with --sp 1",
        choices=SP_MODES))
    yield_to: str = field(default="", metadata=flag(
        "colocate QoS: the shm page the understanding engine on these GPUs raises while it decodes (its "
        "--yield-signal); the ranks yield the GPU between layers", metavar="NAME"))
    yield_share: float = field(default=YIELD_SHARE, metadata=flag(
        "with --yield-to: at most this fraction of wall time spent yielding (0 < F <= 1)"))
    yield_max_wait_ms: float = field(default=1e3 * YIELD_MAX_WAIT_S, metadata=flag(
        "with --yield-to: the longest one wait for a decode step at a layer (or graph segment) boundary"))
    engine_unit: str = field(default="process", metadata=flag(
        "process: the engine ranks run as processes; thread: rank 0 as a thread of this server (one rank; the fused "
        "colocate mode runs both engines' loops in one process: services/fused)", choices=("process", "thread")))
    stream_priority: str = field(default="default", metadata=flag(
        "the CUDA stream priority of the engine loop (the fused mode: low, so decode blocks go first)",
        choices=("default", "high", "low")))
    gemm_check: str = field(default="auto", metadata=flag(
        "before serving, every distinct GEMM shape of the model at the warm-up sizes' row counts against fp32 on "
        "this device; a wrong one stops the start with its shape named (services/model/gemm_check.py: cuBLAS "
        "returned wrong values under an MPS SM cap). auto: on CUDA under an MPS cap or in a green context",
        choices=("auto", "on", "off")))
    green_sm_percent: int = field(default=0, metadata=flag(
        "the fused mode on CUDA: the engine loop's stream belongs to a CUDA green context holding this share of the "
        "SMs (rounded down to the device's granularity), so the rest are always free for understanding's decode "
        "steps (stream priority alone barely helps: services/model/streams.py); 0: the whole device"))
    # scheduling
    max_batch_tokens: int = field(default=BATCH_TOKENS, metadata=flag(
        "image tokens per forward (per rank): jobs batch while their rows fit, the others wait their turn (FIFO); "
        "a larger single job runs alone. The default is where batching stops paying (scheduler.py)"))
    max_running_jobs: int = field(default=16, metadata=flag("jobs in the running batch"))
    threads: int = field(default=0, metadata=flag("torch CPU threads per engine rank (0: torch's default)"))
    log_level: str = field(default="info", metadata=flag("log level of the server and the engine ranks"))
    # speed
    quantization: str = field(default="none", metadata=flag(
        "fp8: gen-branch Linear layers in fp8 e4m3 (needs compute capability >= 8.9 on CUDA; emulated on CPU)",
        choices=QUANTIZATIONS))
    lora: tuple[tuple[str, float], ...] = field(default=(), metadata=flag(
        "merge a LoRA into the gen branch at load (repeatable); adapters that name no gen-branch weight are "
        "skipped", metavar="PATH[:STRENGTH]", parse=parse_lora_spec, repeat=True))
    cuda_graphs: str = field(default="auto", metadata=flag(
        "replay each job composition's denoise layer stack from CUDA graphs (captured on its second step) where "
        "the step allows it: CUDA and no LoRA adapter rows (a step cache and --yield-to keep graphs: they run "
        "between graph segments). auto (the default) and on are the same: on wherever the device is CUDA, eager "
        f"on cpu; off: always eager. {CUDA_GRAPHS_ENV}=0|1 overrides the flag", choices=CUDA_GRAPH_MODES))
    graph_keys: str = field(default="auto", metadata=flag(
        "what the denoise step's CUDA graphs are keyed by. shape: the jobs' shapes (size, samples, branches, prefix "
        "lengths); the graph and its KV buffer outlive the jobs, and a later request of the same shape replays from "
        "its first step (an idle engine holds one composition's graphs and KV buffer, let go before a job of "
        "another shape is admitted; 1024² 8 steps through the API 0.437 -> 0.323 s on an H100). job: the running "
        "jobs themselves (each request runs an eager and a capturing step before it replays). auto (the default): "
        "shape with one engine rank (--cfg-parallel 1 --sp 1) where CUDA graphs are on, job otherwise; shape is "
        "refused with --sp > 1 and where CUDA graphs are off",
        choices=GRAPH_KEY_CHOICES))
    graph_segment_layers: int = field(default=4, metadata=flag(
        "with --yield-to: graphed steps replay the layer stack in graphs of this many layers and yield between "
        "them (a decode step waits at most one segment; the segments share one memory pool)"))
    default_size: Optional[str] = field(default=None, metadata=flag(
        "the gateway's default image size, warmed up before /health turns 200 (unset: 2048x2048 on cuda, none "
        "on cpu)"))
    warmup_sizes: str = field(default="", metadata=flag(
        "more sizes to warm up with --warmup-steps, e.g. 1024x1024,1536x2720"))
    warmup_table: str = field(default="auto", metadata=flag(
        "warm every size of the size table (services/contract/limits.py SIZE_TABLE) with one step per branch count "
        "before ready: auto = on cuda, off on cpu (no JIT or kernel plans to build)", choices=("auto", "on", "off")))
    warmup_steps: int = field(default=2, metadata=flag(
        "denoising steps per warm-up job of --default-size and --warmup-sizes (0: no warm-up at all)"))
    weight_streaming_layers: int = field(default=0, metadata=flag(
        "keep the decoder layers in pinned host memory and only this many on the device, each copied in just "
        "before its forward and the next ones prefetched on a side stream (services/model/weight_streaming.py): "
        "the gen branch's weights on the device shrink to the non-layer weights + N layers, for larger images on a "
        "small card; costs host memory (every layer) and, where a step computes for less time than the copies "
        "take, speed. 0: off (every layer resident). Turns --cuda-graphs auto off"))
    # RL
    rl_reference: str = field(default="on", metadata=flag(
        "RL scoring against a frozen copy of the start weights (loaded on first use: one more copy of the gen "
        "branch in device memory)", choices=("on", "off")))

    def __post_init__(self) -> None:
        flags.check_choices(self)
        for name, value in (("--cfg-parallel", self.cfg_parallel), ("--sp", self.sp)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.graph_segment_layers < 1:
            raise ValueError("--graph-segment-layers must be >= 1")
        if self.graph_keys == "shape" and self.sp > 1:
            raise ValueError("--graph-keys shape is for one sequence-parallel rank (--sp 1): under SP the graphs "
                             "bake in each job's row layout and collectives, so they stay keyed by job")
        if self.graph_keys == "shape" and (self.cuda_graphs == "off" or self.weight_streaming_layers):
            raise ValueError("--graph-keys shape keys CUDA graphs, which are off here (--cuda-graphs off, "
                             "U1SERVE_CUDA_GRAPHS=0 or --weight-streaming-layers): it would change nothing")
        if self.kv_pool_wait_s is not None and self.kv_pool_wait_s < 0:
            raise ValueError("--kv-pool-wait-s must be >= 0")
        if not 0 < self.yield_share <= 1:
            raise ValueError(f"--yield-share must be in (0, 1], got {self.yield_share}")
        if self.yield_max_wait_ms <= 0:
            raise ValueError(f"--yield-max-wait-ms must be > 0, got {self.yield_max_wait_ms}")
        if self.engine_unit == "thread" and self.cfg_parallel * self.sp != 1:
            raise ValueError("--engine-unit thread runs one engine rank: it needs --cfg-parallel 1 and --sp 1")
        if not 0 <= self.green_sm_percent < 100:
            raise ValueError(f"--green-sm-percent must be in [0, 100), got {self.green_sm_percent}")
        self._check_weight_streaming()
        if self.green_sm_percent and self.engine_unit != "thread":
            raise ValueError("--green-sm-percent is for the fused mode (--engine-unit thread): a process of its own "
                             "shares the GPU through MPS's --gen-sm-percent instead")

    def _check_weight_streaming(self) -> None:
        """Where streaming cannot work, say why at start rather than serve wrong or slow."""
        n = self.weight_streaming_layers
        if n < 0:
            raise ValueError(f"--weight-streaming-layers must be >= 0 (0: off), got {n}")
        if not n:
            return
        if self.cuda_graphs == "on":
            raise ValueError("--weight-streaming-layers needs --cuda-graphs off (or auto): a graph bakes in the "
                             "device address of every weight it reads, and streamed layers change slots each step")
        if self.world > 1:
            raise ValueError("--weight-streaming-layers runs on one engine rank (--cfg-parallel 1 --sp 1): every "
                             "rank would hold its own pinned host copy of all layers, and a host with several GPUs "
                             "has the device memory to keep the branch resident (split it with --sp instead)")

    @property
    def step_graph_keys(self) -> str:
        """--graph-keys resolved (job | shape): auto is shape where it applies and was measured (one engine rank,
        CUDA graphs not off, no weight streaming), job otherwise (CFG-parallel ranks may ask for shape by name)."""
        if self.graph_keys != "auto":
            return self.graph_keys
        applies = self.world == 1 and self.cuda_graphs != "off" and not self.weight_streaming_layers
        return "shape" if applies else "job"

    @property
    def world(self) -> int:
        """Engine ranks: CFG ranks x sequence-parallel ranks."""
        return self.cfg_parallel * self.sp


@dataclass(frozen=True)
class ServerConfig(StreamSettings):
    host: str = field(default="127.0.0.1", metadata=flag("listen address"))
    port: int = field(default=8200, metadata=flag("listen port"))
    internal_token: Optional[str] = field(default=None, metadata=flag(
        "the stack's internal token (visible in /proc: prefer the file or the environment)"))
    internal_token_file: Optional[str] = field(default=None, metadata=flag(
        "file whose first line is the internal token"))
    max_queued_requests: int = field(default=0, metadata=flag(
        "jobs waiting for the engine before 429 (0: sized from free memory, see capacity.py)"))
    max_queue_wait_s: float = field(default=timeouts.GEN_MAX_QUEUE_WAIT_S, metadata=flag(
        "a job that waited this long for the engine fails with 429 queue_timeout"))
    stream_heartbeat_s: float = field(default=timeouts.GEN_HEARTBEAT_S, metadata=flag(
        "a stream with nothing to say for this long (a queued job) sends an SSE comment, so idle timeouts on the "
        "way (the gateway's --upstream-idle-timeout-s) wait for the queue's own 429; 0 = never"))
    max_stream_backlog_mb: float = field(default=256.0, metadata=flag(
        "pixels of one stream waiting for its reader beyond this: the job is aborted and the stream cut (a single "
        "larger image still passes)"))
    encode_threads: int = field(default=2, metadata=flag("threads encoding images (PNG / JPEG / WebP)"))
    rl_trajectory_store_mb: float = field(default=4096.0, metadata=flag(
        "host memory for RL rollout trajectories (LRU by bytes; when full, the owner holding the most gives up "
        "its least recently used first)"))
    rl_trajectory_owner_mb: float = field(default=0.0, metadata=flag(
        "the most one owner (a tenant's API key) may keep in the trajectory store; its own least recently used "
        "trajectories make room first; 0: the whole store"))


def resolve_mode(flag: str, env: dict | None = None) -> str:
    """The --cuda-graphs value after the environment override (U1SERVE_CUDA_GRAPHS=0|1)."""
    if flag not in CUDA_GRAPH_MODES:
        raise ValueError(f"--cuda-graphs must be one of {CUDA_GRAPH_MODES}, got {flag!r}")
    value = knobs.CUDA_GRAPHS.text(env)
    if not value:
        return flag
    if value not in ("0", "1"):
        raise ValueError(f"{CUDA_GRAPHS_ENV} must be 0 or 1, got {value!r}")
    return "on" if value == "1" else "off"


def add_config_flags(p: argparse.ArgumentParser) -> None:
    flags.add_flags(p, GenerationConfig)
    flags.add_flags(p, ServerConfig)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return flags.from_args(ServerConfig, args)


def config_from_args(args: argparse.Namespace) -> GenerationConfig:
    """The engine config of the parsed flags (SystemExit naming the flag for a value that cannot run)."""
    try:
        graphs = resolve_mode(args.cuda_graphs)
    except ValueError as e:
        raise SystemExit(f"--cuda-graphs: {e}")
    if args.weight_streaming_layers and graphs == "auto":
        graphs = "off"      # graphs cannot replay streamed weights (GenerationConfig._check_weight_streaming)
    table = args.warmup_table if args.warmup_table != "auto" else ("on" if args.device == "cuda" else "off")
    if args.kv_pool_wait_s is not None and args.kv_pool_wait_s < 0:
        raise SystemExit("--kv-pool-wait-s must be >= 0")     # (before the default below replaces it)
    pool_wait = args.kv_pool_wait_s if args.kv_pool_wait_s is not None else (
        KV_POOL_WAIT_S if args.device == "cuda" and args.kv_pool_follow_handles == "off" else 0.0)
    try:
        return flags.from_args(GenerationConfig, args, cuda_graphs=graphs, warmup_table=table,
                               kv_pool_wait_s=pool_wait,
                               default_size=args.default_size or ("2048x2048" if args.device == "cuda" else ""))
    except ValueError as e:
        raise SystemExit(str(e)) from None
