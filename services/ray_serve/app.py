"""The Serve application: `build_app(settings)`, and `app_builder(args)` for `serve run` / a Serve config file
(`import_path: services.ray_serve.app:app_builder`, `args:` = RayAppSettings as a dict).

Placement: an engine replica holds its whole GPU group (understanding: --und-tp GPUs; generation: --gen-cfg-parallel
x --gen-sp), so a TP / CFG / SP group is always on one node; `und_resources` / `gen_resources` add custom resources
(e.g. a node label) and `control_resources` places the gateway and the registry (e.g. on the head, which a lost worker node
does not take down)."""
from __future__ import annotations

from .autoscale import autoscaling_config
from .engine import NAMES, EngineReplica
from .registry import Registry
from .settings import RayAppSettings

APP_NAME = "u1serve"
QUIET = {"enable_access_log": False}     # no log line per registry call / health probe


def replica_options(settings: RayAppSettings, kind: str) -> dict:
    scaling = getattr(settings, kind)
    gpus = settings.gpus(kind)
    actor = {"num_cpus": settings.engine_cpus, "num_gpus": gpus, "resources": dict(getattr(settings, f"{kind}_resources")),
             "runtime_env": runtime_env(settings)}
    opts = {"name": NAMES[kind], "ray_actor_options": actor, "health_check_period_s": 2.0,
            "health_check_timeout_s": 10.0, "graceful_shutdown_timeout_s": 30.0, "max_ongoing_requests": 16,
            "logging_config": QUIET}
    if scaling.min_replicas == scaling.max_replicas:
        opts["num_replicas"] = scaling.max_replicas
    else:
        opts["autoscaling_config"] = autoscaling_config(scaling, settings)
    return opts


def runtime_env(settings: RayAppSettings) -> dict:
    return {"env_vars": dict(settings.env)} if settings.env else {}


def build_app(settings: RayAppSettings):
    from ray import serve

    from .ingress import Gateway
    control = {"num_cpus": 0, "resources": dict(settings.control_resources), "runtime_env": runtime_env(settings)}
    registry = serve.deployment(Registry, name="registry", num_replicas=1, ray_actor_options=control,
                                max_ongoing_requests=1000, logging_config=QUIET).bind()
    engines = [serve.deployment(EngineReplica, **replica_options(settings, kind)).bind(kind, settings.to_dict(),
                                                                                        registry)
               for kind in ("und", "gen")]
    gateway = serve.deployment(Gateway, name="gateway", num_replicas=settings.gateway_replicas,
                               ray_actor_options=control, max_ongoing_requests=1000,
                               graceful_shutdown_timeout_s=10.0, logging_config=QUIET)
    return gateway.bind(settings.to_dict(), registry, *engines)


def app_builder(args: dict):
    """`serve run services.ray_serve.app:app_builder stack_args='[...]'` or a config file's `args`."""
    import json
    args = dict(args)
    for key, value in args.items():              # `serve run ... key=value` passes every value as a string
        if isinstance(value, str):
            try:
                args[key] = json.loads(value)
            except ValueError:
                pass                             # a plain string (kv_transport=nixl)
    return build_app(RayAppSettings.from_dict(args))
