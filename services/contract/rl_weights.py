"""Live weight updates: the public `/v1/rl/weights*` bodies and the engines' internal two-phase ops
(docs/rl.md "Live weight updates"). Engine-free: pydantic only."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import limits as L
from .types import INTERNAL, Float

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}$"
# generation's retryable 503 for prefix handles of another weights version than its own (a weight update came
# between a job's prefix and its denoising, generation/weights.py); the gateway then runs the job again
WEIGHTS_VERSION_MISMATCH = "weights_version_mismatch"


class WeightsUpdateRequest(BaseModel):
    """POST /v1/rl/weights: new weights from a directory the engines can read, and/or a LoRA delta."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    path: Optional[str] = Field(None, min_length=1, max_length=4096, description=(
        "directory (or one file) of *.safetensors under the checkpoint's own key names (a subset is a partial "
        "update; keys of one branch update only that engine); read by every engine process"))
    lora: Optional[str] = Field(None, min_length=1, max_length=4096, description=(
        "LoRA adapter applied as a delta to the current weights (after `path`'s): the official layout "
        "(X.lora_down/lora_up/alpha) or a PEFT directory (adapter_model.safetensors + adapter_config.json)"))
    lora_strength: Float = Field(1.0, ge=-L.MAX_LORA_STRENGTH, le=L.MAX_LORA_STRENGTH)
    version: Optional[str] = Field(None, pattern=VERSION_PATTERN, description=(
        "the new stack-wide weights version (default: the current one incremented)"))

    @model_validator(mode="after")
    def _something(self):
        if self.path is None and self.lora is None:
            raise ValueError("give `path` (safetensors weights) and/or `lora` (an adapter)")
        return self


class WeightsUpdateResponse(BaseModel):
    weights_version: str
    seconds: float = Field(description="the whole update: stage + commit on every engine")
    stage_seconds: float
    commit_seconds: float
    drain_seconds: dict[str, float] = Field(default_factory=dict, description=(
        "per service, how long its commit waited for the jobs in flight (the longest replica)"))
    updated: dict[str, int] = Field(description="tensors changed per service (generation, understanding), "
                                                "summed over its replicas")


class WeightsStatus(BaseModel):
    weights_version: Optional[str] = Field(description="the one version every engine serves; null while they "
                                                       "differ (an engine restarted, or an update failed midway)")
    generation: Optional[str]
    understanding: Optional[str]
    reference: Optional[str] = None
    replicas: dict[str, dict[str, Optional[str]]] = Field(default_factory=dict,
                                                          description="service -> replica URL -> its version")


# -- the engines' internal ops (gateway -> /internal/weights/*) ---------------------------------------------
class WeightsStageBody(BaseModel):
    model_config = INTERNAL
    id: str = Field(min_length=1, max_length=64)
    version: str = Field(pattern=VERSION_PATTERN)
    path: Optional[str] = Field(None, min_length=1, max_length=4096)
    lora: Optional[str] = Field(None, min_length=1, max_length=4096)
    lora_strength: Float = Field(1.0, ge=-L.MAX_LORA_STRENGTH, le=L.MAX_LORA_STRENGTH)


class WeightsCommitBody(BaseModel):
    model_config = INTERNAL
    id: str = Field(min_length=1, max_length=64)


def next_version(current: str) -> str:
    """The version after `current`: its trailing number plus one ("0" -> "1", "run7-3" -> "run7-4"), else
    `current` + ".1"."""
    head = current.rstrip("0123456789")
    tail = current[len(head):]
    return f"{head}{int(tail) + 1}" if tail else f"{current}.1"
