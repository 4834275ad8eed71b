"""What an engine's /health says of its start-up, declared once: `phase`, where the engine is on its way to ready.
Both engines report it (understanding: ops router, generation: supervisor status); `u1serve up` draws each engine's
progress line from it (services/launch/progress.py). Engine-free: the launcher and the gateway may import it."""
from __future__ import annotations

from enum import Enum

PHASE_FIELD = "phase"          # the key in each engine's /health body


class EnginePhase(str, Enum):
    """In the order an engine goes through them (each engine skips the ones it has not got)."""
    STARTING = "starting"                            # its engine processes start: imports, devices
    LOADING_WEIGHTS = "loading_weights"              # the checkpoint onto the device
    WARMING = "warming"                              # first-use costs: understanding's kernels, generation's
    #                                                  warm-up plan (--default-size, the size table; warmup.py)
    CAPTURING_CUDA_GRAPHS = "capturing_cuda_graphs"  # understanding's decode graphs (cuda_graphs.py)
    ATTACHING_KV_POOL = "attaching_kv_pool"          # the shared-memory KV pool (generation waits for its producer)
    READY = "ready"


# what a person waiting sees: the stage (loading / warming / ready) and what in it
STAGES: dict[EnginePhase, tuple[str, str]] = {
    EnginePhase.STARTING: ("loading", "starting the engine"),
    EnginePhase.LOADING_WEIGHTS: ("loading", "weights"),
    EnginePhase.WARMING: ("warming", "first steps"),
    EnginePhase.CAPTURING_CUDA_GRAPHS: ("warming", "capturing CUDA graphs"),
    EnginePhase.ATTACHING_KV_POOL: ("warming", "attaching the KV pool"),
    EnginePhase.READY: ("ready", ""),
}


def describe(phase: str) -> str:
    """'loading (weights)', 'warming (capturing CUDA graphs)', 'ready'; an unknown phase as it is."""
    try:
        stage, what = STAGES[EnginePhase(phase)]
    except ValueError:
        return str(phase)
    return f"{stage} ({what})" if what else stage
