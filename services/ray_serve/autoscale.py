"""Autoscaling engine deployments on the engines' own load signals, through Serve's custom autoscaling policy.

Each engine replica reports (`EngineReplica.record_autoscaling_stats`) from its /health:
- `load`: requests running + queued (understanding: running + waiting; generation: queued + running), the
  number the gateway routes by;
- `kv_use`: the fraction of its KV in use (understanding: the larger of the paged KV cache and the prefix pool
  pages; generation: 0).
The policy asks for enough replicas that each carries `target_load`, and for one more while any replica's KV is
above `kv_high` (a full pool turns image prefixes away with 429). Serve applies min / max replicas and the up /
down delays around it."""
from __future__ import annotations

import math
from typing import Any


def load_signals(health_body: Any) -> dict:
    from services.gateway.routing import _load      # one definition of an engine's load
    body = health_body if isinstance(health_body, dict) else {}
    use = 0.0
    for used, total in (("kv_in_use", "kv_total"), ("shm_pages_used", "shm_pages_total")):
        u, t = body.get(used), body.get(total)
        if isinstance(u, (int, float)) and isinstance(t, (int, float)) and t > 0:
            use = max(use, u / t)
    return {"load": float(_load(body)), "kv_use": float(use)}


class EngineLoadPolicy:
    """Serve policy class (`policy_function: services.ray_serve.autoscale:EngineLoadPolicy`)."""

    def __init__(self, target_load: float = 4.0, kv_high: float = 0.8):
        self.target_load, self.kv_high = float(target_load), float(kv_high)

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        load = sum(metrics.get("load", {}).values())
        kv = max(metrics.get("kv_use", {}).values(), default=0.0)
        want = self.desired(load, kv, ctx.current_num_replicas)
        return min(max(want, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas), {}

    def desired(self, load: float, kv_use: float, current: int) -> int:
        want = math.ceil(load / self.target_load) if load > 0 else 0
        if kv_use >= self.kv_high:
            want = max(want, current + 1)
        return max(want, 1 if current > 0 else 0)


def autoscaling_config(scaling, settings) -> dict:
    """Serve's autoscaling_config of one engine deployment."""
    return {"min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
            "initial_replicas": scaling.initial_replicas, "metrics_interval_s": settings.metrics_interval_s,
            "look_back_period_s": 2 * settings.metrics_interval_s, "upscale_delay_s": settings.upscale_delay_s,
            "downscale_delay_s": settings.downscale_delay_s,
            "policy": {"policy_function": f"{__name__}:EngineLoadPolicy",
                       "policy_kwargs": {"target_load": scaling.target_load, "kv_high": scaling.kv_high}}}
