"""Polling helpers shared by the tests that watch real processes: until a condition holds, a service answers, a
process group is gone."""
import os
import signal
import subprocess
import time
from typing import Callable

import httpx


def wait_until(cond, timeout: float = 30.0, interval: float = 0.05):
    """Poll `cond` until it returns something truthy and return that; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)


def wait_ok(url: str, proc: subprocess.Popen, output: Callable[[], str], timeout: float,
            what: str = "service", interval: float = 0.3) -> httpx.Response:
    """Poll `url` until it answers 200 (the response); RuntimeError with the output when the process exits or
    the time is up."""
    def ok():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{output()}")
        try:
            r = httpx.get(url, timeout=2)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 200 else None
    try:
        return wait_until(ok, timeout, interval=interval)
    except TimeoutError:
        raise RuntimeError(f"{what} not up in time:\n{output()}") from None


def stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), SIGKILL after `timeout` s; returns
    once `proc` is reaped."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
