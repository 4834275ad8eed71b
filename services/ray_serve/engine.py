"""One engine replica (understanding or generation) as a Serve deployment: the real engine server as a child
process on the replica's node, bound to the node's address, on the replica's GPUs (Ray's CUDA_VISIBLE_DEVICES).

The command line is the one `u1serve up` builds for that service (services/launch/stack.py, a dry run of the stack with
the same flags); only the address, the port, the KV pool name and the KV transport are the replica's own.
Serve's health check asks the process (any answer of /health counts, a 503 while the engine loads or restarts
itself too); a dead or silent process fails it and Serve replaces the replica. The engine's load (/health) is this replica's autoscaling
metric. The URL is renewed in the registry every heartbeat; on shutdown the replica leaves the registry first,
then stops its engine (SIGTERM: requests in flight finish within the engine's own grace)."""
from __future__ import annotations

import asyncio
import io
import logging
import os
import sys
import time
import uuid

from services.base import knobs
from services.launch.launcher import ServiceLog, ServiceProcess, ServiceSpec, health
from services.base.netutil import free_port
from shm_transfer.segment import reclaim_orphans, unlink_if_owned

from .autoscale import load_signals
from .settings import RayAppSettings, parse_stack_args

log = logging.getLogger("u1serve.ray")
POOL_PREFIX = "u1kv-ray-"     # understanding replicas' KV pools: one per replica, named by a fresh id
NAMES = {"und": "understanding", "gen": "generation"}
GRACE_S = 20.0


def stack_spec(settings: RayAppSettings, name: str) -> ServiceSpec:
    """The ServiceSpec `u1serve up` would start for service `name` (und, gen, gateway) with these flags."""
    from services.launch.stack import build_stack
    args = parse_stack_args(settings.stack_args)
    if args.internal_token_file and not os.path.isfile(args.internal_token_file):
        raise RuntimeError(f"--internal-token-file {args.internal_token_file} is not a file on this node: every "
                           "node needs it at that path (a shared cache, or a Secret mounted on every pod)")
    if not (args.internal_token_file or knobs.INTERNAL_TOKEN.get()):
        raise RuntimeError("no internal token on this node: every replica of the application needs the same one "
                           "(u1serve ray up writes a file; with `serve run` or KubeRay pass --internal-token-file "
                           "PATH in stack_args, a file every node has, or set U1SERVE_INTERNAL_TOKEN on the nodes)")
    stack = build_stack(args, out=io.StringIO(), echo_logs=False, dry_run=True,
                        qos_defaults=False)      # Ray places the engines: no automatic MPS or yield page
    return next(s.spec for s in stack.services if s.spec.name == name)


def engine_spec(kind: str, settings: RayAppSettings, host: str, port: int, pool: str) -> ServiceSpec:
    from services.launch.stack_replicas import _with
    spec = stack_spec(settings, kind)
    argv = _with(_with(_with(spec.argv, "--host", host), "--port", str(port)), "--kv-pool-name", pool)
    if kind == "und":
        argv += ["--kv-transport", settings.kv_transport, "--kv-advertise-host", host]
    else:   # its understanding neighbours on the node name their own pools
        argv += ["--kv-pool-follow-handles", "on"]
    env = {k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"}   # Ray's assignment stays
    return ServiceSpec(NAMES[kind], argv, f"http://{host}:{port}/health", env)


def node_address(node_id: str) -> str:
    """The address this node was started with (`ray start --node-ip-address`): the one other nodes reach it by."""
    import ray
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


class EngineReplica:
    async def __init__(self, kind: str, settings: dict, registry):
        import ray
        self.kind = kind
        self.settings = RayAppSettings.from_dict(settings)
        self.registry = registry
        self.node_id = ray.get_runtime_context().get_node_id()
        host = self.settings.engine_host or node_address(self.node_id)
        port = free_port()
        self.url = f"http://{host}:{port}"
        # understanding creates it, so it is unique per replica; generation attaches pools named by handles
        self.pool = f"{POOL_PREFIX}{uuid.uuid4().hex[:12]}"
        if kind == "und":      # pools of replicas that died with their node (SIGKILL: nobody unlinked them)
            gone = await asyncio.to_thread(reclaim_orphans, POOL_PREFIX)
            if gone:
                log.info("removed %d KV pool(s) of dead understanding replicas: %s", len(gone), ", ".join(gone))
        self.spec = engine_spec(kind, self.settings, host, port, self.pool)
        self.log = ServiceLog(self.spec.name, sys.stderr, None)
        self.proc = ServiceProcess(self.spec, self.log, GRACE_S)
        self._closing = False
        try:
            await self._until_healthy(self.settings.engine_start_timeout_s)
        except BaseException:
            await asyncio.to_thread(self._stop_engine)
            raise
        await self._register()
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        log.info("%s replica on node %s: engine pid %d at %s", NAMES[kind], self.node_id[:8], self.proc.pid,
                 self.url)

    def _stop_engine(self) -> None:
        """Stop the engine, then remove its KV pool if it could not (killed at the end of the grace): only a
        segment whose owner record names this replica's stack id and whose creator is gone."""
        self.proc.stop()
        if self.kind == "und":
            unlink_if_owned(self.pool, self.spec.env.get(knobs.STACK_ID.name, ""))

    async def _until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"{self.spec.name} engine exited at start ({self.proc.exit_reason()}); last "
                                   "lines:\n" + "\n".join(self.log.last_lines()))
            status, _ = await asyncio.to_thread(health, self.spec.health_url)
            if status == 200:
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} engine not healthy within {timeout_s} s")

    async def _register(self) -> None:
        await self.registry.register.remote(self.kind, self.url, self.node_id, 5 * self.settings.heartbeat_s)

    async def _heartbeat(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.heartbeat_s)
            if self.proc.alive():
                try:
                    await self._register()
                except Exception as e:      # the registry is being replaced: the next beat registers again
                    log.warning("registry heartbeat failed: %s", e)

    # ------------------------------------------------------------------ Serve hooks
    async def check_health(self) -> None:
        if not self.proc.alive():
            raise RuntimeError(f"{self.spec.name} engine process died ({self.proc.exit_reason()})")
        status, _ = await asyncio.to_thread(health, self.spec.health_url)
        if status is None:        # any answer will do (503 while it loads or restarts its engine): it is alive
            raise RuntimeError(f"{self.spec.name} engine does not answer HTTP")

    async def record_autoscaling_stats(self) -> dict:
        """The engine's own load signals (autoscale.py)."""
        _, body = await asyncio.to_thread(health, self.spec.health_url)
        return load_signals(body)

    def where(self) -> dict:
        """For tests and operators: the engine's URL, node and pid."""
        return {"url": self.url, "node_id": self.node_id, "pid": self.proc.pid}

    async def __del__(self):
        self._closing = True
        try:   # bounded: when the whole application is deleted the registry may be gone first, and an unbounded
            # call would wait until Serve kills this replica, its engine and pool never stopped and removed
            await asyncio.wait_for(self.registry.unregister.remote(self.url), timeout=2.0)
            await asyncio.sleep(self.settings.heartbeat_s + 0.5)     # the gateways stop routing here first
        except Exception:
            pass
        await asyncio.to_thread(self._stop_engine)
