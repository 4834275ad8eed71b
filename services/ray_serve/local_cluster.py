"""A real multi-node Ray cluster on one machine, for tests, the smoke script and the CPU bench modes.

Each node is its own `ray start --block` (a raylet with its own resources and workers; the head also runs the
GCS). A worker node runs in a private mount namespace with its own tmpfs on /dev/shm, so it is a different
shared-memory domain, as another host would be: KV handoff inside a node goes through shared memory, between
nodes through the network transport (NIXL), exactly as on separate machines. Killing a node = SIGKILL to every
process in its mount namespace (its raylet, its workers, the engine processes they started): a lost machine.

Kept small for shared CPU machines: no dashboard, the minimum object store, a few CPUs per node, nice 10.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from services.base.netutil import free_port

OBJECT_STORE_BYTES = 80 * 1024 * 1024      # Ray's minimum is 75 MiB
NODE_SHM = "1g"                            # a worker node's /dev/shm (tmpfs: only what is written uses memory)


@dataclass
class NodeSpec:
    name: str
    num_cpus: float = 1
    resources: dict = field(default_factory=dict)
    private_shm: bool = True               # its own /dev/shm (its own shared-memory domain)


@dataclass
class Node:
    spec: NodeSpec
    proc: subprocess.Popen
    log_path: str

    def mount_ns(self) -> Optional[str]:
        try:
            return os.readlink(f"/proc/{self.proc.pid}/ns/mnt")
        except OSError:
            return None


def _ns_processes(ns: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == ns:
                    out.append(int(entry))
            except OSError:
                pass
    return out


class LocalCluster:
    """A head node plus worker nodes (`NodeSpec`s), started with `ray start`; `address` for `ray.init` from a process
    with `env` (it holds the cluster's auth token)."""

    def __init__(self, workdir: str, env: Optional[dict] = None, head_cpus: float = 1,
                 head_resources: Optional[dict] = None, keep_logs: bool = False):
        self.workdir = workdir
        self.keep_logs = keep_logs          # leave Ray's session logs (temp_dir) behind at stop
        os.makedirs(workdir, exist_ok=True)
        # Ray's socket paths must stay short (AF_UNIX: 107 bytes)
        self.temp_dir = f"/tmp/u1ray-{os.getpid()}-{free_port()}"
        # its own token (Ray's token auth): clusters of other users of this machine keep theirs in ~/.ray/auth_token
        self.env = {**os.environ, **(env or {}), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": uuid.uuid4().hex,
                    # a loaded machine starts a raylet slowly; Ray's default wait (10 s) fails the node
                    "RAY_raylet_start_wait_time_s": "120", "RAY_agent_register_timeout_ms": "120000"}
        self.nodes: dict[str, Node] = {}
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self._head_spec = NodeSpec("head", head_cpus, head_resources or {}, private_shm=False)

    # ------------------------------------------------------------------ nodes
    def _argv(self, spec: NodeSpec, head: bool) -> list[str]:
        ray = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--block",
               "--node-ip-address", "127.0.0.1", "--num-cpus", str(spec.num_cpus),
               "--resources", json.dumps(spec.resources), "--object-store-memory", str(OBJECT_STORE_BYTES),
               "--disable-usage-stats", "--dashboard-agent-listen-port", str(free_port()),
               "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
               "--metrics-export-port", str(free_port())]
        if head:
            ray += ["--head", "--port", str(self.gcs_port), "--include-dashboard=false",
                    "--ray-client-server-port", str(free_port()), "--temp-dir", self.temp_dir]
        else:
            ray += ["--address", self.address]
        argv = ["nice", "-n", "10"] + ray
        if spec.private_shm:
            script = f'mount -t tmpfs -o size={NODE_SHM} u1ray-{spec.name} /dev/shm && exec "$@"'
            argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"] + argv
        return argv

    def _start(self, spec: NodeSpec, head: bool) -> Node:
        log_path = os.path.join(self.workdir, f"node-{spec.name}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self._argv(spec, head), env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(spec, proc, log_path)
        self.nodes[spec.name] = node
        return node

    def start(self, workers: list[NodeSpec], timeout_s: float = 300.0) -> "LocalCluster":
        self._start_node(self._head_spec, True, timeout_s)
        for spec in workers:       # one at a time: the GCS of a busy machine is slow to register nodes
            self.add_node(spec, timeout_s)
        return self

    def add_node(self, spec: NodeSpec, timeout_s: float = 300.0) -> Node:
        return self._start_node(spec, False, timeout_s)

    def _start_node(self, spec: NodeSpec, head: bool, timeout_s: float, attempts: int = 3) -> Node:
        """A node, started again when it dies at start: on a loaded machine a raylet gives up when its dashboard
        agent takes longer than Ray's fixed wait (15 s) to come up."""
        for attempt in range(attempts):
            try:
                return self.wait_started(self._start(spec, head), timeout_s)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self._reap(self.nodes[spec.name])
        raise AssertionError("unreachable")

    def _reap(self, node: Node, wait_s: float = 30.0) -> int:
        """SIGKILL to every process of the node (its mount namespace, and its process group); how many."""
        ns = node.mount_ns()
        pids = _ns_processes(ns) if ns and node.spec.private_shm else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            node.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        return len(pids) or 1

    def wait_started(self, node: Node, timeout_s: float) -> Node:
        """Until `ray start` says the node runs (it registered with the GCS), reading its log: asking the GCS
        from a new driver each time costs seconds of CPU on a loaded machine."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray node {node.spec.name} exited at start: see {node.log_path}")
            with open(node.log_path, errors="replace") as f:
                if "Ray runtime started" in f.read():
                    return node
            time.sleep(0.5)
        raise TimeoutError(f"ray node {node.spec.name} not up within {timeout_s} s: see {node.log_path}")

    def kill_node(self, name: str) -> int:
        """A lost machine: SIGKILL to every process of the node (its mount namespace). Returns how many."""
        return self._reap(self.nodes[name])

    # ------------------------------------------------------------------ stop
    def stop(self, grace_s: float = 10.0) -> None:
        """Workers first, then the head: SIGTERM to each `ray start --block` (it stops its node), then SIGKILL to
        whatever is left of the node (its namespace or process group)."""
        order = [n for k, n in self.nodes.items() if k != "head"] + [self.nodes[k] for k in ("head",) if k in
                                                                        self.nodes]
        for node in order:
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for node in order:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node in order:
            self._reap(node, 10.0)
        self._kill_leftovers()
        if not self.keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Processes of this cluster that left their node's process group (Ray daemonizes some): found by the
        cluster's own temp dir or GCS address on their command line."""
        marks = (self.temp_dir.encode(), f"127.0.0.1:{self.gcs_port}".encode())
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if any(m in cmd for m in marks):
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
