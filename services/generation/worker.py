"""Engine rank process: load the gen branch, then loop: plan -> execute -> emit.

Rank 0 (the leader) talks to the HTTP process over the link (link.py): a reader thread fills its inbox and an
outbox thread writes its events, so the engine loop never waits on a pipe. Each iteration the scheduler
(scheduler.py) turns the commands waiting in the inbox into a StepPlan, rank 0 broadcasts it so every CFG / SP
rank runs the same job list in lock step, every rank applies it (abort, admit, the weights op) and steps the
running jobs once, and rank 0 emits the events (emitter.py). Messages both ways: protocol.py.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
import traceback
from typing import Callable, Optional

import torch

from services.base import knobs
from services.contract.health import EnginePhase
from services.kit import timeline
from services.kit.errors import APIError
from services.kit.loop_clock import loop_clock
from services.kit.proc import die_with_parent, ignore_stop_signals
from services.model.constants import torch_dtype
from services.model.oom import out_of_memory

from .config import GenerationConfig
from .emitter import Emitter
from .protocol import Fatal, KvImportStats, KvPoolStats, Ready, StepPlan, Stop, WarmupStats
from .protocol import Starting, TrajectoryHeld
from .shared_trajectory import TrajectorySegments
from .scheduler import Scheduler
from .weights import RankWeights

log = logging.getLogger("u1serve.generation.engine")


def _admit(engine, comm, specs: list) -> tuple[dict[str, dict], list[KvImportStats]]:
    """Admit as rank 0 decided; agree on failures across ranks. Returns ({request_id: error event}, stats)."""
    admitted, errors, stats = [], {}, []
    for spec in specs:
        try:
            job, job_stats = engine.admit(spec)
            admitted.append(job)
            stats.extend(job_stats)
        except APIError as e:
            errors[spec.request_id] = e.event()
        except torch.cuda.OutOfMemoryError:
            errors[spec.request_id] = APIError(503, "out of device memory for this job's KV buffer; retry later",
                                               code="engine_oom").event()
        except Exception as e:  # a bug or a broken handle: fail the job, keep serving
            log.exception("admission of %s failed", spec.request_id)
            errors[spec.request_id] = APIError(500, f"admission failed: {e!r}", code="engine_error").event()
    merged = {}
    for part in comm.all_gather_objects(errors):
        for rid, ev in part.items():
            merged.setdefault(rid, ev)
    for job in admitted:
        if job.request_id in merged:
            job.free()
        else:
            engine.add(job)
    return merged, stats


def _apply(engine, comm, weights: RankWeights, plan: StepPlan):
    """Every rank the same, in this order: abort, admit, the weights op. Returns (failed admissions, their
    stats, rank 0's weights reply)."""
    for rid in plan.abort:
        engine.abort(rid)
    failed, stats = _admit(engine, comm, plan.admit)
    reply = weights.run(plan.weights) if plan.weights is not None else None
    return failed, stats, reply


def _step_or_fail(engine, emit: Emitter, alone: bool) -> Optional[tuple[list, int, float]]:
    """_step; on one rank alone, an out-of-memory fails the jobs of that step (503 engine_oom, their buffers
    freed: the same answer as a KV buffer that does not fit at admission, a capacity refusal the client may retry
    smaller or later, not a fault) instead of the engine: None then. With several ranks it stays fatal (the others are inside the
    step's collectives; the supervisor restarts the engine)."""
    try:
        return _step(engine)
    except Exception as exc:
        if not alone or not out_of_memory(exc):
            raise
        jobs = [job.request_id for job in engine.running]
        log.error("out of memory in a denoise step of %s: those jobs fail, the engine goes on (%s)", jobs, exc)
        for rid in jobs:
            engine.abort(rid)
            emit.failed(rid, APIError(503, "the engine ran out of memory in a denoise step of this job (with "
                                      f"{len(jobs)} job(s) in that step); a smaller size, fewer samples or a "
                                      "retry later may fit", code="engine_oom").event())
        engine.graphs.release()          # graphs kept across jobs (keyed by shape) hold memory too
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _step(engine) -> tuple[list, int, float]:
    """One step of every running job: (finished jobs, rows in the forward, seconds)."""
    t0 = time.perf_counter()
    finished, rows = engine.step()
    if timeline.ENABLED:       # the step's end on the device, not its launch
        engine.synchronize()
        timeline.mark("gen", "step_done")
    return finished, rows, time.perf_counter() - t0


def _leader_loop(engine, comm, source, inbox: queue.SimpleQueue, out, cfg: GenerationConfig) -> None:
    weights = RankWeights(engine, comm)
    emit = Emitter(out, source, engine)
    sched = Scheduler(cfg.max_batch_tokens, cfg.max_running_jobs, comm.cfg_world, comm.sp.world,
                      weights=weights, release=source.release, failed=emit.failed)
    clock = loop_clock("generation")    # step time and the loop thread's CPU share (kit/loop_clock)
    while True:
        plan = comm.broadcast(sched.schedule(inbox, engine.running))
        failed, stats, reply = _apply(engine, comm, weights, plan)
        sched.update(plan, failed)      # the transitions (pages freed) before the events that tell them
        emit.applied(plan, failed, stats, reply)
        if plan.stop:
            break
        if not engine.running:
            source.drop_stale()   # unmap a pool the producer replaced (and open its new one) before the next job
            emit.idle(len(sched.pending))
            continue
        clock.begin()
        try:
            stepped = _step_or_fail(engine, emit, comm.cfg_world * comm.sp.world == 1)
        finally:
            clock.end()
        if stepped is not None:
            try:
                emit.stepped(*stepped, len(sched.pending))
            finally:
                engine.free(stepped[0])


def _commands(inbox: queue.SimpleQueue, segments: TrajectorySegments) -> Callable[[object], None]:
    """The command reader's handler: a TrajectoryHeld is settled at once (it closes a file, never waits on the
    loop), every other command goes to the loop's inbox."""
    def handle(msg) -> None:
        if isinstance(msg, TrajectoryHeld):
            segments.held(msg.name)
        else:
            inbox.put(msg)
    return handle


def _follower_loop(engine, comm, source) -> None:
    weights = RankWeights(engine, comm)
    while True:
        plan: StepPlan = comm.broadcast(None)
        _apply(engine, comm, weights, plan)
        if plan.stop:
            break
        if engine.running:
            engine.free(engine.step()[0])
        else:
            source.drop_stale()


def _device(cfg: GenerationConfig, rank: int) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    torch.cuda.set_device(device)
    frac = knobs.GPU_MEMORY_FRACTION.get()
    if frac:    # colocate: hold this rank to its share of the card, as understanding does (memory_plan.py)
        torch.cuda.set_per_process_memory_fraction(float(frac), device)
    return device


def _build(rank: int, world: int, port: int, cfg: GenerationConfig, device: torch.device,
           phase: Callable[[EnginePhase], None] = lambda p: None):
    """This rank's communicator, prefix source and engine(s), warmed up, and the shm KV pool opened when it is there
    (after the warm-up: the producer had that long to create it). Returns (engine, comm, source, warm-up stats).
    `phase` hears where it is (/health "phase")."""
    from services.model.loader import load_model
    from services.model.lora_registry import attach_lora

    from services.contract.limits import IMAGE_BLOCK, SIZE_TABLE
    from services.model import gemm_check
    from services.model.quant import GemmPolicy, use_policy

    from .cfg_parallel import CfgComm
    from .faults import inject_wrong_gemm
    from .engine import Engine, fp8_applies
    from .kv_source import PrefixSource
    from .rank_options import yield_gate
    from .reference import EngineSet, reference_factory    # RL jobs alone, the reference policy
    from .warmup import parse_sizes, run_warmup
    comm = CfgComm.init(rank, world, port, device, sp=cfg.sp, sp_mode=cfg.sp_mode) if world > 1 \
        else CfgComm.single()
    dtype = torch_dtype(cfg.dtype)
    phase(EnginePhase.LOADING_WEIGHTS)
    # weight streaming: each decoder layer goes to host memory as soon as it is loaded and quantised (the host holds
    # the served format), then only --weight-streaming-layers of them come back, into the streamer's device slots
    model = load_model(cfg.model, branch="gen", dtype=dtype, device=device, lora=list(cfg.lora),
                       quantization=cfg.quantization, layers_to_host=cfg.weight_streaming_layers > 0)
    model.eval()
    streaming = contextlib.nullcontext()
    if cfg.weight_streaming_layers:
        from services.model.weight_streaming import stream_decoder_layers
        streamer = stream_decoder_layers(model, cfg.weight_streaming_layers)
        log.info("weight streaming: %s", streamer.report())
        streaming = streamer.holding(0)      # layer 0 stands for every layer's shapes in the GEMM check
    attach_lora(model)     # resident LoRA adapters ($U1SERVE_LORA_MODULES etc.; lora_registry.py)
    inject_wrong_gemm(model)      # tests only (U1SERVE_FAULT_WRONG_GEMM)
    sizes = parse_sizes(cfg.default_size, cfg.warmup_sizes)
    if gemm_check.wanted(cfg.gemm_check, device, cfg.green_sm_percent):
        with streaming:
            found = gemm_check.require_right_gemms(model, gemm_check.rows_for_sizes(sizes, IMAGE_BLOCK),
                                                   f"generation rank {rank}")
        log.info("GEMM check: %d shape x row counts right against fp32 (%d quantised linears not checked)",
                 found["checked"], found["skipped"])
    source = PrefixSource(cfg.kv_pool_name, model.fingerprint, device,
                          geometry=(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype),
                          follow_handles=cfg.kv_pool_follow_handles == "on")
    gate = yield_gate(cfg, device)
    main = Engine(model, source, comm, yield_gate=gate, cuda_graphs=cfg.cuda_graphs,
                  graph_segment_layers=cfg.graph_segment_layers, graph_keys=cfg.step_graph_keys)
    if main.graphs.enabled and cfg.quantization == "fp8":   # fp8 pays from fewer rows where steps replay graphs
        use_policy(model, GemmPolicy.for_device(device, graphed=True))
        main.fp8 = fp8_applies(model)
    engine = EngineSet(main,
                       reference_factory(cfg, device, dtype, source, comm, gate) if cfg.rl_reference == "on"
                       else None)
    phase(EnginePhase.WARMING)
    warm = run_warmup(engine, sizes, cfg.warmup_steps,
                      table=list(SIZE_TABLE) if cfg.warmup_table == "on" else [])
    h0, h1 = comm.sp.kv_heads(model.num_kv_heads)      # this rank's share of each import (engine.admit)
    phase(EnginePhase.ATTACHING_KV_POOL)
    source.open_before_ready(cfg.kv_pool_wait_s or 0.0, heads=(h0, h1) if h1 - h0 < model.num_kv_heads else None)
    return engine, comm, source, warm


def run_rank(rank: int, world: int, port: int, cfg: GenerationConfig, inbox_conn, outbox_conn) -> None:
    """Process entry point (spawned by the supervisor); rank 0 gets the two pipe ends."""
    die_with_parent()
    ignore_stop_signals()   # a group-wide SIGTERM shuts down through the server, which stops us
    logging.basicConfig(level=cfg.log_level.upper(), format=f"%(asctime)s %(levelname)s gen-rank{rank}: %(message)s")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not _serve_rank(rank, world, port, cfg, inbox_conn, outbox_conn):
        os._exit(1)


def run_rank_thread(cfg: GenerationConfig, inbox_conn, outbox_conn) -> None:
    """Rank 0 of one as a thread of the serving process (--engine-unit thread; the fused colocate mode): no process
    settings (signals, parent death, thread count: the process's), the loop on its own CUDA stream
    (--stream-priority; services/model/streams.py) from the first allocation on. A failure raises (the unit's exit
    reason) instead of exiting the process."""
    if not _serve_rank(0, 1, 0, cfg, inbox_conn, outbox_conn):
        raise RuntimeError("the generation engine failed (its error is logged above)")


def _serve_rank(rank: int, world: int, port: int, cfg: GenerationConfig, inbox_conn, outbox_conn) -> bool:
    """Build and run the rank; False when it failed (logged, and reported to the HTTP process by rank 0)."""
    from services.model.streams import engine_stream

    from .link import Outbox, start_reader
    out = Outbox(outbox_conn, "u1-gen-events") if rank == 0 else None
    scope = contextlib.ExitStack()
    try:
        device = _device(cfg, rank)
        # "default" (process ranks): no change
        scope.enter_context(engine_stream(device, cfg.stream_priority, cfg.green_sm_percent))
        engine, comm, source, warm = _build(rank, world, port, cfg, device,
                                            (lambda p: out.send(Starting(p.value))) if out is not None
                                            else (lambda p: None))
        if rank == 0:
            from .capacity import measure
            out.send(WarmupStats(**warm))
            out.send(KvPoolStats(source.report))
            source.on_change = lambda report: out.send(KvPoolStats(report))     # opened on a job, dropped
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            segments = TrajectorySegments(cfg.kv_pool_name, knobs.STACK_ID.get())
            engine.primary.trajectory_segments = segments      # rollouts record into shared memory
            scope.callback(segments.close)     # what was never handed over is unlinked, however the loop ends
            start_reader(inbox_conn, _commands(inbox, segments), "u1-gen-commands",
                         on_close=lambda: inbox.put(Stop()))
            h0, h1 = comm.sp.kv_heads(engine.model.num_kv_heads)
            out.send(Ready(measure(engine.model, device, comm.cfg_world, h1 - h0)))
            _leader_loop(engine, comm, source, inbox, out, cfg)
        else:
            _follower_loop(engine, comm, source)
        source.close()
        comm.close()
        if out is not None:
            out.close()
        return True
    except BaseException as e:
        msg = f"rank {rank}: {e!r}"
        log.error("engine failed: %s\n%s", msg, traceback.format_exc())
        if out is not None:
            out.send(Fatal(msg))
            out.close(timeout=2)
        return False
    finally:
        scope.close()
