"""The fused server's own flags (kit.flags: declared once, with their defaults in --help). Each engine's flags
follow `--und` / `--gen` as their servers take them (services/fused/launch.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from services.kit.flags import flag


@dataclass(frozen=True)
class FusedConfig:
    und_memory_fraction: Optional[float] = field(default=None, metadata=flag(
        "CUDA: understanding's share of the device's memory; it starts alone under this cap and fits its KV "
        "cache to it, then the process's cap grows by --gen-memory-fraction for generation (unset: no cap)"))
    gen_memory_fraction: Optional[float] = field(default=None, metadata=flag(
        "CUDA: generation's share of the device's memory (with --und-memory-fraction)"))
    hang_s: float = field(default=300.0, metadata=flag(
        "an engine step running longer than this is a hung engine: the process exits non-zero (the launcher "
        "restarts it) rather than serve with one engine stuck; 0: no watchdog"))
    gil_probe_ms: float = field(default=5.0, metadata=flag(
        "period of the GIL probe thread (services/kit/loop_clock.py: how late it wakes is the GIL's wait; each wake "
        "asks the engine loops for the GIL, so a shorter period measures finer and costs more); 0: off"))
    exit_grace_s: float = field(default=5.0, metadata=flag(
        "after a fatal engine error: how long the servers get to answer what is in flight (503) before the "
        "process exits"))
