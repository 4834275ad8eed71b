"""Engine rank process: load the gen branch, then loop admission -> one batched step -> events.

Rank 0 (the leader) talks to the HTTP process through two queues and decides, between steps, which
jobs join (FIFO within `max_batch_tokens`) and which leave (cancelled); it broadcasts that plan to the
other CFG ranks, so every rank runs the same job list in lock step.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import time
import traceback
from dataclasses import asdict

import torch

from . import float_image
from .request import ApiError, GenerateJob, error_event

log = logging.getLogger("u1serve.generation.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _job_from_dict(d: dict) -> GenerateJob:
    d = dict(d)
    d["cfg_interval"] = tuple(d["cfg_interval"])
    return GenerateJob(**d)


def _emit_error(out_q, rid: str, event: dict) -> None:
    out_q.put({"request_id": rid, **event})
    out_q.put({"request_id": rid, "type": "done", "outcome": "error"})


class Scheduler:
    """Step-level admission: FIFO, bounded by image tokens per forward and by job count."""

    def __init__(self, max_batch_tokens: int, max_running_jobs: int, world: int):
        self.max_batch_tokens = max_batch_tokens
        self.max_running_jobs = max_running_jobs
        self.world = world
        self.pending: collections.deque[GenerateJob] = collections.deque()

    def tokens(self, spec: GenerateJob) -> int:
        per_rank = -(-len(spec.branches) // self.world)  # the busiest rank's share
        return spec.num_tokens * spec.n * per_rank

    def pick(self, running_tokens: int, running_jobs: int) -> list[GenerateJob]:
        out = []
        budget = self.max_batch_tokens - running_tokens
        while self.pending and running_jobs + len(out) < self.max_running_jobs:
            need = self.tokens(self.pending[0])
            if need > budget and (running_jobs or out):
                break  # strict FIFO: a big job is not overtaken forever by small ones
            out.append(self.pending.popleft())
            budget -= need
        return out

    def remove(self, request_id: str) -> GenerateJob | None:
        for spec in self.pending:
            if spec.request_id == request_id:
                self.pending.remove(spec)
                return spec
        return None


def _apply_plan(engine, comm, plan: dict, stats_out: list) -> tuple[dict, list]:
    """Drop and admit as rank 0 decided; agree on failures across ranks. Returns (errors, admitted)."""
    for rid in plan["drop"]:
        engine.drop(rid)
    admitted, errors = [], {}
    for d in plan["admit"]:
        spec = _job_from_dict(d)
        try:
            job, stats = engine.admit(spec)
            admitted.append(job)
            stats_out.extend(stats)
        except ApiError as e:
            errors[spec.request_id] = e.to_event()
        except torch.cuda.OutOfMemoryError:
            errors[spec.request_id] = error_event(503, "out of device memory for this job's KV "
                                                  "buffer; retry later", code="engine_oom")
        except Exception as e:  # a bug or a broken handle: fail the job, keep serving
            log.exception("admission of %s failed", spec.request_id)
            errors[spec.request_id] = error_event(500, f"admission failed: {e!r}",
                                                  code="engine_error")
    merged = {}
    for part in comm.all_gather_objects(errors):
        for rid, ev in part.items():
            merged.setdefault(rid, ev)
    for job in admitted:
        if job.request_id in merged:
            job.free()
        else:
            engine.add(job)
    return merged, [j for j in admitted if j.request_id not in merged]


def _drain(in_q, block: bool) -> list:
    msgs = []
    try:
        msgs.append(in_q.get(timeout=0.5) if block else in_q.get_nowait())
        while True:
            msgs.append(in_q.get_nowait())
    except queue.Empty:
        pass
    return msgs


QUEUED_LEASE_S = 5.0  # a queued job's prefix pages stay leased at least this far ahead (short: a dead
# service must not hold them long)
_KEEP_ALIVE_EVERY_S = 1.5


def _leader_loop(engine, comm, source, in_q, out_q, args: dict) -> None:
    sched = Scheduler(args["max_batch_tokens"], args["max_running_jobs"], comm.world)
    stop = False
    last_keep_alive = 0.0
    while not stop:
        if sched.pending and time.monotonic() - last_keep_alive > _KEEP_ALIVE_EVERY_S:
            source.keep_alive([h for spec in sched.pending for h in spec.handles.values()], QUEUED_LEASE_S)
            last_keep_alive = time.monotonic()
        drop = []
        for msg in _drain(in_q, block=not engine.running and not sched.pending):
            if msg[0] == "stop":
                stop = True
            elif msg[0] == "job":
                spec = _job_from_dict(msg[1])
                sched.pending.append(spec)
                source.keep_alive(spec.handles.values(), QUEUED_LEASE_S)  # at once: its lease may be short
            elif msg[0] == "cancel":
                rid = msg[1]
                spec = sched.remove(rid)
                if spec is not None:  # never imported: free its pages now, not at lease expiry
                    source.release(spec.handles.values())
                if spec is not None or any(j.request_id == rid for j in engine.running):
                    if spec is None:
                        drop.append(rid)
                    _emit_error(out_q, rid, error_event(499, "request cancelled",
                                                        code="cancelled", type="cancelled"))
        running_tokens = sum(sched.tokens(j.spec) for j in engine.running)
        admit = [] if stop else sched.pick(running_tokens, len(engine.running))
        plan = comm.broadcast({"admit": [asdict(s) for s in admit], "drop": drop, "stop": stop})
        stats: list = []
        errors, _ = _apply_plan(engine, comm, plan, stats)
        for s in stats:
            out_q.put({"type": "stats", **s})
        for spec in admit:
            if spec.request_id in errors:
                source.release(spec.handles.values())
                _emit_error(out_q, spec.request_id, errors[spec.request_id])
        if stop:
            break
        if not engine.running:
            out_q.put({"type": "stats", "stat": "idle", "running": 0,
                       "queued": len(sched.pending)})
            continue
        t0 = time.perf_counter()
        finished, rows = engine.step()
        seconds = time.perf_counter() - t0
        for job in list(engine.running) + finished:
            out_q.put({"request_id": job.request_id, "type": "progress", "step": job.step,
                       "total": job.num_inference_steps})
            if job.preview is not None:
                k, frames = job.preview
                job.preview = None
                for i in range(job.n):
                    out_q.put({"request_id": job.request_id, "type": "preview", "index": i,
                               "partial_image_index": k, "step": job.step, "pixels": frames[i]})
        for job in finished:
            pixels = engine.pixels(job)
            image_handle = None
            if job.spec.export_image:
                try:
                    image_handle = float_image.export(source, job.x[0])
                except ApiError as e:
                    _emit_error(out_q, job.request_id, e.to_event())
                    job.free()
                    continue
            for i in range(job.n):
                out_q.put({"request_id": job.request_id, "type": "image", "index": i,
                           "pixels": pixels[i], "branch_steps": job.branch_steps, "image_handle": image_handle})
            out_q.put({"type": "stats", "stat": "branch_steps", "branch_steps": job.branch_steps})
            out_q.put({"request_id": job.request_id, "type": "done", "outcome": "ok"})
            job.free()
        out_q.put({"type": "stats", "stat": "step", "seconds": seconds, "tokens": rows,
                   "jobs": len(engine.running) + len(finished), "running": len(engine.running),
                   "queued": len(sched.pending), "peak_memory": engine.peak_memory()})


def _follower_loop(engine, comm) -> None:
    while True:
        plan = comm.broadcast(None)
        _apply_plan(engine, comm, plan, [])
        if plan["stop"]:
            break
        if engine.running:
            for job in engine.step()[0]:
                job.free()


def _tie_to_parent() -> None:
    """Exit with the HTTP process: die with it (Linux PDEATHSIG) and leave SIGINT/SIGTERM to it, so a
    group-wide signal shuts down through the server (which stops us) instead of looking like a crash."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_rank(rank: int, world: int, port: int, args: dict, in_q, out_q) -> None:
    """Process entry point (spawned by the supervisor)."""
    _tie_to_parent()
    logging.basicConfig(level=os.environ.get("U1SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s gen-rank{rank}: %(message)s")
    try:
        if args.get("threads"):
            torch.set_num_threads(int(args["threads"]))
        if args["device"] == "cuda":
            device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        from services.model.loader import load_model

        from .cfg_parallel import CfgComm
        from .engine import Engine
        from .kv_source import PrefixSource
        comm = CfgComm.init(rank, world, port, device) if world > 1 else CfgComm.single()
        model = load_model(args["model"], branch="gen", dtype=_DTYPES[args["dtype"]], device=device,
                           lora=[tuple(x) for x in args.get("lora") or ()],
                           quantization=args.get("quantization"))
        model.eval()
        source = PrefixSource(args["kv_pool_name"], model.fingerprint, device,
                              geometry=(model.num_layers, model.num_kv_heads, model.head_dim,
                                        model.dtype))
        engine = Engine(model, source, comm)
        from .warmup import parse_sizes, run_warmup
        warm = run_warmup(engine, parse_sizes(args.get("default_size"), args.get("warmup_sizes")),
                          int(args.get("warmup_steps", 0)))
        if rank == 0:
            out_q.put({"type": "stats", "stat": "warmup", **warm})
            out_q.put({"type": "ready"})
            _leader_loop(engine, comm, source, in_q, out_q, args)
        else:
            _follower_loop(engine, comm)
        source.close()
        comm.close()
    except BaseException as e:
        msg = f"rank {rank}: {e!r}"
        log.error("engine failed: %s\n%s", msg, traceback.format_exc())
        if out_q is not None:
            try:
                out_q.put({"type": "fatal", "message": msg})
            except Exception:
                pass
        os._exit(1)
