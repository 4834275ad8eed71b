"""The engine process(es): rank 0 receives requests over ZMQ, schedules every iteration, broadcasts the
step plan to the other TP ranks, samples, exports prefix KV and streams token ids back to the HTTP process.
"""
from __future__ import annotations

import datetime
import logging
import traceback

import torch
import torch.distributed as dist
import zmq

from services.base import knobs
from shm_transfer.errors import HandleError
from services.kit import timeline
from services.kit.loop_clock import loop_clock
from services.kit.proc import die_with_parent, ignore_stop_signals

from services.model.lora_registry import attach_lora
from services.model.memory_plan import UND_MIN_KV_TOKENS, kv_bytes_per_token, und_runtime_reserve
from services.contract.health import EnginePhase
from services.model.constants import torch_dtype
from services.model.oom import out_of_memory
from services.model.weights_io import POLL_S

from .config import EngineConfig
from .devices import rank_device
from .lora import plan_slots
from .protocol import Abort, Fatal, Ready, RequestOutput, Shutdown, Step, SubmitRequest, WeightsReply
from .protocol import Starting
from .sampling import (GREEDY, SamplingFailure, is_fatal_device_error, processed_logprob, sample,
                       token_logprobs)
from .scheduler import Scheduler
from .weights import EngineWeights, WeightsOp

log = logging.getLogger("u1serve.understanding.engine")
_HEARTBEAT_S = 2.0
_CRASH_MARKER = knobs.FAULT_UND_STEP_CRASH.get()     # tests only (a fault)


def _setup_tp(cfg: EngineConfig, rank: int):
    from services.model.parallel import TPContext
    if cfg.tp <= 1:
        return None
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{cfg.dist_port}", rank=rank,
                            world_size=cfg.tp, timeout=datetime.timedelta(hours=24))
    # step plans and idle heartbeats go over a CPU group: no GPU spin between steps
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=24)) if backend == "nccl" else None
    return TPContext(rank, cfg.tp, None, ctrl_group=ctrl)


def run_engine(rank: int, cfg: EngineConfig) -> None:
    """Process entry point (multiprocessing spawn). The rank dies with its server (so it never outlives it
    and its GPU memory) and leaves SIGINT/SIGTERM to the server, which stops it."""
    die_with_parent()
    ignore_stop_signals()
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    # the process's own thread count (OMP_NUM_THREADS, the CPU affinity) split over the ranks, as the generation
    # engine and the reference take it: a CPU GEMM's bits depend on it (docs/model.md "Bits")
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, cfg.tp)))
    out_sock = None
    if rank == 0:
        out_sock = zmq.Context().socket(zmq.PUSH)
        out_sock.connect(cfg.out_addr)
    _serve(rank, cfg, out_sock, lambda: _setup_tp(cfg, rank))


def run_engine_thread(cfg: EngineConfig) -> None:
    """The engine as a thread of the serving process (--engine-unit thread, tp 1; the fused colocate mode): no
    process settings (signals, parent death, thread count: the process's), the loop on its own CUDA stream
    (--stream-priority; services/model/streams.py) from the first allocation on."""
    from services.model.streams import engine_stream
    out_sock = zmq.Context.instance().socket(zmq.PUSH)
    out_sock.connect(cfg.out_addr)
    try:
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(rank_device(cfg.device, 1, 0, lambda: torch.cuda.current_device())))
        with engine_stream(cfg.device, cfg.stream_priority):
            _serve(0, cfg, out_sock, lambda: None)
    finally:
        out_sock.close(linger=1000)    # a Fatal still queued goes out first


def _serve(rank: int, cfg: EngineConfig, out_sock, setup_tp) -> None:
    try:
        Engine(rank, cfg, setup_tp(), out_sock).run()
    except Exception as e:  # report a load/runtime failure to the HTTP process, then die
        traceback.print_exc()
        if out_sock is not None:
            out_sock.send_pyobj(Fatal(f"{type(e).__name__}: {e}"))
        raise


class Engine:
    def __init__(self, rank: int, cfg: EngineConfig, tp, out_sock):
        from services.model.loader import load_model
        from services.model.tokenizer import NeoTokenizer
        from .model_runner import ModelRunner
        self.rank, self.cfg, self.tp = rank, cfg, tp
        # rank 0 tells the HTTP process where it is on the way to Ready (/health "phase")
        phase = (lambda p: out_sock.send_pyobj(Starting(p.value))) if out_sock is not None else (lambda p: None)
        phase(EnginePhase.LOADING_WEIGHTS)
        self.device = rank_device(cfg.device, cfg.tp, rank, lambda: torch.cuda.current_device())
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        self.dtype = torch_dtype(cfg.dtype)
        self.model = load_model(cfg.model, branch="und", dtype=self.dtype, device=self.device, tp=tp,
                                quantization=cfg.quantization)
        attach_lora(self.model)     # resident LoRA adapters ($U1SERVE_LORA_MODULES etc.; lora_registry.py)
        self.weights = EngineWeights(self.model, tp)
        tok = NeoTokenizer.from_dir(cfg.model)
        # the config is the request; what fits GPU memory may be less
        self.kv_cache_tokens = self._fit_kv_cache(cfg.kv_cache_tokens)
        self.max_model_len = min(cfg.max_model_len, self.kv_cache_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache_tokens, cfg.max_running_requests, self.max_model_len,
                                  self.device, self.dtype, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
                                  prefill_graph_max_tokens=cfg.prefill_graph_max_tokens, on_phase=phase)
        self.out = out_sock
        self.pool = None
        if cfg.kv_pool_name:   # every rank writes its KV-head slice of exported prefixes (any transport's handles)
            phase(EnginePhase.ATTACHING_KV_POOL)
            from shm_transfer.producer import attach_exporter     # a device pool: only in its creator's process
            self.pool = attach_exporter(cfg.kv_pool_name, expected_fingerprint=self.model.fingerprint)
            self._warm_export()
        self.yield_signal = None
        if rank == 0 and cfg.yield_signal:
            from shm_transfer.yield_signal import YieldSignal
            self.yield_signal = YieldSignal.create(cfg.yield_signal)
        self.clock = loop_clock("understanding")    # step time and the loop thread's CPU share (kit/loop_clock)
        if rank == 0:
            self.sched = Scheduler(self.kv_cache_tokens, cfg.max_running_requests, self.max_model_len,
                                   cfg.chunked_prefill_size, tok.img_context_id, cfg.prefix_cache,
                                   max_queue_wait_s=cfg.max_queue_wait_s)
            self.sched.model = self.model
            ctx = zmq.Context.instance()
            self.inp = ctx.socket(zmq.PULL)
            self.inp.bind(cfg.in_addr)
            self.out.send_pyobj(Ready(self.kv_cache_tokens, self.max_model_len))
            self._send([])

    def _fit_kv_cache(self, want: int) -> int:
        """With U1SERVE_GPU_MEMORY_FRACTION (colocate), cap this process's GPU memory at that share and
        shrink the KV cache to what fits next to the weights (all TP ranks agree on the smallest)."""
        frac = knobs.GPU_MEMORY_FRACTION.get()
        if not frac or not self.device.startswith("cuda"):
            return want
        dev = torch.device(self.device)
        torch.cuda.set_per_process_memory_fraction(frac, dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        budget = frac * total - torch.cuda.memory_allocated(dev)
        budget -= und_runtime_reserve(budget)   # activations, CUDA graphs, sampling (the memory plan's figure)
        m = self.model
        per_token = kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim,
                                       torch.empty((), dtype=self.dtype).element_size())
        fit = max(UND_MIN_KV_TOKENS, int(budget // per_token))
        n = min(want, fit)
        if self.tp is not None:
            t = torch.tensor([n], dtype=torch.int64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
        if n < want:
            log.warning("KV cache lowered from %d to %d tokens to fit GPU memory fraction %.3f: what this process "
                        "already holds (%.2f GiB: the weights and, in the fused colocate mode, the device KV pool of "
                        "--kv-pool-gb) takes the rest; raise --und-memory-fraction for a larger cache", want, n, frac,
                        torch.cuda.memory_allocated(dev) / 2**30)
        return n

    # ---- rank 0 --------------------------------------------------------------------------------
    def _recv(self, block: bool) -> bool:
        """Drain the request socket. Returns False on shutdown."""
        wait_s = POLL_S if self.weights.live.reading is not None else _HEARTBEAT_S   # a stage's read is polled
        timeout = int(wait_s * 1000) if block else 0
        while self.inp.poll(timeout):
            timeout = 0
            msg = self.inp.recv_pyobj()
            if isinstance(msg, SubmitRequest):
                timeline.mark("und", "engine_recv")
                self.sched.add(msg)
            elif isinstance(msg, Abort):
                self.sched.abort(msg.rid)
            elif isinstance(msg, WeightsOp):
                self.weights.take(msg.op)
            elif isinstance(msg, Shutdown):
                return False
        return True

    def _send(self, outs: list[RequestOutput]) -> None:
        self.out.send_pyobj(Step(outs, self.sched.snapshot()))

    def run(self) -> None:
        if self.rank != 0:
            return self._follow()
        was_busy = False
        while True:
            if not self._recv(block=not self.sched.has_work):
                self._broadcast("stop")
                return
            op = self.weights.next_op(self.sched)
            if op is not None:          # between steps, on every rank (weights.py)
                self._broadcast(WeightsOp(op))
                reply = self.weights.run(op, self.rank)
                if reply is not None:       # None: a stage still reading its files (weights_io.LiveWeights)
                    self.out.send_pyobj(WeightsReply(reply))
                self.weights.after(op, self.sched)
            scheduled = self.sched.schedule()
            if scheduled is None:
                outs = self.sched.take_outputs()
                if outs or was_busy:
                    self._send(outs)
                was_busy = False
                if self.tp is not None:
                    self._broadcast(None)  # heartbeat keeps followers' collectives alive
                continue
            was_busy = True
            self.clock.begin()
            try:
                self.execute(scheduled)
            except Exception as e:
                # A broken CUDA context must not keep serving (exit; the server restarts the engine); with TP
                # the ranks would diverge. Anything else fails only the request that broke the step.
                if self.tp is not None or is_fatal_device_error(e):
                    raise
                log.exception("engine step of %d request(s) failed", len(scheduled[1]))
                self.sched.step_failed(scheduled[1], f"engine step failed: {type(e).__name__}: {e}",
                                       "engine_oom" if out_of_memory(e) else "engine_error")
            finally:
                self.clock.end()
            self._send(self.sched.take_outputs())

    def execute(self, scheduled) -> None:
        """One iteration on rank 0: broadcast the plan, forward, export finished prefixes, sample, advance."""
        plan, entries = scheduled
        if _CRASH_MARKER and any(_CRASH_MARKER in r.rid for r, _, _ in entries):
            raise RuntimeError(f"CUDA error: injected by {knobs.FAULT_UND_STEP_CRASH.name}")   # a fatal device error
        plan.lora_slots = plan_slots(entries)
        # colocate QoS: a generation engine on these GPUs yields between its layers while this is up
        decode = self.yield_signal is not None and plan.num_tokens > plan.num_prefill_rows
        if decode:
            self.yield_signal.set_busy()
        try:
            timeline.mark("und", "engine_step")
            self._broadcast(plan)
            logits = self.runner.forward(plan)
            if timeline.ENABLED and plan.exports:
                self._mark_on_device("engine_forward")   # the prefill's end on the device, not its launch
            exported = self._export(plan)
            if timeline.ENABLED and plan.exports:
                self._mark_on_device("engine_export")
            sampled, logprobs = self._sample(logits, entries)
        finally:
            if decode:
                self.yield_signal.set_idle()
        self.sched.process(entries, sampled, exported, logprobs)

    def _mark_on_device(self, stage: str) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        timeline.mark("und", stage)

    def _broadcast(self, obj) -> None:
        if self.tp is not None:
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=self.tp.ctrl_group)

    def _sample(self, logits, entries) -> tuple[dict, dict]:
        """(rid -> token, rid -> (logprob, top alternatives) for the requests that asked for logprobs)."""
        reqs = self.sched.sampling_requests(entries)
        if not reqs:
            return {}, {}
        for r in reqs:
            if r.generator is None and not r.params.greedy:
                r.generator = r.params.make_generator(logits.device)
        params = [r.params if r.kind == "text" or r.msg.think_sample else GREEDY for r in reqs]
        # repetition penalty looks at prompt + output: r.tokens holds both (no per-step copies)
        toks = sample(logits, params, [r.generator for r in reqs], [r.tokens for r in reqs],
                      [r.output_ids for r in reqs])
        sampled = {r.rid: t for r, t in zip(reqs, toks)}
        want = [i for i, (r, t) in enumerate(zip(reqs, toks))
                if r.kind == "text" and r.params.logprobs is not None and not isinstance(t, SamplingFailure)]
        logprobs = {}
        if want:
            rows = logits[torch.tensor(want, dtype=torch.long, device=logits.device)]
            lps = token_logprobs(rows, [toks[i] for i in want], [reqs[i].params.logprobs for i in want])
            logprobs = {reqs[i].rid: lp for i, lp in zip(want, lps)}
        for i, (r, t) in enumerate(zip(reqs, toks)):       # RL think sampling: the processed distribution's
            if r.kind == "prefix" and r.msg.think_sample and not isinstance(t, SamplingFailure):
                logprobs[r.rid] = (processed_logprob(logits[i], r.params, t, r.tokens, r.output_ids), [])
        return sampled, logprobs

    def _export(self, plan) -> dict:
        """Write each finished prefix into its pages through the Transport (trimmed to the real token count;
        the handle keeps its transport fields, so a network handle stays one). With TP every
        rank writes its own KV-head slice of the same pages, then the ranks agree (all-reduce MIN) that
        every slice landed before rank 0 publishes the handle (docs/kv_contract.md, TP note)."""
        if not plan.exports:
            return {}
        from shm_transfer import KVHandle
        results = {}
        for rid, slots, handle_dict, t_offset in plan.exports:
            handle, err = None, None
            try:
                if self.pool is None or handle_dict is None:
                    raise RuntimeError("no KV pool configured (--kv-pool-name)")
                handle = KVHandle.from_dict(handle_dict)
                n = int(slots.numel())
                keep = self.pool.layout.pages_for(n)
                if n > handle.num_tokens:
                    raise RuntimeError(f"prefix of {n} tokens exceeds its {handle.num_tokens}-token allocation")
                if keep < len(handle.page_ids) and self.rank == 0:   # think ended early: unused pages back
                    self.pool.release(handle.replace(page_ids=handle.page_ids[keep:]))
                handle = handle.replace(page_ids=handle.page_ids[:keep], num_tokens=n, t_offset=int(t_offset))
                self.pool.export_kv(handle, self.runner.kv_pool, slots.to(self.runner.device), heads=self._heads())
            except HandleError as e:      # its pages were freed under it: the request was aborted (client gone)
                log.warning("export of %s not done: %s", rid, e)
                err = f"{type(e).__name__}: {e}"
            except Exception as e:
                log.exception("export of %s failed", rid)
                err = f"{type(e).__name__}: {e}"
            ok = err is None
            if self.tp is not None:
                flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                                    device=self.device if self.device.startswith("cuda") else "cpu")
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                if ok and int(flag.item()) == 0:
                    err = "KV export failed on another tensor-parallel rank"
            if self.rank == 0:   # the handle names the weights that computed it (generation checks it)
                results[rid] = {**handle.to_dict(), "weights_version": self.weights.version} if err is None else err
        return results

    def _warm_export(self) -> None:
        """Compile and run the export kernel now, not in the first prefix's step; a failure here never stops the
        start (the first export then compiles it, and fails that request if it must), as generation's import."""
        from shm_transfer.copy import warm_export
        try:
            secs = warm_export(self.pool.pool, self.runner.kv_pool, self.runner.scratch_slot, heads=self._heads())
            log.info("KV export kernel warmed in %.3f s", secs)
        except Exception as e:
            log.warning("KV export warm-up failed, the first image prefix pays it: %r", e)

    def _heads(self) -> tuple[int, int] | None:
        """This rank's global KV heads in the pool's pages (None: all of them, no tensor parallelism)."""
        if self.tp is None:
            return None
        h = self.runner.num_kv_heads
        return self.rank * h, (self.rank + 1) * h

    # ---- ranks > 0 -----------------------------------------------------------------------------
    def _follow(self) -> None:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.tp.ctrl_group)
            plan = box[0]
            if plan == "stop":
                return
            if plan is None:
                continue
            if isinstance(plan, WeightsOp):
                self.weights.run(plan.op, self.rank)
                continue
            self.runner.forward(plan)
            self._export(plan)

