"""The stack's waiting limits, declared once, and the order they must keep so that an overloaded stack answers
429 with Retry-After (the queue's own timeout), never a 504 from the gateway giving up first.

- A job queued in generation sends a heartbeat every GEN_HEARTBEAT_S (an SSE comment): below the gateway's
  idle limit, so the gateway keeps waiting until generation's queue timeout answers 429 `queue_timeout`.
- That queue timeout is below the gateway's request deadline (else the deadline's 504 comes first).
- Understanding sends nothing while a request waits for admission, nor while an image request waits for KV pool
  pages: its queue timeout and its pages wait are below the gateway's idle limit.

`u1serve up` checks the flags it passes (`problems`) and refuses a stack whose limits are out of order.
"""
from __future__ import annotations

import argparse
import shlex

from services.base.knobs import GATEWAY_FLAGS

GATEWAY_IDLE_TIMEOUT_S = 300.0        # gateway --upstream-idle-timeout-s
GATEWAY_REQUEST_TIMEOUT_S = 3600.0    # gateway --request-timeout-s
GEN_MAX_QUEUE_WAIT_S = 600.0          # generation --max-queue-wait-s
GEN_HEARTBEAT_S = 15.0                # generation --stream-heartbeat-s
UND_MAX_QUEUE_WAIT_S = 120.0          # understanding --max-queue-wait-s
UND_PREFIX_PAGES_WAIT_S = 10.0        # understanding --prefix-pages-wait-s


def problems(*, gateway_idle_s: float, gateway_request_s: float, gen_queue_wait_s: float, gen_heartbeat_s: float,
             und_queue_wait_s: float, und_pages_wait_s: float = UND_PREFIX_PAGES_WAIT_S) -> list[str]:
    """What is out of order, in words naming the flags; [] when the limits agree."""
    out = []
    idle = f"the gateway's --upstream-idle-timeout-s {gateway_idle_s:g}"
    if gen_heartbeat_s > 0 and gen_heartbeat_s >= gateway_idle_s:
        out.append(f"generation's --stream-heartbeat-s {gen_heartbeat_s:g} must be below {idle} (a queued job "
                   "would get a 504 instead of its 429)")
    if gen_heartbeat_s <= 0 and gen_queue_wait_s >= gateway_idle_s:
        out.append(f"without heartbeats (--stream-heartbeat-s 0), generation's --max-queue-wait-s "
                   f"{gen_queue_wait_s:g} must be below {idle}")
    if gen_queue_wait_s >= gateway_request_s:
        out.append(f"generation's --max-queue-wait-s {gen_queue_wait_s:g} must be below the gateway's "
                   f"--request-timeout-s {gateway_request_s:g} (the deadline's 504 would come before the 429)")
    if not 0 < und_queue_wait_s < gateway_idle_s:
        out.append(f"understanding's --max-queue-wait-s {und_queue_wait_s:g} must be above 0 and below {idle} "
                   "(a request waiting for admission sends nothing)")
    if und_pages_wait_s >= gateway_idle_s:
        out.append(f"understanding's --prefix-pages-wait-s {und_pages_wait_s:g} must be below {idle} (an image "
                   "request waiting for KV pool pages sends nothing)")
    return out


def _flags(text: str, **defaults: float) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for dest, default in defaults.items():
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, type=float, default=default)
    return p.parse_known_args(shlex.split(text or ""))[0]


def _gateway_env(flag: str, env, default: float) -> float:
    return GATEWAY_FLAGS.knob(flag, float, default).get(env)


def stack_problems(und_args: str, gen_args: str, gateway_args: str, env=None) -> list[str]:
    """`problems` of a `u1serve up` stack: the defaults, overridden by the extra flags of each service (and the
    gateway's U1SERVE_* environment fallbacks)."""
    gw = _flags(gateway_args,
                upstream_idle_timeout_s=_gateway_env("--upstream-idle-timeout-s", env, GATEWAY_IDLE_TIMEOUT_S),
                request_timeout_s=_gateway_env("--request-timeout-s", env, GATEWAY_REQUEST_TIMEOUT_S))
    gen = _flags(gen_args, max_queue_wait_s=GEN_MAX_QUEUE_WAIT_S, stream_heartbeat_s=GEN_HEARTBEAT_S)
    und = _flags(und_args, max_queue_wait_s=UND_MAX_QUEUE_WAIT_S, prefix_pages_wait_s=UND_PREFIX_PAGES_WAIT_S)
    return problems(gateway_idle_s=gw.upstream_idle_timeout_s, gateway_request_s=gw.request_timeout_s,
                    gen_queue_wait_s=gen.max_queue_wait_s, gen_heartbeat_s=gen.stream_heartbeat_s,
                    und_queue_wait_s=und.max_queue_wait_s, und_pages_wait_s=und.prefix_pages_wait_s)
