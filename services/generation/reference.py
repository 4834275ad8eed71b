"""The engines of one rank as the worker loops see them (`EngineSet`, standing where they expect one Engine):

- RL jobs step apart from image jobs: together in one forward where each keeps the bits it has alone
  (`Engine.shares_forward_exactly`: every job's linear layers then run on its own rows, the shapes it has alone;
  attention, heads and the transition are per job, the other ops row-wise), each in a forward of its own otherwise;
  image jobs together as before. A rollout's numbers then do not depend on what else runs (GEMM results depend on
  the GEMM's shape), so the same seeds and weights give the same trajectory bit for bit, and scoring recomputes
  exactly the rollout's velocity. One forward for all the groups of a rollout (and for concurrent rollouts) is one
  launch sequence and one step-graph composition instead of one per group (each group alone alternated the
  engine's one held composition, so no step of a multi-group rollout ever replayed a graph);
- the frozen reference policy for RL scoring (`--rl-reference on`, docs/rl.md): a second copy of the generation
  branch as the stack started, loaded from the checkpoint on the first reference score job (so it costs nothing
  until used, then one more copy of the gen-branch weights: ~16 GB for the 8B model in bf16), served by a second
  Engine that shares the prefix source and the ranks' communicator.

Jobs go to the engine their spec names (`weights: "reference"` -> the reference); a step advances every group
in the same order on every rank; everything else is the primary engine's.
"""
from __future__ import annotations

from typing import Callable, Optional

from services.kit.errors import APIError

REFERENCE_VERSION = "0"        # the weights the stack started with


class EngineSet:
    def __init__(self, primary, make_reference: Optional[Callable[[], object]] = None):
        self.primary = primary
        self._make_reference = make_reference
        self.reference: Optional[object] = None
        self.forwards: list[int] = []      # the rows of each forward of the last step (one entry per forward)

    def _engines(self) -> list:
        return [self.primary] + ([self.reference] if self.reference is not None else [])

    def _for(self, spec):
        if getattr(spec, "weights", "current") != "reference":
            return self.primary
        if self.reference is None:
            if self._make_reference is None:
                raise APIError(400, "this stack runs without a reference model (--rl-reference off)",
                               param="weights", code="reference_unavailable")
            self.reference = self._make_reference()
        return self.reference

    @property
    def running(self) -> list:
        return [j for e in self._engines() for j in e.running]

    def admit(self, spec):
        return self._for(spec).admit(spec)

    def add(self, job) -> None:
        self._for(job.spec).add(job)

    def abort(self, request_id: str):
        for e in self._engines():
            job = e.abort(request_id)
            if job is not None:
                return job
        return None

    def step(self):
        finished, rows, self.forwards = [], 0, []
        for e in self._engines():
            for group, exact in _forward_groups(e):
                f, r = e.step(group, exact=exact)
                finished += f
                rows += r
                self.forwards.append(r)
        return finished, rows

    def __getattr__(self, name: str):
        return getattr(self.primary, name)

    def __setattr__(self, name: str, value) -> None:
        """Attributes the worker sets (e.g. the live weights version) are the primary engine's."""
        if name in ("primary", "_make_reference", "reference", "forwards"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.primary, name, value)


def _forward_groups(engine) -> list[tuple[list, bool]]:
    """One step's forwards on `engine` as (jobs, exact): the image jobs together, the RL jobs that share a forward
    exactly together, each other RL job alone."""
    plain = [j for j in engine.running if j.rl is None]
    shared, alone = [], []
    for j in engine.running:
        if j.rl is not None:
            (shared.append(j) if engine.shares_forward_exactly(j) else alone.append([j]))
    return [(g, False) for g in [plain] if g] + [(g, True) for g in [shared] if g] + [(g, False) for g in alone]


def reference_factory(cfg, device, dtype, source, comm, yield_gate) -> Callable[[], object]:
    """Builds the reference Engine: the checkpoint (with the same LoRA / quantisation) loaded again."""
    def make():
        from services.model.loader import load_model

        from .engine import Engine
        model = load_model(cfg.model, branch="gen", dtype=dtype, device=device, lora=list(cfg.lora),
                           quantization=cfg.quantization)
        model.eval()
        model.requires_grad_(False)
        engine = Engine(model, source, comm, yield_gate=yield_gate, cuda_graphs="off")
        engine.weights_version = REFERENCE_VERSION
        return engine
    return make
