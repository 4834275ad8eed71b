"""CUDA graphs for the denoise step's layer stack: capture once per job composition, then replay.

Within a job every step runs the same kernels on the same shapes; only the values of the packed input
rows change (x_t, t), the rope positions are the same, and the KV buffers attention writes and reads
(job.kv) keep their addresses. So the layer stack (`model.gen_forward`) of a step is captured once and
replayed for the later steps with the same composition, which removes the launch gaps between kernels.

Key = the running composition: per job with rows (the job itself, its active local branches), in order,
plus the packed row count. Everything a graph bakes in is constant for a key: tensor addresses (job.kv,
the job's cached StepMeta), host ints (cu_seqlens on the host, k_start/k_end, max lengths), the fp8
GemmPolicy's choice (a function of the row count). The first step of a key runs eagerly (also the
warm-up a capture needs: Triton JIT, cuBLAS/cuDNN plans, lazily built constants such as RoPE inverse
frequencies), the second captures, the later ones replay. One graph per engine: a new key, or a job of
the key leaving (finished or aborted), releases it first — BEFORE job.free() frees the KV the
graph points at. Every capture of an engine uses one side stream; each graph has its own private memory
pool (torch's default). One pool shared by successive captures (a held `torch.cuda.MemPool`) breaks the
second capture on torch 2.11 (an internal assert in the pinned-host allocator's per-pool bookkeeping,
measured on the H200); a released graph's pool is handed back with `torch.cuda.empty_cache()` (`release`).

Used only where the step is graphable (`graphable`): CUDA, no step cache for any running job (its
decisions are made on the host), no QoS yield gate (it yields on the host between layers). Sequence
parallelism is graphable: its collectives (NCCL all-gather / all-to-all) are captured into the graph, and
its row layout is a function of the key (segments) built before the capture; every rank of the group
runs the same keys in the same order, and an eager step issues the same collectives as a replay, so a
rank that falls back to eager (a failed capture) stays in step with the others. A capture that fails (an op that is not
capturable, e.g. a host sync) logs one warning, turns graphs off for the engine's life, and the step is
computed eagerly (a capture records the work, it does not run it). A capture that runs out of device memory
is not a property of the code but of the moment (other jobs' KV, a large batch): that composition runs eagerly
to its end and later compositions capture again; only after `MAX_OOM_CAPTURES` such failures are graphs off.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from services import knobs

log = logging.getLogger("u1serve.generation.engine")

MODES = ("auto", "on", "off")
ENV = knobs.CUDA_GRAPHS.name       # 0 | 1: overrides --cuda-graphs (off | on)

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
MAX_OOM_CAPTURES = 3              # captures that ran out of memory before graphs are off for the engine's life


def resolve_mode(flag: str, env: dict | None = None) -> str:
    """The --cuda-graphs value after the environment override (U1SERVE_CUDA_GRAPHS=0|1)."""
    if flag not in MODES:
        raise ValueError(f"--cuda-graphs must be one of {MODES}, got {flag!r}")
    value = knobs.CUDA_GRAPHS.text(env)
    if not value:
        return flag
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return "on" if value == "1" else "off"


def graphable(device: torch.device, yield_gate: bool, cache_modes) -> bool:
    """Whether a step may run from a CUDA graph (module doc); `cache_modes`: every running job's."""
    return device.type == "cuda" and not yield_gate and all(mode == "off" for mode in cache_modes)


def composition_key(spans, rows: int) -> tuple:
    """spans: (job, active local branches, ...) of the jobs with rows in this step, in order."""
    return tuple((s[0], tuple(s[1])) for s in spans) + (rows,)


def key_jobs(key: tuple) -> list:
    return [part[0] for part in key[:-1]]


class GraphPlan:
    """Which way a step runs, from the keys seen so far (pure: no CUDA). `graph_key` is the key of the
    graph the engine holds (None: none), `seen` the key of the last eager step."""

    def __init__(self) -> None:
        self.graph_key: tuple | None = None
        self.seen: tuple | None = None
        self.refused: tuple | None = None    # a key whose capture ran out of memory: eager while it runs

    def action(self, key: tuple) -> str:
        """REPLAY the held graph, CAPTURE one (the second step in a row with this key; the caller then
        calls `captured`), or run EAGER. A key other than the held graph's means the caller must release
        it (`release_needed` before calling this)."""
        if key == self.graph_key:
            return REPLAY
        if key == self.refused:
            return EAGER
        if key == self.seen:
            return CAPTURE
        self.seen = key
        return EAGER

    def release_needed(self, key: tuple | None) -> bool:
        return self.graph_key is not None and key != self.graph_key

    def captured(self, key: tuple) -> None:
        self.graph_key, self.seen = key, None

    def released(self) -> None:
        """The held graph is gone; the next key starts over with an eager step."""
        self.graph_key = self.seen = None

    def refuse(self, key: tuple) -> None:
        """`key`'s capture failed for a passing reason: run it eagerly from now on (other keys may capture)."""
        self.refused, self.seen = key, None

    def forget(self, job) -> bool:
        """`job` leaves the engine: True when the held graph must be released (the job is in its key).
        A job in `seen` (or `refused`) is forgotten too, so a later job reusing its object identity starts over."""
        if self.seen is not None and any(j is job for j in key_jobs(self.seen)):
            self.seen = None
        if self.refused is not None and any(j is job for j in key_jobs(self.refused)):
            self.refused = None
        return self.graph_key is not None and any(j is job for j in key_jobs(self.graph_key))


class _Captured:
    """A captured layer stack: its static input rows and positions, its output, the graph (and pool)."""

    def __init__(self, graph, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        self.graph, self.x, self.positions, self.out = graph, x, positions, out


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (packed rows, positions) -> hidden


class StepGraphs:
    """The engine's CUDA graph of the layer stack (one at a time). `run` is called once per graphable step;
    `forget(job)` before a job's KV is freed; `release()` when a step is not graphable."""

    def __init__(self, device: torch.device, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"cuda graphs mode must be one of {MODES}, got {mode!r}")
        self.device = device
        self.enabled = mode != "off" and device.type == "cuda"
        if mode == "on" and device.type != "cuda":
            log.info("--cuda-graphs on: %s is not a CUDA device; steps run eagerly", device)
        self.plan = GraphPlan()
        self._graph: _Captured | None = None
        self._side = None                    # the capture stream every capture uses
        self.captures = 0
        self.replays = 0
        self.failure: str | None = None      # why graphs were turned off (a failed capture)
        self.oom_captures = 0                # captures that ran out of device memory (MAX_OOM_CAPTURES)
        self.last = EAGER                    # how the last step ran (the worker's step stats)

    # -- the step ----------------------------------------------------------------------------------
    def run(self, key: tuple, forward: Forward, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden = forward(x, positions): eagerly, by capturing then replaying, or by replaying (see
        GraphPlan). The returned tensor of a replay is the graph's output buffer: valid until the next
        step."""
        if not self.enabled:
            return self.eager(forward, x, positions)
        if self.plan.release_needed(key):
            self.release()
        action = self.plan.action(key)
        if action == EAGER:
            return self.eager(forward, x, positions)
        if action == CAPTURE and not self._capture(key, forward, x, positions):
            return self.eager(forward, x, positions)
        g = self._graph
        g.x.copy_(x)
        g.positions.copy_(positions)
        g.graph.replay()
        if action == REPLAY:
            self.replays += 1
        self.last = action
        return g.out

    def not_graphable(self) -> None:
        """This step runs eagerly outside `run` (step cache, yield gate): no graph is kept."""
        self.release()
        self.last = EAGER

    def eager(self, forward: Forward, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.last = EAGER
        return forward(x, positions)

    def _capture(self, key: tuple, forward: Forward, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Record forward on static copies of the inputs into a new graph (in its own pool). False
        (and graphs off for good) when the capture fails."""
        static_x, static_pos = x.clone(), positions.clone()
        error = None
        try:
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            graph = torch.cuda.CUDAGraph()
            main = torch.cuda.current_stream(self.device)
            self._side.wait_stream(main)      # the static copies (and the job's KV writes so far) first
            with torch.cuda.stream(self._side):   # restores the stream even if capture_end raises
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = forward(static_x, static_pos)
                except BaseException as e:
                    error = e
                finally:
                    graph.capture_end()       # raises when the capture was invalidated
            main.wait_stream(self._side)
        except Exception as e:
            error = error or e
        if error is not None:
            if not isinstance(error, Exception):
                raise error                   # KeyboardInterrupt and the like are not capture failures
            reason = f"{type(error).__name__}: {error}"
            if out_of_memory(error) and self.oom_captures + 1 < MAX_OOM_CAPTURES:
                self._refuse(key, reason)
            else:
                self._disable(reason)
            return False
        self._graph = _Captured(graph, static_x, static_pos, out)
        self.plan.captured(key)
        self.captures += 1
        return True

    def _refuse(self, key: tuple, reason: str) -> None:
        self.oom_captures += 1
        self.plan.refuse(key)
        torch.cuda.empty_cache()              # the failed capture's pool
        log.warning("CUDA graph capture of the denoise step ran out of memory (%s); this batch runs eagerly, "
                    "later ones capture again (%d of %d)", reason, self.oom_captures, MAX_OOM_CAPTURES)

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.failure = reason
        self._graph = None
        self.plan = GraphPlan()
        try:   # a failed capture leaves no sticky error; a device fault would show here (and fail eagerly)
            torch.cuda.synchronize(self.device)
        except Exception:
            pass
        log.warning("CUDA graphs turned off for this engine: capture of the denoise step failed (%s); "
                    "steps run eagerly", reason)

    # -- invalidation ------------------------------------------------------------------------------
    def forget(self, job) -> None:
        """`job` leaves the engine: release the graph if it points at its KV (call before job.free())."""
        if self.plan.forget(job):
            self.release()

    def release(self) -> None:
        """Drop the held graph and return its private pool's memory: torch frees a released graph pool only
        when an ordinary allocation fails (never during a capture), so without this every change of the
        batch's composition would leave one step's working set reserved, and a later capture could run out."""
        held = self._graph is not None
        self._graph = None
        self.plan.released()
        if held and self.device.type == "cuda":
            torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    """A device allocation failed (torch's OutOfMemoryError, or the CUDA error a capture may surface instead)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
