"""CUDA graphs for the denoise step's layer stack: capture once per job composition, then replay.

Within a job every step runs the same kernels on the same shapes; only the values of the packed input
rows change (x_t, t), the rope positions are the same, and the KV buffers attention writes and reads
(job.kv) keep their addresses. So the layer stack (`model.gen_forward`) of a step is captured once and
replayed for the later steps with the same composition, which removes the launch gaps between kernels.
On by default (`--cuda-graphs auto`): wherever the device is CUDA; eager on CPU.

Key = the running composition: per job with rows (the job itself, its active local branches), in order,
plus the packed row count (`--graph-keys job`, and always under SP). Keyed by shape (`--graph-keys auto`, the
default, with one engine rank) a job enters the key by its shape instead (`JobState.graph_shape`: segments, prefix
lengths, size, samples, position offsets): the graph then reads
a stand-in's KV buffer and step metadata (`_StandIn`), not the job's, so it outlives the job, and the next
job of that shape replays from its first step; a new shape of a family that ran (`JobState.graph_family`: another
prompt length of a size and branch set) captures on its first step, a guess undone for good by one failure
(`_unguess`). Binding a job to a stand-in copies only its prefix KV (the
image rows' K/V are written by every step before they are read) and the job adopts the stand-in's buffer,
letting its own go: a running job holds one KV buffer as before, and an idle engine holds one composition's
(`release`d before a job of another shape is admitted to the idle engine, so such a job meets the memory it met keyed
by job; also when an admission or a step runs out of memory, and on a weights update). A job of the held shape holds
its own KV buffer beside the held one from admission to its first step (then adopts the stand-in's). Measured on an
H100: the next 1024² 8-step request of a shape 0.437 -> 0.323 s through the API, bits equal
(docs/benchmarks/generation.md).

Everything a graph bakes in is constant for a key: tensor addresses (job.kv,
the job's cached StepMeta), host ints (cu_seqlens on the host, k_start/k_end, max lengths), the fp8
GemmPolicy's choice (a function of the row count). The first step of a key runs eagerly (also the
warm-up a capture needs: Triton JIT, cuBLAS/cuDNN plans, lazily built constants such as RoPE inverse
frequencies), the second captures (each segment when it first runs), the later ones replay; keyed by shape, a
key that has run before (`GraphPlan.warm`) captures on its first step. One
composition's graphs per engine: a new key, or a job of the key leaving (finished or aborted), releases
them first — BEFORE job.free() frees the KV the graphs point at. Every capture of an engine uses one side
stream; each composition's segments share a `torch.cuda.graph_pool_handle()` pool, as the understanding
engine's decode graphs do (a held `torch.cuda.MemPool` shared by successive compositions broke the second
capture on torch 2.11: an internal assert in the pinned-host allocator's per-pool bookkeeping, measured on
the H200); released graphs' pool is handed back with `torch.cuda.empty_cache()` (`release`).

Segments: the stack is captured as a few graphs of consecutive layers (`layer_segments`), replayed in
order, so host code can run between them while the step keeps its graphs: the QoS yield gate (qos.py)
runs between segments of `--graph-segment-layers` layers instead of before every layer (a decode step
waits at most one segment), and a first-block step cache (step_cache.py) decides after the [0, 1)
segment: when every branch computes, the rest replays; when some reuse, the computing rows run the rest
eagerly (their row count changes step to step; a graph per subset would rarely replay). TeaCache decides
on the input before any layer, so its computing steps replay the whole stack. The segments of a key
share one memory pool (they replay in layer order; one segment's scratch is the next one's), and each
segment after the first reads the previous one's output buffer in place (no copy).

Used where the step is graphable (`graphable`): CUDA and no LoRA rows (lora_batched.py sets the rows'
adapter slots per step on the host). Sequence
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

import collections
import logging
import weakref
from typing import Callable

import torch

from .config import CUDA_GRAPH_MODES, GRAPH_KEYS

log = logging.getLogger("u1serve.generation.engine")


EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
MAX_OOM_CAPTURES = 3              # captures that ran out of memory before graphs are off for the engine's life
WARM_KEYS = 64                    # keys by shape remembered as run (GraphPlan.warm): host memory only


def graphable(device: torch.device, lora_rows: bool) -> bool:
    """Whether a step may run from CUDA graphs (module doc): a step cache and the yield gate may, LoRA rows not."""
    return device.type == "cuda" and not lora_rows


def composition_key(spans, rows: int, by_shape: bool = False) -> tuple:
    """spans: (job, active local branches, ...) of the jobs with rows in this step, in order; each job by
    itself, or `by_shape` by its graph shape (module doc)."""
    return tuple(((s[0].graph_shape() if by_shape else s[0]), tuple(s[1])) for s in spans) + (rows,)


def composition_family(spans, rows: int) -> tuple:
    """The key by shape without what prompt lengths set (JobState.graph_family): a new prompt length of a family
    that ran runs the kernels the family's eager step already warmed."""
    return tuple((s[0].graph_family(), tuple(s[1])) for s in spans) + (rows,)


def key_jobs(key: tuple) -> list:
    return [part[0] for part in key[:-1]]


class GraphPlan:
    """Which way a step runs, from the keys seen so far (pure: no CUDA). `graph_key` is the key of the
    graph the engine holds (None: none), `seen` the key of the last eager step. With `remember` (keys by
    shape: no job in them), the keys that have run are kept (`warm`, the last WARM_KEYS): their kernels, plans
    and lazily built constants exist, so such a key that comes back captures on its first step, skipping the
    eager one."""

    def __init__(self, remember: bool = False) -> None:
        self.graph_key: tuple | None = None
        self.seen: tuple | None = None
        self.refused: tuple | None = None    # a key whose capture ran out of memory: eager while it runs
        self.warm: collections.OrderedDict | None = collections.OrderedDict() if remember else None
        self.warm_families: collections.OrderedDict = collections.OrderedDict()
        self.family_captures = remember      # a warm family's new key captures first (off after one such failed)
        self.guessed: tuple | None = None    # the key of the last such capture: its failure turns that off

    def action(self, key: tuple, family: Callable[[], tuple] | None = None) -> str:
        """REPLAY the held graph, CAPTURE one (the second step in a row with this key, or the first of a warm
        key or of a new key of a warm family, `family()` the key's: only asked for a key not run before; the
        caller then calls `captured`), or run EAGER. A key other than the held graph's means the caller must
        release it (`release_needed` before calling this)."""
        if key == self.graph_key:
            return REPLAY
        if key == self.refused:
            return EAGER
        if key == self.seen or (self.warm is not None and key in self.warm):
            return CAPTURE
        if self.warm is not None:
            _remember(self.warm, key)
            fam = family() if family is not None else None
            if fam is not None and self.family_captures and fam in self.warm_families:
                self.guessed = key
                return CAPTURE
            if fam is not None:
                _remember(self.warm_families, fam)
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


def _remember(keys: collections.OrderedDict, key: tuple) -> None:
    keys[key] = None
    keys.move_to_end(key)
    while len(keys) > WARM_KEYS:
        keys.popitem(last=False)


class _Segment:
    """A captured run of layers: its static input (the previous segment's output buffer, or a copy of the
    step's input rows for the first), its output buffer, the graph."""

    def __init__(self, graph, inp: torch.Tensor, out: torch.Tensor) -> None:
        self.graph, self.inp, self.out = graph, inp, out


class _StandIn:
    """A job's place in a graph keyed by shape: the KV buffer and step metadata the graph reads, filled from the
    job that runs there now (`bind`). Its metadata is the first occupant's (equal for every job of the shape)."""

    def __init__(self, job) -> None:
        self.kv = job.kv                     # adopted: the first occupant's own buffer
        self.N, self.n = job.N, job.n
        self._prefixes = [(seg.start, seg.prefix_len) for seg in job.segments]
        self._meta: dict = {}
        self._occupant = weakref.ref(job)

    def meta(self, active_local, rows=None):
        key = (tuple(active_local), rows)
        m = self._meta.get(key)
        if m is None:
            m = self._meta[key] = self._occupant().meta(active_local, rows)
        return m

    def bind(self, job) -> None:
        """Make the buffer hold `job`'s prefix KV, and the job adopt it (its own buffer goes: a running job holds
        one). The buffer's address is what the graph baked in, so it never changes: an occupant still running on
        it (a job of the same shape stepped apart) moves to a copy first."""
        held = self._occupant()
        if held is job:
            return
        if held is not None and held.kv is self.kv:
            held.kv = self.kv.clone()
        for start, length in self._prefixes:
            self.kv[:, :, start:start + length].copy_(job.kv[:, :, start:start + length])
        job.kv = self.kv
        self._occupant = weakref.ref(job)


class _KeyGraphs:
    """The graphs of the held composition: its segments by layer range, the memory pool they share (they
    always replay in layer order, so one segment's scratch is the next one's), the static positions and
    the Rope the segments read (its cos / sin table is built inside the first captured segment)."""

    def __init__(self, positions: torch.Tensor, make_rope, stand_ins: list[_StandIn] | None = None) -> None:
        self.positions = positions.clone()
        self.rope = make_rope(self.positions)
        self.pool = None                    # made by the first capture (it fails there, not here, off CUDA)
        self.segments: dict[tuple[int, int], _Segment] = {}
        self.stand_ins = stand_ins          # keyed by shape: one per job of the key, in order


Layers = Callable[[torch.Tensor, object], torch.Tensor]   # (rows, rope) -> the rows after a segment's layers


def layer_segments(num_layers: int, per_segment: int, probe: bool) -> list[tuple[int, int]]:
    """The layer ranges a graphed step runs as separate graphs: [0, 1) alone when a first-block step cache
    decides after layer 0 (`probe`), the rest in runs of `per_segment` layers (0: one run) so a host-side
    gate (the QoS yield gate) runs between them."""
    bounds = [0, 1] if probe and num_layers > 1 else [0]
    step = per_segment if per_segment > 0 else num_layers
    while bounds[-1] < num_layers:
        bounds.append(min(num_layers, bounds[-1] + step))
    return list(zip(bounds[:-1], bounds[1:]))


class StepGraphs:
    """The engine's CUDA graphs of the layer stack (one composition at a time, in segments). Per step:
    `begin(spans, rows, positions, make_rope)`, then `segment(range, layers, h)` for each layer range in order;
    `forget(job)` before a job's KV is freed; `not_graphable()` when a step runs outside."""

    def __init__(self, device: torch.device, mode: str, keys: str = "job") -> None:
        if mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda graphs mode must be one of {CUDA_GRAPH_MODES}, got {mode!r}")
        if keys not in GRAPH_KEYS:
            raise ValueError(f"graph keys must be one of {GRAPH_KEYS}, got {keys!r}")
        self.device = device
        self.by_shape = keys == "shape"
        self.enabled = mode != "off" and device.type == "cuda"
        if mode == "on" and device.type != "cuda":
            log.info("--cuda-graphs on: %s is not a CUDA device; steps run eagerly", device)
        self.plan = GraphPlan(remember=self.by_shape)
        self._held: _KeyGraphs | None = None
        self._side = None                    # the capture stream every capture uses
        self._key: tuple | None = None       # the key of the step in progress (None: it runs eagerly)
        self._eager_rope = None              # the step's own Rope, for segments that fall back to eager
        self._ran: set[str] = set()
        self.captures = 0                    # segments captured
        self.replays = 0                     # steps that replayed every segment they ran
        self.failure: str | None = None      # why graphs were turned off (a failed capture)
        self.oom_captures = 0                # captures that ran out of device memory (MAX_OOM_CAPTURES)
        self.last = EAGER                    # how the last step ran (the worker's step stats, the job's `applied`)

    # -- the step ----------------------------------------------------------------------------------
    def begin(self, spans, rows: int, positions: torch.Tensor, make_rope):
        """Start a step of the composition of `spans` (job, active local branches, ...) over `rows` packed rows:
        (the Rope its segments read, the spans its attention reads: the jobs or, keyed by shape, their stand-ins
        bound to them), or (None, spans) when the step runs eagerly (graphs off, the first step of a composition:
        also its warm-up, or a refused one)."""
        self._key, self._ran, self.last = None, set(), EAGER
        if not self.enabled:
            return None, spans
        key = composition_key(spans, rows, self.by_shape)
        if self.plan.release_needed(key):
            self.release()
        action = self.plan.action(key, (lambda: composition_family(spans, rows)) if self.by_shape else None)
        if action == EAGER:
            return None, spans
        if action == CAPTURE:
            stand_ins = [_StandIn(sp[0]) for sp in spans] if self.by_shape else None
            self._held = _KeyGraphs(positions, make_rope, stand_ins)
            self.plan.captured(key)
        else:
            self._held.positions.copy_(positions)
        self._key = key
        self._eager_rope = lambda: make_rope(positions)
        stand_ins = self._held.stand_ins
        if stand_ins is None:
            return self._held.rope, spans
        for place, sp in zip(stand_ins, spans):
            place.bind(sp[0])
        return self._held.rope, [(place, *sp[1:]) for place, sp in zip(stand_ins, spans)]

    def segment(self, layers_range: tuple[int, int], layers: Layers, h: torch.Tensor) -> torch.Tensor:
        """h after the layers of `layers_range`: replayed from its graph (captured on first use), or eagerly when
        graphs went off during this step. The returned tensor of a replay is the graph's output buffer: valid
        until the segment's next replay."""
        held = self._held if self._key is not None else None
        if held is None:
            return layers(h, self._rope_for_eager())
        seg = held.segments.get(layers_range)
        if seg is None:
            seg = self._capture(held, layers_range, layers, h)
            if seg is None:
                return layers(h, self._rope_for_eager())
            self._ran.add(CAPTURE)
        else:
            self._ran.add(REPLAY)
        if h is not seg.inp:
            seg.inp.copy_(h)
        seg.graph.replay()
        return seg.out

    def end(self) -> str:
        """How the step ran (EAGER | CAPTURE | REPLAY), counted."""
        self.last = CAPTURE if CAPTURE in self._ran else REPLAY if self._ran else EAGER
        if self.last == REPLAY:
            self.replays += 1
        self._key = None
        return self.last

    def _rope_for_eager(self):
        """A Rope of the step's live positions: a failed capture may have left the held one's table unset."""
        if callable(self._eager_rope):
            self._eager_rope = self._eager_rope()
        return self._eager_rope

    def not_graphable(self) -> None:
        """This step runs eagerly outside the graphs (LoRA rows): no graph is kept."""
        self.release()
        self.last = EAGER

    def _capture(self, held: _KeyGraphs, layers_range, layers: Layers, h: torch.Tensor) -> _Segment | None:
        """Record `layers` on the static input into a new graph in the key's pool (it is replayed by the caller:
        a capture records the work, it does not run it). None when the capture fails: the step goes on eagerly,
        the key is refused (out of memory) or graphs are off for the engine's life."""
        chained = any(h is s.out for s in held.segments.values())
        static = h if chained else h.clone()
        try:
            graph, out = self._record(held, lambda x: layers(x, held.rope), static)
            error = None
        except BaseException as e:
            error = e
        if error is not None:
            if not isinstance(error, Exception):
                raise error                   # KeyboardInterrupt and the like are not capture failures
            reason = f"{type(error).__name__}: {error}"
            key = self._key
            self._key = None                  # the rest of this step runs eagerly
            if out_of_memory(error) and self.oom_captures + 1 < MAX_OOM_CAPTURES:
                self._refuse(key, reason)
            elif key == self.plan.guessed and not out_of_memory(error):
                self._unguess(key, reason)
            else:
                self._disable(reason)
            return None
        seg = _Segment(graph, static, out)
        held.segments[layers_range] = seg
        self.captures += 1
        return seg

    def _record(self, held: _KeyGraphs, fn: Callable[[torch.Tensor], torch.Tensor], static: torch.Tensor):
        """Capture fn(static) into a new CUDA graph in the key's pool: (graph, its output buffer). Raises what
        the capture raised (an error inside fn first: capture_end's own error would hide it)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        if held.pool is None:
            held.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)      # the static copy (and the job's KV writes so far) first
        error = None
        with torch.cuda.stream(self._side):   # restores the stream even if capture_end raises
            graph.capture_begin(pool=held.pool, capture_error_mode="thread_local")
            try:
                out = fn(static)
            except BaseException as e:
                error = e
            finally:
                try:
                    graph.capture_end()   # raises when the capture was invalidated
                except Exception:
                    if error is None:
                        raise
        if error is not None:
            raise error
        main.wait_stream(self._side)
        return graph, out

    def _refuse(self, key: tuple, reason: str) -> None:
        self.oom_captures += 1
        self._drop(key)
        log.warning("CUDA graph capture of the denoise step ran out of memory (%s); this batch runs eagerly, "
                    "later ones capture again (%d of %d)", reason, self.oom_captures, MAX_OOM_CAPTURES)

    def _unguess(self, key: tuple, reason: str) -> None:
        """A warm family's new key failed its first-step capture (something of its new lengths was not warm): that
        key runs eagerly while it runs, and from now on every new key warms up with an eager step first."""
        self.plan.family_captures = False
        self._drop(key)
        log.warning("CUDA graph capture on the first step of a new prompt length failed (%s); this job runs "
                    "eagerly, and new prompt lengths warm up with an eager step from now on", reason)

    def _drop(self, key: tuple) -> None:
        """`key`'s capture failed for a passing reason: its graphs (and their pool) go, it runs eagerly while it
        runs."""
        self._held = None
        self.plan.released()                  # begin() made the key the held one
        self.plan.refuse(key)
        torch.cuda.empty_cache()              # the key's pool

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.failure = reason
        self._held = None
        self.plan = GraphPlan(remember=self.by_shape)
        try:   # a failed capture leaves no sticky error; a device fault would show here (and fail eagerly)
            torch.cuda.synchronize(self.device)
        except Exception:
            pass
        log.warning("CUDA graphs turned off for this engine: capture of the denoise step failed (%s); "
                    "steps run eagerly", reason)

    # -- invalidation ------------------------------------------------------------------------------
    def forget(self, job) -> None:
        """`job` leaves the engine: release the graphs if they point at its KV (call before job.free()). Graphs
        keyed by shape stay: they read their stand-ins' buffers."""
        if self.plan.forget(job):
            self.release()

    def held_for(self, shape: tuple) -> bool:
        """Whether the held graphs are those of one job of `shape` alone (keyed by shape): a job of that shape
        admitted to an idle engine replays them."""
        key = self.plan.graph_key if self._held is not None and self.by_shape else None
        return key is not None and len(key) == 2 and key[0][0] == shape

    def holds(self) -> bool:
        """Whether graphs (and, keyed by shape, their KV buffers) are held."""
        return self._held is not None

    def release(self) -> None:
        """Drop the held graphs and return their pool's memory: torch frees a released graph pool only when an
        ordinary allocation fails (never during a capture), so without this every change of the batch's
        composition would leave one step's working set reserved, and a later capture could run out."""
        held = self._held is not None
        self._held = None
        self._key = None
        self.plan.released()
        if held and self.device.type == "cuda":
            torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    """A device allocation failed (torch's OutOfMemoryError, or the CUDA error a capture may surface instead)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
