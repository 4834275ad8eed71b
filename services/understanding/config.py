"""The understanding service's configuration, declared once: each field is a flag of
`services.understanding.server` (kit.flags generates them, `--help` shows the defaults), and a config built in
process is checked as a parsed one (`__post_init__`).

`EngineConfig` is what every engine process gets; `ServerConfig` adds the HTTP process's own settings (listen
address, KV transport, admission, input limits; the slow-reader settings of kit.streaming) on top of it, as mini-sglang's
`ServerArgs(SchedulerConfig)`. `ServerConfig.engine()` is the engine's part. A leaf: no torch.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from services.base import knobs, timeouts
from services.contract import limits as CL
from services.kit import flags
from services.kit.flags import flag
from services.kit.stream_settings import StreamSettings
from services.model.constants import DTYPES, QUANTIZATIONS, VQA_MAX_PIXELS, VQA_MIN_PIXELS

KV_TRANSPORTS = ("shm", "nixl", "device")


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata=flag("checkpoint directory"))
    device: str = field(default="cpu", metadata=flag("cpu, cuda (the current CUDA device) or cuda:N"))
    dtype: str = field(default="bfloat16", metadata=flag("weights and KV", choices=DTYPES))
    tp: int = field(default=1, metadata=flag("tensor-parallel engine processes"))
    quantization: str = field(default="none", metadata=flag(
        "W8A8 for the und branch's dense Linear layers (services/model/quant.py); none serves a converted "
        "checkpoint (u1serve convert) in its own format", choices=QUANTIZATIONS))
    kv_pool_name: Optional[str] = field(default=None, metadata=flag(
        "shared-memory KV pool to create for image prefixes"))
    yield_signal: str = field(default="", metadata=flag(
        "colocate QoS: shm page to raise while a decode step runs, so a generation engine on the same GPUs yields "
        "(shm_transfer/yield_signal.py)"))
    kv_cache_tokens: int = field(default=65536, metadata=flag(
        "token slots of the paged KV cache (the engine may lower it to fit)"))
    max_model_len: int = field(default=32768, metadata=flag(
        "context limit (prompt + output), clamped to the KV cache's tokens"))
    max_running_requests: int = field(default=256, metadata=flag("requests decoding at once"))
    max_queue_wait_s: float = field(default=timeouts.UND_MAX_QUEUE_WAIT_S, metadata=flag(
        "a request that waited longer for admission fails with 429 (0 = no limit)"))
    chunked_prefill_size: int = field(default=4096, metadata=flag(
        "prefill tokens per iteration (0 = no chunking); image spans are never split"))
    prefix_cache: bool = field(default=True, metadata=flag("the radix prefix cache, on unless this flag is given"))
    cuda_graph_max_bs: int = field(default=128, metadata=flag(
        "largest decode batch replayed from a CUDA graph: on by default on CUDA, dense and MoE (A3B) models alike "
        "(0 = eager; CPU: always eager)"))
    prefill_graph_max_tokens: int = field(default=1024, metadata=flag(
        "largest prefill-only step (a few text prompts, e.g. an image's prefix) replayed from a CUDA graph, padded "
        "to a bucket of tokens (prefill_graphs.py; 0 = eager; CPU: always eager)"))
    log_level: str = field(default="info", metadata=flag("log level of the server and its engine"))
    engine_unit: str = field(default="process", metadata=flag(
        "process: the engine runs in its own rank process(es); thread: as a thread of this server (--tp 1; the "
        "fused colocate mode runs both engines' loops in one process: services/fused)", choices=("process", "thread")))
    stream_priority: str = field(default="default", metadata=flag(
        "the CUDA stream priority of the engine loop (the fused mode: high, so decode blocks go first)",
        choices=("default", "high", "low")))
    # set by the HTTP process per engine start, not flags
    dist_port: int = 29500              # TP rendezvous (each engine start takes a free one)
    in_addr: str = ""                   # HTTP -> engine (PULL here)
    out_addr: str = ""                  # engine -> HTTP (PUSH here)

    def __post_init__(self) -> None:
        flags.check_choices(self)
        if self.tp < 1:
            raise ValueError("--tp must be >= 1")
        if self.engine_unit == "thread" and self.tp != 1:
            raise ValueError("--engine-unit thread runs one engine rank: it needs --tp 1")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError("--prefill-graph-max-tokens must be >= 0")
        if self.kv_cache_tokens < 1 or self.max_running_requests < 1:
            raise ValueError("--kv-cache-tokens and --max-running-requests must be >= 1")
        # frozen: the context limit is clamped once, here (a context never exceeds the KV cache)
        object.__setattr__(self, "max_model_len", min(self.max_model_len, self.kv_cache_tokens))


@dataclass(frozen=True)
class ServerConfig(StreamSettings, EngineConfig):
    host: str = field(default="127.0.0.1", metadata=flag("listen address"))
    port: int = field(default=8100, metadata=flag("listen port"))
    # the KV pool and its transport
    kv_pool_owner: Optional[str] = field(default_factory=knobs.STACK_ID.get, metadata=flag(
        "the stack id recorded in the pool segment as its owner: only that stack's launcher removes it "
        f"(shm_transfer/segment.py; env {knobs.STACK_ID.name}, set by u1serve up)"))
    kv_pool_gb: float = field(default=4.0, metadata=flag("size of the shared-memory KV pool"))
    kv_transport: str = field(default="shm", metadata=flag(
        "how generation reads the prefixes: shm (same host) or nixl (over the network with NIXL; a consumer that "
        "shares this host's /dev/shm still uses shared memory) or device (the pages on --device, for a generation "
        "engine in this same process: fused colocate)", choices=KV_TRANSPORTS))
    kv_listen_port: int = field(default=0, metadata=flag(
        "nixl: port of the transport's metadata listener (0: a free one)"))
    kv_advertise_host: Optional[str] = field(default=None, metadata=flag(
        "nixl: the address generation services reach this host by (default: --host unless it is a wildcard, else "
        "this host's name resolved; env POD_IP in Kubernetes)"))
    kv_page_tokens: int = field(default=64, metadata=flag("tokens per shared-memory pool page"))
    kv_lease_s: float = field(default=300.0, metadata=flag(
        "lease of exported prefix pages (reclaimed after it if nobody releases them)"))
    max_prefix_pool_share: float = field(default=0.5, metadata=flag(
        "largest share of the KV pool one image-prefix request may reserve (larger: 400)"))
    prefix_pages_wait_s: float = field(default=timeouts.UND_PREFIX_PAGES_WAIT_S, metadata=flag(
        "how long an image-prefix request waits for KV pool pages that others hold before 429 kv_pool_full "
        "(0: at once); a burst then queues for the pages instead of being refused"))
    # admission and the engine's restarts
    max_queued_requests: Optional[int] = field(default=None, metadata=flag(
        "requests that may wait beyond the running ones; more get 429 (unset: max(16, KV cache tokens / 256))"))
    engine_max_failures: int = field(default=5, metadata=flag(
        "engine deaths within --engine-failure-window-s after which it is not restarted"))
    engine_failure_window_s: float = field(default=600.0, metadata=flag(
        "the window of --engine-max-failures"))
    # identity and secrets
    internal_token: Optional[str] = field(default=None, metadata=flag(
        "the token every route but /health requires (or --internal-token-file, or env "
        f"{knobs.INTERNAL_TOKEN.name})"))
    internal_token_file: Optional[str] = field(default=None, metadata=flag(
        "file whose first line is the internal token"))
    served_model_name: Optional[str] = field(default=None, metadata=flag(
        "the model name in responses (unset: the checkpoint directory's name)"))
    # input limits (the contract's, or tighter)
    image_min_pixels: int = field(default=VQA_MIN_PIXELS, metadata=flag("chat images are resized to >= this"))
    image_max_pixels: int = field(default=VQA_MAX_PIXELS, metadata=flag("chat images are resized to <= this"))
    max_image_bytes: int = field(default=CL.MAX_INPUT_IMAGE_BYTES, metadata=flag("encoded size of one image"))
    max_images_per_request: int = field(default=CL.MAX_CHAT_IMAGES, metadata=flag("image parts of one request"))
    max_source_pixels_per_image: int = field(default=CL.MAX_INPUT_IMAGE_PIXELS, metadata=flag(
        "largest input image (width x height, read from its header before decoding)"))
    max_source_pixels_per_request: int = field(default=CL.MAX_INPUT_REQUEST_PIXELS, metadata=flag(
        "all input images of one request together (header sizes)"))
    image_decode_threads: int = field(default=2, metadata=flag(
        "images decoded (and prompts built) at once, over all requests"))
    max_body_mb: float = field(default=64.0, metadata=flag("request bodies above this get 413"))
    max_think_tokens: int = field(default=CL.MAX_THINK_TOKENS, metadata=flag("upper bound for max_think_tokens"))

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        StreamSettings.__post_init__(self)
        if self.prefix_pages_wait_s < 0:
            raise ValueError("--prefix-pages-wait-s must be >= 0")
        if not 0 < self.max_prefix_pool_share <= 1:
            raise ValueError("--max-prefix-pool-share must be in (0, 1]")
        if self.kv_transport == "nixl" and not self.kv_pool_name:
            raise ValueError("--kv-transport nixl needs --kv-pool-name (the pool it serves)")

    def engine(self) -> EngineConfig:
        """The engine processes' part (no secret or HTTP setting leaves this process)."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})


def add_config_flags(p: argparse.ArgumentParser) -> None:
    flags.add_flags(p, ServerConfig)


def config_from_args(args: argparse.Namespace, **resolved) -> ServerConfig:
    """The config of the parsed flags; `resolved`: fields resolved after parsing (the token, the address)."""
    return flags.from_args(ServerConfig, args, **resolved)
