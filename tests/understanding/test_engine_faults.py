"""The engine loop (rank 0, in this process, over its real ZMQ sockets) under a failing step: an ordinary
error fails that step's requests and the engine goes on; an error that leaves the CUDA context unusable
(reported by CUDA as `CUDA error: ...`, e.g. a device-side assert) ends the loop, so the process exits and
the server's supervisor restarts it — never a broken engine that looks healthy. The failure is injected at
the step boundary (`Engine.execute`): a CPU machine cannot produce a real CUDA error."""
from __future__ import annotations

import threading

import pytest
import zmq

from services.understanding.engine import Engine, EngineConfig
from services.understanding.protocol import Shutdown, SubmitRequest
from services.understanding.sampling import SamplingParams


class _Loop:
    def __init__(self, tiny_dir: str, tmp_path):
        cfg = EngineConfig(model_dir=tiny_dir, device="cpu", dtype="float32", kv_cache_tokens=2048, max_running=4,
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

    def submit(self, rid: str):
        self.inp.send_pyobj(SubmitRequest(rid, [1, 2, 3, 4], [], SamplingParams(max_tokens=3, temperature=0.0)))

    def finished(self, rid: str, timeout_ms: int = 30000):
        while self.out.poll(timeout_ms):
            msg = self.out.recv_pyobj()
            for o in msg.get("outs", []):
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


def test_an_ordinary_step_error_fails_the_step_and_the_engine_goes_on(loop):
    _fail_once(loop.engine, RuntimeError("boom"))
    loop.thread.start()
    loop.submit("a")
    o = loop.finished("a")
    assert o.finish_reason == "error" and o.error_code == "engine_error" and "boom" in o.error
    loop.submit("b")
    assert loop.finished("b").finish_reason in ("stop", "length")
    loop.inp.send_pyobj(Shutdown())
    loop.thread.join(30)
    assert not loop.thread.is_alive() and loop.error is None


@pytest.mark.parametrize("message", ["CUDA error: device-side assert triggered",
                                     "CUDA error: an illegal memory access was encountered"])
def test_a_cuda_error_ends_the_engine_loop(loop, message):
    _fail_once(loop.engine, RuntimeError(message))
    loop.thread.start()
    loop.submit("a")
    loop.thread.join(30)
    assert not loop.thread.is_alive(), "the engine kept running on a broken CUDA context"
    assert isinstance(loop.error, RuntimeError) and message in str(loop.error)
