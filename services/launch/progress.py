"""Progress bars where people wait (tqdm), one style for the whole CLI: `u1serve up` (each engine's phase from its
/health: loading, warming, ready), `u1serve convert` (shards), `u1serve rl-train` (iterations with their reward);
huggingface_hub draws its own download bars in the same library. On stderr, and only when stderr is a terminal:
logs, pipes and CI see the plain lines they saw before. U1SERVE_PROGRESS=0 turns them off on a terminal too."""
from __future__ import annotations

import sys
from typing import Iterable, Optional, TextIO, TypeVar

from services.base import knobs
from services.contract.health import PHASE_FIELD, describe

T = TypeVar("T")


def wanted(stream: Optional[TextIO] = None) -> bool:
    """Whether bars are drawn on `stream` (default stderr): a terminal, and not turned off."""
    stream = stream or sys.stderr
    if not knobs.PROGRESS.get():
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def bar(iterable: Optional[Iterable[T]] = None, *, total: Optional[int] = None, desc: str = "", unit: str = "it"):
    """A tqdm bar on stderr (disabled where `wanted` says no: iterating it then costs nothing extra)."""
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not wanted(),
                dynamic_ncols=True, leave=True)


def starting_line(body: dict) -> str:
    """What a starting service's /health body says for its progress line: an engine's phase as loading /
    warming / ready (services/contract/health.py), else its status (a service without phases)."""
    phase = body.get(PHASE_FIELD)
    return describe(phase) if phase else f"starting ({body.get('status') or 'no status yet'})"


class Phase:
    """One line for something with phases and no known length (an engine starting): its name, the phase it is
    in, the time since it began."""

    def __init__(self, name: str, stream: Optional[TextIO] = None, position: int = 0):
        """`position`: its row below the cursor, for lines drawn at once (engines starting together)."""
        from tqdm import tqdm
        stream = stream or sys.stderr
        self.name, self._phase = name, "waiting"
        self._bar = tqdm(total=None, desc=f"{name}: {self._phase}", bar_format="{desc} [{elapsed}]",
                         file=stream, disable=not wanted(stream), leave=True, position=position)

    def __call__(self, phase: str) -> None:
        if phase != self._phase:
            self._phase = phase
            self._bar.set_description_str(f"{self.name}: {phase}", refresh=False)
        self._bar.refresh()

    def close(self, phase: Optional[str] = None) -> None:
        if phase:
            self(phase)
        self._bar.close()
