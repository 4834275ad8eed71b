"""Polling helper shared by the tests that watch real processes."""
import time


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
