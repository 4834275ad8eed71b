"""What the Ray application is made of: the `u1serve up` flags of the stack (model, device, parallelism,
quantization, presets, extra engine flags: the same services, configured the same way), and per engine the
replica bounds and the load each replica should carry. JSON-able both ways (a `serve run` config's `args`)."""
from __future__ import annotations

import argparse
import dataclasses
import io
from dataclasses import dataclass, field

KV_TRANSPORTS = ("nixl", "shm")


@dataclass
class Scaling:
    """Replica bounds and targets of one engine deployment (autoscale.py reads target_load / kv_high)."""
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_load: float = 4.0           # requests (running + queued) per replica the autoscaler aims at
    kv_high: float = 0.8               # KV pool use above which one more replica is asked for

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas >= 1, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        if self.target_load <= 0 or not 0 < self.kv_high <= 1:
            raise ValueError("target_load must be > 0 and kv_high in (0, 1]")


@dataclass
class RayAppSettings:
    stack_args: list[str]                                  # `u1serve up` flags: --model ... --device ...
    und: Scaling = field(default_factory=Scaling)
    gen: Scaling = field(default_factory=Scaling)
    kv_transport: str = "nixl"                             # understanding's handles (nixl: any node can read)
    und_resources: dict = field(default_factory=dict)      # custom Ray resources one understanding replica needs
    gen_resources: dict = field(default_factory=dict)      # ... one generation replica
    control_resources: dict = field(default_factory=dict)  # ... the gateway and the registry (e.g. the head)
    gateway_replicas: int = 1
    upscale_delay_s: float = 3.0
    downscale_delay_s: float = 60.0
    metrics_interval_s: float = 1.0
    engine_start_timeout_s: float = 900.0                  # loading 8B weights takes a while
    heartbeat_s: float = 1.0                               # registry heartbeat; entries live 5x this long
    engine_cpus: float = 1.0                               # Ray CPUs an engine replica reserves
    env: dict = field(default_factory=dict)                # environment of every replica (runtime_env)
    engine_host: str | None = None                         # engines bind here (None: the node's Ray address)

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        for name in ("und", "gen"):
            v = getattr(self, name)
            if isinstance(v, dict):
                setattr(self, name, Scaling(**v))
        self.stack_args = [str(a) for a in self.stack_args]
        parse_stack_args(self.stack_args)                  # fail here, not on a node
        check_no_secrets(self.stack_args, self.env)
        self.gpus("und")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RayAppSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def gpus(self, kind: str) -> float:
        """Ray GPUs of one replica: its whole TP (understanding) or CFG x SP (generation) group, so the group is
        on one node; colocate on one GPU: half of it each (Ray gives both the same device)."""
        args = parse_stack_args(self.stack_args)
        if args.device == "cpu" or (args.device == "auto" and not _has_cuda()):
            return 0
        und, gen = args.und_tp, args.gen_cfg_parallel * args.gen_sp
        if args.mode == "colocate":
            if und == gen == 1:
                return 0.5
            raise ValueError("--mode colocate on Ray shares one GPU between a pair of replicas (TP 1, CFG 1); "
                             "multi-GPU groups run as --mode separate (each replica owns its GPUs)")
        return und if kind == "und" else gen


# A Serve config and a runtime_env are shown by `serve config`, the dashboard and Ray's logs: they carry paths
# to secret files (a Kubernetes Secret's mount, a file on every node), never a secret itself
SECRET_FLAGS = ("--api-key", "--internal-token", "--admin-api-key")
SECRET_ENV = ("U1SERVE_API_KEY", "U1SERVE_INTERNAL_TOKEN", "RAY_AUTH_TOKEN")


def check_no_secrets(stack_args: list[str], env: dict) -> None:
    for arg in stack_args:
        if arg.split("=", 1)[0] in SECRET_FLAGS:
            raise ValueError(f"{arg.split('=', 1)[0]} would put a secret in the Serve config: pass "
                             f"{arg.split('=', 1)[0]}-file PATH (a file every node has) instead")
    for name in env:
        if name in SECRET_ENV:
            raise ValueError(f"{name} would put a secret in the replicas' runtime_env (shown by the dashboard and "
                             "Ray's logs): pass --api-key-file / --internal-token-file PATH after -- instead")


def _has_cuda() -> bool:
    from services.launch.stack import has_cuda
    return has_cuda()


def stack_parser() -> argparse.ArgumentParser:
    from services.launch.stack import add_stack_flags
    p = argparse.ArgumentParser(prog="u1serve up flags", add_help=False)
    add_stack_flags(p, model_default=None)
    return p


def parse_stack_args(argv: list[str]) -> argparse.Namespace:
    p = stack_parser()
    err = io.StringIO()
    try:
        import contextlib
        with contextlib.redirect_stderr(err):
            args = p.parse_args(argv)
    except SystemExit:
        raise ValueError(f"stack flags {argv}: {err.getvalue().strip()}") from None
    if args.und_replicas != 1 or args.gen_replicas != 1:
        raise ValueError("on Ray, replica counts are the deployments' (und / gen min_replicas, max_replicas), "
                         "not --und-replicas / --gen-replicas")
    return args
