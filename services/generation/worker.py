"""Engine rank process: load the gen branch, then loop admission -> one batched step -> events.

Rank 0 (the leader) talks to the HTTP process over the link (link.py): a reader thread fills its inbox and an
outbox thread writes its events, so the engine loop never waits on a pipe. Between steps it decides which jobs
join (FIFO within `max_batch_tokens`) and which leave (cancelled) and broadcasts that plan to the other CFG
ranks, so every rank runs the same job list in lock step.

Messages in: ("job", GenerateRequest), ("cancel", request_id), ("stop",). Events out (dicts): ready, stats,
fatal, and per job started -> progress ... -> image (pixels as a raw frame) ... -> done, or one error (final).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import time
import traceback

import torch

from services.kit import timeline
from services.kit.proc import die_with_parent, ignore_stop_signals

from . import float_image
from .inputs import APIError, GenerateRequest, busiest_rank_tokens
from .weights import RankWeights
from .rollout import send_results

log = logging.getLogger("u1serve.generation.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IDLE_WAIT_S = 0.5


class Scheduler:
    """Step-level admission: FIFO, bounded by image tokens per forward and by job count."""

    def __init__(self, max_batch_tokens: int, max_running_jobs: int, world: int, sp: int = 1):
        self.max_batch_tokens = max_batch_tokens
        self.max_running_jobs = max_running_jobs
        self.world = world      # CFG ranks
        self.sp = sp
        self.pending: collections.deque[GenerateRequest] = collections.deque()

    def tokens(self, spec: GenerateRequest) -> int:
        return busiest_rank_tokens(spec, self.world, self.sp)

    def pick(self, running_tokens: int, running_jobs: int) -> list[GenerateRequest]:
        out = []
        budget = self.max_batch_tokens - running_tokens
        while self.pending and running_jobs + len(out) < self.max_running_jobs:
            need = self.tokens(self.pending[0])
            if need > budget and (running_jobs or out):
                break  # strict FIFO: a big job is not overtaken forever by small ones
            out.append(self.pending.popleft())
            budget -= need
        return out

    def remove(self, request_id: str) -> GenerateRequest | None:
        for spec in self.pending:
            if spec.request_id == request_id:
                self.pending.remove(spec)
                return spec
        return None


def _apply_plan(engine, comm, plan: dict, stats_out: list) -> dict:
    """Drop and admit as rank 0 decided; agree on failures across ranks. Returns {request_id: error event}."""
    for rid in plan["drop"]:
        engine.drop(rid)
    admitted, errors = [], {}
    for spec in plan["admit"]:
        try:
            job, stats = engine.admit(spec)
            admitted.append(job)
            stats_out.extend(stats)
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
    return merged


def _drain(inbox: queue.SimpleQueue, block: bool) -> list:
    msgs = []
    try:
        msgs.append(inbox.get(timeout=_IDLE_WAIT_S) if block else inbox.get_nowait())
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return msgs


def _leader_loop(engine, comm, source, inbox, out, args: dict) -> None:
    sched = Scheduler(args["max_batch_tokens"], args["max_running_jobs"], comm.cfg_world, comm.sp.world)
    weights = RankWeights(engine, comm)

    def refuse(spec, err: APIError) -> None:   # a queued job that never imported its pages
        source.release(spec.handles.values())
        out.send({"request_id": spec.request_id, **err.event()})
    stop = False
    while not stop:
        drop = []
        for msg in _drain(inbox, block=not engine.running and not sched.pending):
            if msg[0] == "stop":
                stop = True
            elif msg[0] == "job":
                sched.pending.append(msg[1])
            elif msg[0] == "weights":
                weights.take(msg[1])
            elif msg[0] == "cancel":  # the HTTP process already ended the stream; just stop the work
                spec = sched.remove(msg[1]) or weights.remove_held(msg[1])
                if spec is not None:  # never imported: free its pages now, not at lease expiry
                    source.release(spec.handles.values())
                elif any(j.request_id == msg[1] for j in engine.running):
                    drop.append(msg[1])
        running_tokens = sum(sched.tokens(j.spec) for j in engine.running)
        weights.screen(sched.pending, refuse)      # jobs whose prefix another weights version computed
        op = None if stop else weights.next_op(bool(engine.running))
        admit = [] if stop or not weights.admitting(op) else sched.pick(running_tokens, len(engine.running))
        plan = comm.broadcast({"admit": admit, "drop": drop, "stop": stop, "weights": op})
        stats: list = []
        errors = _apply_plan(engine, comm, plan, stats)
        if op is not None:
            out.send({"type": "stats", "stat": "weights", **weights.run(op)})
            if op["op"] != "stage":
                weights.release_held(sched.pending, refuse)
        for s in stats:
            out.send({"type": "stats", **s})
        for spec in admit:
            if spec.request_id in errors:
                source.release(spec.handles.values())
                out.send({"request_id": spec.request_id, **errors[spec.request_id]})
            else:
                out.send({"request_id": spec.request_id, "type": "started",
                          "weights_version": engine.weights_version})
                timeline.mark("gen", "admitted")
        if stop:
            break
        if not engine.running:
            source.drop_stale()   # unmap a pool the producer replaced, not only at the next job
            out.send({"type": "stats", "stat": "idle", "running": 0, "queued": len(sched.pending)})
            continue
        t0 = time.perf_counter()
        finished, rows = engine.step()
        if timeline.ENABLED:       # the step's end on the device, not its launch
            engine.synchronize()
            timeline.mark("gen", "step_done")
        seconds = time.perf_counter() - t0
        for job in list(engine.running) + finished:
            out.send({"request_id": job.request_id, "type": "progress", "step": job.step,
                      "total": job.num_inference_steps})
            if job.preview is not None:
                k, frames = job.preview
                job.preview = None
                for i in range(job.n):
                    out.send({"request_id": job.request_id, "type": "preview", "index": i,
                              "partial_image_index": k, "step": job.step}, pixels=frames[i])
        # the step's stats before its images: a client that got its last image finds the step in /metrics
        out.send({"type": "stats", "stat": "step", "seconds": seconds, "tokens": rows,
                  "jobs": len(engine.running) + len(finished), "running": len(engine.running),
                  "queued": len(sched.pending), "peak_memory": engine.peak_memory(),
                  "graph": engine.graphs.last})
        for job in finished:
            if not send_results(out, job):       # an RL job whose images are not wanted
                out.send({"request_id": job.request_id, "type": "done"})
                job.free()
                continue
            pixels = engine.pixels(job)
            timeline.mark("gen", "pixels")
            image_handle = None
            if job.spec.export_image:
                try:
                    image_handle = float_image.export(source, job.x[0], job.spec.handles["cond"])
                except APIError as e:
                    out.send({"request_id": job.request_id, **e.event()})
                    job.free()
                    continue
            for i in range(job.n):
                out.send({"request_id": job.request_id, "type": "image", "index": i,
                          "branch_steps": job.branch_steps, "image_handle": image_handle,
                          "weights_version": engine.weights_version}, pixels=pixels[i])
            out.send({"type": "stats", "stat": "branch_steps", "branch_steps": job.branch_steps})
            out.send({"request_id": job.request_id, "type": "done"})
            job.free()


def _follower_loop(engine, comm, source) -> None:
    weights = RankWeights(engine, comm)
    while True:
        plan = comm.broadcast(None)
        _apply_plan(engine, comm, plan, [])
        if plan.get("weights") is not None:
            weights.run(plan["weights"])
        if plan["stop"]:
            break
        if engine.running:
            for job in engine.step()[0]:
                job.free()
        else:
            source.drop_stale()


def run_rank(rank: int, world: int, port: int, args: dict, inbox_conn, outbox_conn) -> None:
    """Process entry point (spawned by the supervisor); rank 0 gets the two pipe ends."""
    die_with_parent()
    ignore_stop_signals()   # a group-wide SIGTERM shuts down through the server, which stops us
    logging.basicConfig(level=str(args.get("log_level", "info")).upper(),
                        format=f"%(asctime)s %(levelname)s gen-rank{rank}: %(message)s")
    from .link import Outbox, start_reader
    out = Outbox(outbox_conn, "u1-gen-events") if rank == 0 else None
    try:
        if args.get("threads"):
            torch.set_num_threads(int(args["threads"]))
        if args["device"] == "cuda":
            device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        from services.model.loader import load_model

        from .capacity import measure
        from .cfg_parallel import CfgComm
        from .engine import Engine
        from .kv_source import PrefixSource
        from .rank_options import yield_gate
        comm = CfgComm.init(rank, world, port, device, sp=int(args.get("sp", 1)),
                            sp_mode=args.get("sp_mode", "ulysses")) if world > 1 else CfgComm.single()
        model = load_model(args["model"], branch="gen", dtype=_DTYPES[args["dtype"]], device=device,
                           lora=[tuple(x) for x in args.get("lora") or ()],
                           quantization=args.get("quantization"))
        model.eval()
        source = PrefixSource(args["kv_pool_name"], model.fingerprint, device,
                              geometry=(model.num_layers, model.num_kv_heads, model.head_dim,
                                        model.dtype))
        gate = yield_gate(args, device)
        engine = Engine(model, source, comm, yield_gate=gate, cuda_graphs=args.get("cuda_graphs", "off"))
        from .reference import EngineSet, reference_factory    # RL jobs alone, the reference policy
        engine = EngineSet(engine, reference_factory(args, device, _DTYPES, source, comm, gate)
                           if args.get("rl_reference") == "on" else None)
        from .warmup import parse_sizes, run_warmup
        warm = run_warmup(engine, parse_sizes(args.get("default_size"), args.get("warmup_sizes")),
                          int(args.get("warmup_steps", 0)))
        if rank == 0:
            out.send({"type": "stats", "stat": "warmup", **warm})
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            start_reader(inbox_conn, inbox.put, "u1-gen-commands", on_close=lambda: inbox.put(("stop",)))
            h0, h1 = comm.sp.kv_heads(model.num_kv_heads)
            out.send({"type": "ready", "capacity": measure(model, device, comm.cfg_world, h1 - h0)})
            _leader_loop(engine, comm, source, inbox, out, args)
        else:
            _follower_loop(engine, comm, source)
        source.close()
        comm.close()
        if out is not None:
            out.close()
    except BaseException as e:
        msg = f"rank {rank}: {e!r}"
        log.error("engine failed: %s\n%s", msg, traceback.format_exc())
        if out is not None:
            out.send({"type": "fatal", "message": msg})
            out.close(timeout=2)
        os._exit(1)
