"""The engine's configuration: one frozen dataclass whose field defaults are the command line's defaults.

`server.build_parser` takes every engine flag's default from here (and `--help` shows it), `from_args` turns the
parsed flags into the config, so a value has one declaration (mini-sglang's `ServerArgs(SchedulerConfig)`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from services import timeouts


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"                 # cpu, cuda (the current CUDA device) or cuda:N
    dtype: str = "bfloat16"
    tp: int = 1                         # tensor-parallel engine processes
    dist_port: int = 29500              # TP rendezvous (each engine start takes a free one)
    kv_cache_tokens: int = 65536        # token slots of the paged KV cache (the engine may lower it to fit)
    max_running: int = 256              # requests decoding at once (rows of the request table)
    max_model_len: int = 32768          # context limit (prompt + output), at most kv_cache_tokens
    chunked_prefill_size: int = 4096    # prefill tokens per iteration (0 = no chunking)
    enable_prefix_cache: bool = True
    kv_pool_name: str | None = None     # the shared-memory KV pool exported image prefixes are written into
    cuda_graph_max_bs: int = 128        # largest decode batch replayed from a CUDA graph (0 = eager)
    max_queue_wait_s: float = timeouts.UND_MAX_QUEUE_WAIT_S   # longer waits for admission fail (0 = no limit)
    yield_signal: str = ""              # colocate QoS: shm page raised while a decode step runs (kit/yield_signal)
    log_level: str = "info"
    quantization: str = "none"          # none | fp8 | int8: the und branch's dense Linear layers (model/quant.py)
    engine_unit: str = "process"       # process: rank processes; thread: rank 0 as a thread here (services/fused)
    stream_priority: str = "default"    # the engine loop's CUDA stream: default | high | low (model/streams.py)
    in_addr: str = ""                   # HTTP -> engine (PULL here)
    out_addr: str = ""                  # engine -> HTTP (PUSH here)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "EngineConfig":
        return cls(model_dir=a.model, device=a.device, dtype=a.dtype, tp=a.tp, kv_cache_tokens=a.kv_cache_tokens,
                   max_running=a.max_running_requests, max_model_len=a.max_model_len,
                   chunked_prefill_size=a.chunked_prefill_size, enable_prefix_cache=not a.no_prefix_cache,
                   kv_pool_name=a.kv_pool_name, cuda_graph_max_bs=a.cuda_graph_max_bs,
                   max_queue_wait_s=a.max_queue_wait_s, yield_signal=a.yield_signal, log_level=a.log_level,
                   quantization=a.quantization, engine_unit=a.engine_unit, stream_priority=a.stream_priority)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that feed EngineConfig, with its defaults (the parser's formatter prints them in --help)."""
    d = EngineConfig
    p.add_argument("--device", default=d.device, help="cpu, cuda (the current CUDA device) or cuda:N")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"], help="weights and KV")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel engine processes")
    p.add_argument("--quantization", default=d.quantization, choices=["none", "fp8", "int8"],
                   help="W8A8 for the und branch's dense Linear layers (services/model/quant.py); none serves a "
                        "converted checkpoint (u1serve convert) in its own format")
    p.add_argument("--kv-pool-name", default=d.kv_pool_name,
                   help="shared-memory KV pool to create for image prefixes")
    p.add_argument("--yield-signal", default=d.yield_signal, help="colocate QoS: shm page to raise while a decode "
                   "step runs, so a generation engine on the same GPUs yields (services/kit/yield_signal.py)")
    p.add_argument("--engine-unit", default=d.engine_unit, choices=["process", "thread"],
                   help="process: the engine runs in its own rank process(es); thread: as a thread of this server "
                        "(--tp 1; the fused colocate mode runs both engines' loops in one process: services/fused)")
    p.add_argument("--stream-priority", default=d.stream_priority, choices=["default", "high", "low"],
                   help="the CUDA stream priority of the engine loop (the fused mode: high, so decode blocks go first)")
    p.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens, help="token slots of the paged KV cache")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="context limit (prompt + output)")
    p.add_argument("--max-running-requests", type=int, default=d.max_running, help="requests decoding at once")
    p.add_argument("--max-queue-wait-s", type=float, default=d.max_queue_wait_s,
                   help="a request that waited longer for admission fails with 429 (0 = no limit)")
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="prefill tokens per iteration (0 = no chunking); image spans are never split")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    p.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="largest decode batch replayed from a CUDA graph: on by default on CUDA, dense and MoE "
                        "(A3B) models alike (0 = eager; CPU: always eager)")
    p.add_argument("--log-level", default=d.log_level, help="log level of the server and its engine")
