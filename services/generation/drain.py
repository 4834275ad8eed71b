"""Wait until a generation service has no job queued or running, then exit 0: the Kubernetes preStop hook of a
generation container (deploy/k8s), so a pod being removed finishes its jobs before SIGTERM ends what is left
with 503 `shutting_down`. Exits at once when the service does not answer (nothing to wait for), and after
--timeout-s in any case (keep it under the pod's terminationGracePeriodSeconds).

    python -m services.generation.drain --port 8200 --timeout-s 110
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def busy(url: str, timeout_s: float = 2.0) -> int | None:
    """Jobs queued + running from the service's /health (open without the internal token); None: no answer."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:            # 503 while starting or failed: its body says the same
        try:
            body = json.load(e)
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    return int(body.get("queued") or 0) + int(body.get("running") or 0)


def drain(url: str, timeout_s: float, poll_s: float = 1.0) -> float:
    """Seconds waited until the service is idle, unreachable, or the timeout passed."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        n = busy(url)
        if not n:
            break
        time.sleep(poll_s)
    return time.monotonic() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--timeout-s", type=float, default=110.0)
    args = p.parse_args(argv)
    waited = drain(f"http://{args.host}:{args.port}", args.timeout_s)
    print(f"generation drained after {waited:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
