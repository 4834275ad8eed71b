"""The engine loop (rank 0, in this process, over its real ZMQ sockets) under a failing step: an ordinary
error fails that step's requests and the engine goes on; an error that leaves the CUDA context unusable
(reported by CUDA as `CUDA error: ...`, e.g. a device-side assert) ends the loop, so the process exits and
the server's supervisor restarts it — never a broken engine that looks healthy. The failure is injected at
the step boundary (`Engine.execute`): a CPU machine cannot produce a real CUDA error. A step of several requests
that fails is isolated: each runs alone once, so only the request that breaks its own step fails."""
from __future__ import annotations

import threading

import pytest
import torch
import zmq

from services.understanding.config import EngineConfig
from services.understanding.engine import Engine
from services.understanding.protocol import Shutdown, SubmitRequest
from services.understanding.sampling import SamplingParams


class _Loop:
    def __init__(self, tiny_dir: str, tmp_path):
        cfg = EngineConfig(model=tiny_dir, device="cpu", dtype="float32", kv_cache_tokens=2048, max_running_requests=4,
                           max_model_len=1024, chunked_prefill_size=0, in_addr=f"ipc://{tmp_path}/in",
                           out_addr=f"ipc://{tmp_path}/out")
        self.ctx = zmq.Context()
        self.out = self.ctx.socket(zmq.PULL)
        self.out.bind(cfg.out_addr)
        engine_out = self.ctx.socket(zmq.PUSH)
        engine_out.connect(cfg.out_addr)
        self.engine = Engine(0, cfg, None, engine_out)
        self.inp = self.ctx.socket(zmq.PUSH)
        self.inp.connect(cfg.in_addr)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.engine.run()
        except BaseException as e:   # what run_engine would report as fatal before the process exits
            self.error = e

    def submit(self, rid: str, ids: tuple[int, ...] = (1, 2, 3, 4)):
        self.inp.send_pyobj(SubmitRequest(rid, list(ids), [], SamplingParams(max_tokens=3, temperature=0.0)))

    def finished(self, rid: str, timeout_ms: int = 30000):
        while self.out.poll(timeout_ms):
            msg = self.out.recv_pyobj()
            for o in getattr(msg, "outs", []):
                if o.rid == rid and o.finish_reason is not None:
                    return o
        raise AssertionError(f"{rid} did not finish")

    def close(self):
        self.ctx.destroy(linger=0)


@pytest.fixture
def loop(tiny_dir, tmp_path):
    lp = _Loop(tiny_dir, tmp_path)
    yield lp
    lp.close()


def _fail_once(engine, exc):
    real = engine.execute

    def execute(scheduled):
        engine.execute = real
        raise exc
    engine.execute = execute


@pytest.mark.parametrize("exc, code", [(RuntimeError("boom"), "engine_error"),
                                       (torch.OutOfMemoryError("boom: tried to allocate 2.00 GiB"), "engine_oom")])
def test_an_ordinary_step_error_fails_the_step_and_the_engine_goes_on(loop, exc, code):
    """An ordinary error, or an allocation that failed (engine_oom: a 500 naming it, textgen.output_error), fails
    the step's request, not the engine: the next request is served."""
    _fail_once(loop.engine, exc)
    loop.thread.start()
    loop.submit("a")
    o = loop.finished("a")
    assert o.finish_reason == "error" and o.error_code == code and "boom" in o.error
    loop.submit("b")
    assert loop.finished("b").finish_reason in ("stop", "length")
    loop.inp.send_pyobj(Shutdown())
    loop.thread.join(30)
    assert not loop.thread.is_alive() and loop.error is None


def test_a_slow_weight_read_never_stalls_the_steps_and_times_out(loop, tmp_path, monkeypatch):
    """A weight update whose files read slowly (injected: U1SERVE_FAULT_WEIGHTS_READ_S) is read in a thread, off
    the step loop: a chat is answered while it reads, and the stage fails 504 weights_read_timeout after
    U1SERVE_WEIGHTS_READ_TIMEOUT_S, the weights unchanged."""
    import time

    from safetensors.torch import save_file

    from services.understanding.protocol import WeightsReply
    from services.understanding.weights import WeightsOp
    monkeypatch.setenv("U1SERVE_FAULT_WEIGHTS_READ_S", "60")
    monkeypatch.setenv("U1SERVE_WEIGHTS_READ_TIMEOUT_S", "3")
    update = str(tmp_path / "update.safetensors")
    save_file({"language_model.lm_head.weight": torch.zeros(1)}, update)
    loop.thread.start()
    t0 = time.monotonic()
    loop.inp.send_pyobj(WeightsOp({"op": "stage", "id": "slow", "version": "9", "path": update}))
    loop.submit("during-read")
    chat_done = reply = None
    while reply is None and loop.out.poll(30000):
        msg = loop.out.recv_pyobj()
        if isinstance(msg, WeightsReply):
            reply = msg
        elif any(o.rid == "during-read" and o.finish_reason is not None for o in getattr(msg, "outs", [])):
            chat_done = time.monotonic() - t0
    assert chat_done is not None and chat_done < 3          # answered while the update still read its files
    assert reply is not None and not reply.result["ok"], reply
    assert reply.result["error"]["status"] == 504 and reply.result["error"]["code"] == "weights_read_timeout"
    assert 3 <= time.monotonic() - t0 < 15 and loop.engine.weights.version == "0"
    loop.submit("after-read")
    assert loop.finished("after-read").finish_reason in ("stop", "length")
    loop.inp.send_pyobj(Shutdown())
    loop.thread.join(30)
    assert loop.error is None


GOOD = {"g0": (1, 2, 3, 4), "g1": (5, 6, 7), "g2": (9, 8, 7, 6, 5)}


def _reference_tokens(ref) -> dict[str, list[int]]:
    from services.model import prompts as PR
    from services.model import reference as R
    model, tok = ref
    return {rid: R.generate_text(model, tok, PR.PromptInput(list(ids), []), max_new_tokens=3)
            for rid, ids in GOOD.items()}


def _outputs(loop, rids, timeout_ms: int = 60000) -> dict:
    """rid -> (finish_reason, error_code, all new ids, error) once every rid finished."""
    got = {rid: [] for rid in rids}
    done = {}
    while len(done) < len(rids) and loop.out.poll(timeout_ms):
        for o in getattr(loop.out.recv_pyobj(), "outs", []):
            if o.rid in got:
                got[o.rid] += o.new_ids
                if o.finish_reason is not None:
                    done[o.rid] = (o.finish_reason, o.error_code, got[o.rid], o.error)
    assert len(done) == len(rids), done
    return done


def test_a_request_that_breaks_a_shared_step_fails_alone(loop, ref):
    """A prompt with a token id outside the vocabulary (the HTTP side never lets one through) makes the packed
    forward raise: it fails, its batch-mates are recomputed and answer exactly as without it."""
    for rid, ids in GOOD.items():
        loop.submit(rid, ids)
    loop.submit("bad", (1, 2, 10**7, 4))
    loop.thread.start()                       # all four arrive before the first step: one packed batch
    out = _outputs(loop, [*GOOD, "bad"])
    assert out["bad"][:2] == ("error", "engine_error") and "IndexError" in out["bad"][3], out["bad"]
    want = _reference_tokens(ref)
    for rid in GOOD:
        assert out[rid][0] == "length" and out[rid][2] == want[rid], (rid, out[rid])
    assert loop.engine.sched.stats.preemptions >= len(GOOD)     # the isolation round
    loop.inp.send_pyobj(Shutdown())
    loop.thread.join(30)
    assert loop.error is None and not loop.engine.sched.has_work


def test_a_shared_step_that_fails_once_fails_nobody(loop, ref):
    """A failure nobody reproduces alone (transient): every request of the step runs alone once and all finish."""
    for rid, ids in GOOD.items():
        loop.submit(rid, ids)
    _fail_once(loop.engine, RuntimeError("transient"))
    loop.thread.start()
    out = _outputs(loop, list(GOOD))
    want = _reference_tokens(ref)
    assert {rid: (o[0], o[2]) for rid, o in out.items()} == {rid: ("length", want[rid]) for rid in GOOD}
    loop.inp.send_pyobj(Shutdown())
    loop.thread.join(30)
    assert loop.error is None


@pytest.mark.parametrize("message", ["CUDA error: device-side assert triggered",
                                     "CUDA error: an illegal memory access was encountered"])
def test_a_cuda_error_ends_the_engine_loop(loop, message):
    _fail_once(loop.engine, RuntimeError(message))
    loop.thread.start()
    loop.submit("a")
    loop.thread.join(30)
    assert not loop.thread.is_alive(), "the engine kept running on a broken CUDA context"
    assert isinstance(loop.error, RuntimeError) and message in str(loop.error)
