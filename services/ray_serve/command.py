"""`u1serve ray up|down|config`: the application on a running Ray cluster.

    u1serve ray up [--address auto] [--gen-replicas 1:4] ... -- --model /models/U1 --mode separate --und-tp 2
    u1serve ray config ... -- --model ...     # the Serve config (YAML) of the same application: `serve deploy`, KubeRay
    u1serve ray down [--address auto]

Flags after `--` are `u1serve up`'s stack flags (model, device, parallelism, quantization, presets, extra engine
flags). Every node needs the model at the same path and u1serve installed (`pip install 'u1serve[ray]'`).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading

from services.base import knobs

from .settings import RayAppSettings, Scaling

PASS_ENV = ("UCX_TLS", knobs.KV_SAME_HOST_SHM.name)   # forwarded to every replica when set (no secret: see settings)


def replicas(text: str) -> tuple[int, int]:
    """'N' (fixed) or 'MIN:MAX' (autoscaled)."""
    try:
        lo, _, hi = text.partition(":")
        out = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 0 <= out[0] <= out[1] or out[1] < 1:
        raise argparse.ArgumentTypeError(f"need 0 <= MIN <= MAX >= 1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ray_action", required=True)
    for name, help_ in (("up", "deploy (or update) the application on the cluster"),
                        ("config", "print the application's Serve config (YAML) without deploying")):
        q = sub.add_parser(name, help=help_)
        q.add_argument("--address", default="auto", help="Ray cluster address (ray.init)")
        q.add_argument("--name", default="u1serve", help="Serve application name")
        q.add_argument("--http-host", default="127.0.0.1",
                       help="where Serve's HTTP proxy listens (the public API; any other than loopback needs "
                            "--api-key-file PATH after --, a file every node has)")
        q.add_argument("--http-port", type=int, default=8000)
        q.add_argument("--und-replicas", type=replicas, default=(1, 1), metavar="N|MIN:MAX")
        q.add_argument("--gen-replicas", type=replicas, default=(1, 1), metavar="N|MIN:MAX")
        q.add_argument("--und-target-load", type=float, default=8.0,
                       help="requests running + queued per understanding replica the autoscaler aims at")
        q.add_argument("--gen-target-load", type=float, default=2.0,
                       help="image jobs running + queued per generation replica the autoscaler aims at")
        q.add_argument("--kv-high", type=float, default=0.8, help="KV use that asks for one more replica")
        q.add_argument("--kv-transport", choices=["nixl", "shm"], default="nixl",
                       help="nixl: any node reads any prefix (shared memory within a node); shm: one-node clusters")
        for kind in ("und", "gen"):
            q.add_argument(f"--{kind}-resources", type=json.loads, default={},
                           help=f'custom Ray resources per {kind} replica, JSON (e.g. \'{{"gpu_node": 1}}\')')
        q.add_argument("--control-resources", type=json.loads, default={},
                       help="custom Ray resources of the gateway and the registry, JSON (e.g. the head's label)")
        q.add_argument("--engine-cpus", type=float, default=1.0)
        q.add_argument("--engine-host", default=None,
                       help="address the engines bind and are reached at (default: each node's Ray address; "
                            "127.0.0.1 for a cluster whose nodes all run on one machine)")
        q.add_argument("--gateway-replicas", type=int, default=1)
        q.add_argument("--upscale-delay-s", type=float, default=3.0)
        q.add_argument("--downscale-delay-s", type=float, default=60.0)
        q.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                       help="environment of every replica (repeatable)")
        if name == "up":
            q.add_argument("--wait", action="store_true",
                           help="stay in the foreground; Ctrl-C / SIGTERM deletes the application")
        q.add_argument("stack", nargs=argparse.REMAINDER, help="-- then `u1serve up` flags (--model ... )")
    q = sub.add_parser("down", help="delete the application")
    q.add_argument("--address", default="auto")
    q.add_argument("--name", default="u1serve")


def token_file(args, stack: list[str]) -> list[str]:
    """`ray up` without --internal-token-file: the token (U1SERVE_INTERNAL_TOKEN, else a random one) written to a
    private file under U1SERVE_CACHE, its path added to the stack flags. Only the path reaches the replicas (a
    runtime_env is shown by the dashboard and Ray's logs), so every node must see that path: one machine, a shared
    cache, or pass --internal-token-file of a file every node has (a Kubernetes Secret's mount)."""
    if any(a.split("=", 1)[0] == "--internal-token-file" for a in stack):
        return stack
    from services.launch.stack import cache_dir
    folder = os.path.join(cache_dir(), "ray", args.name)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "internal_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((knobs.INTERNAL_TOKEN.get() or secrets.token_hex(16)) + "\n")
    return [*stack, "--internal-token-file", path]


def check_public_api_keyed(args, stack: list[str]) -> None:
    if args.http_host not in ("127.0.0.1", "localhost", "::1") and \
            not any(a.split("=", 1)[0] == "--api-key-file" for a in stack):
        raise SystemExit(f"u1serve ray: --http-host {args.http_host} opens the API beyond this machine: pass "
                         "--api-key-file PATH after -- (one key per line; a file every node has)")


def settings_from_args(args, new_token: bool = True) -> RayAppSettings:
    """new_token (`ray up`): the internal token as a file (token_file). A config file gets none: its nodes bring
    their own (--internal-token-file of a Secret's mount, or U1SERVE_INTERNAL_TOKEN in the nodes' environment).
    No secret goes into the settings: the API keys and the token travel as paths of files."""
    stack = list(args.stack)
    if stack[:1] == ["--"]:
        stack = stack[1:]
    check_public_api_keyed(args, stack)
    if knobs.API_KEY.raw():
        raise SystemExit(f"u1serve ray: {knobs.API_KEY.name} is set; the replicas do not take keys from the "
                         "environment (it would be in the runtime_env): pass --api-key-file PATH after --")
    env = {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}
    if new_token:
        stack = token_file(args, stack)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    try:
        return RayAppSettings(
            stack_args=stack, kv_transport=args.kv_transport, und_resources=args.und_resources,
            gen_resources=args.gen_resources, engine_host=args.engine_host,
            control_resources=args.control_resources, engine_cpus=args.engine_cpus,
            gateway_replicas=args.gateway_replicas, upscale_delay_s=args.upscale_delay_s,
            downscale_delay_s=args.downscale_delay_s, env=env,
            und=Scaling(*args.und_replicas, target_load=args.und_target_load, kv_high=args.kv_high),
            gen=Scaling(*args.gen_replicas, target_load=args.gen_target_load, kv_high=args.kv_high))
    except ValueError as e:
        raise SystemExit(f"u1serve ray: {e}") from None


def serve_config(args, settings: RayAppSettings) -> dict:
    """A Serve config file (what `serve deploy` and KubeRay's serveConfigV2 take) for this application."""
    return {"proxy_location": "HeadOnly", "http_options": {"host": args.http_host, "port": args.http_port},
            "applications": [{"name": args.name, "route_prefix": "/",
                              "import_path": "services.ray_serve.app:app_builder", "args": settings.to_dict()}]}


def _connect(address: str) -> None:
    import ray
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)


def deploy(args, settings: RayAppSettings, out=sys.stdout) -> str:
    from ray import serve

    from .app import build_app
    serve.start(http_options={"host": args.http_host, "port": args.http_port}, proxy_location="HeadOnly")
    try:
        serve.run(build_app(settings), name=args.name, route_prefix="/")
    except RuntimeError as e:          # say which deployment failed and why (Serve keeps it in the status)
        app = serve.status().applications.get(args.name)
        why = [f"  {name}: {d.status} {d.message}" for name, d in (app.deployments.items() if app else [])]
        raise SystemExit(f"u1serve ray: {e}\n" + "\n".join(why)) from None
    host = "127.0.0.1" if args.http_host == "0.0.0.0" else args.http_host
    url = f"http://{host}:{args.http_port}/v1"
    out.write(f"[u1serve] ready: {url} (Ray Serve application {args.name!r})\n")
    out.flush()
    return url


def run(args) -> int:
    if args.ray_action == "config":
        import yaml
        settings = settings_from_args(args, new_token=False)
        sys.stdout.write(yaml.safe_dump(serve_config(args, settings), sort_keys=False))
        return 0
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError:
        raise SystemExit("u1serve ray needs Ray Serve: pip install 'u1serve[ray]'") from None
    _connect(args.address)
    if args.ray_action == "down":
        serve.delete(args.name)
        print(f"[u1serve] deleted Serve application {args.name!r}")
        return 0
    settings = settings_from_args(args)
    deploy(args, settings)
    if args.wait:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(args.name)
        print(f"[u1serve] deleted Serve application {args.name!r}")
    return 0
