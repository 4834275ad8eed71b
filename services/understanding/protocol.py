"""Messages between the HTTP process and the engine process (pickled over ZMQ): SubmitRequest, Abort, Shutdown and
the weights ops (weights.py) in; Starting, Ready, Step, WeightsReply and Fatal out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .sampling import SamplingParams


@dataclass
class SubmitRequest:
    """One prompt to run. kind "text": sample up to max_tokens; kind "prefix": compute the KV of the prompt
    (plus an optional greedy think block and its tail) and export it into the shm pool."""
    rid: str
    input_ids: list[int]
    images: list                      # services.model.images.ImageTensor, in prompt order
    params: SamplingParams
    kind: str = "text"
    stop_token_ids: list[int] = field(default_factory=list)   # eos etc. (already merged with params)
    cache_salt: Optional[str] = None  # prefix-cache isolation domain (None = the shared default domain)
    lora: Optional[str] = None        # LoRA adapter name (lora.py; None = the base weights)
    # prefix requests only
    think: bool = False
    max_think_tokens: int = 0
    think_tail_ids: list[int] = field(default_factory=list)
    think_stop_id: int = -1           # <|im_end|>: ends think, not fed
    think_end_id: int = -1            # </think>: ends think, fed
    think_sample: bool = False        # RL: sample the think block with `params`, log-probs of the processed dist.
    handle: Optional[dict] = None     # shm pages allocated at admission (KVHandle.to_dict())


@dataclass
class Abort:
    rid: str


@dataclass
class Shutdown:
    pass


@dataclass
class RequestOutput:
    rid: str
    new_ids: list[int]
    finish_reason: Optional[str] = None      # "stop" | "length" | "abort" | "error" | "exported"
    error: Optional[str] = None
    error_code: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    handle: Optional[dict] = None            # prefix requests: the filled handle
    think_ids: Optional[list[int]] = None    # prefix requests: the whole think block
    logprobs: Optional[list] = None          # text requests that asked: (logprob, [(id, logprob)]) per new id


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_total: int = 0
    kv_free: int = 0
    kv_cached: int = 0          # held by the prefix cache only (evictable)
    kv_in_use: int = 0          # held by requests (running, or locked prefixes)
    prompt_tokens: int = 0      # cumulative
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ---- engine -> HTTP process ------------------------------------------------------------------------------------
@dataclass
class Starting:
    """Where the engine is on its way to Ready (services.contract.health.EnginePhase), for /health."""
    phase: str


@dataclass
class Ready:
    """The engine loaded the checkpoint; the KV cache it could fit may be less than the config asked for."""
    kv_cache_tokens: int
    max_model_len: int


@dataclass
class Step:
    """What an iteration produced (also sent once idle after work, so the stats settle)."""
    outs: list[RequestOutput]
    stats: EngineStats


@dataclass
class WeightsReply:
    """The answer to one weights op (services/kit/weights_api.py reads `result`)."""
    result: dict


@dataclass
class Fatal:
    """The engine failed to load or to run: the HTTP process restarts it (or exits, at the first start)."""
    error: str
