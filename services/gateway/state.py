"""The gateway's app state: one typed object the routers work over, made at start (config, the HTTP client to
the engines, the replica pools and their monitor, the image-job orchestrator, the input-image checker, admission,
the strike ledger, metrics; the RL/LoRA wing: the fan-out to every replica, the LoRA adapters, the weights
updater and its lock, where the RL trajectories are)."""
from __future__ import annotations

from dataclasses import dataclass

import httpx

from services.kit.admission import AdmissionGate

from .adapters import Adapters
from .config import GatewayConfig
from .drain import Drain
from .fanout import Fanout
from .inputs import ImageChecker
from .metrics import GatewayMetrics
from .orchestrator import Orchestrator
from .probation import ClientLedger
from .routing import EndpointPool, ReplicaMonitor
from .trajectories import Trajectories
from .upstream import CONTROL_TIMEOUT_S, Deadline, Janitor, engine_headers
from .weights import WeightsUpdater


@dataclass
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    http: httpx.AsyncClient
    und: EndpointPool
    gen: EndpointPool
    orchestrator: Orchestrator
    images: ImageChecker
    admission: AdmissionGate
    janitor: Janitor               # abort / cancel / release calls after early ends
    monitor: ReplicaMonitor        # replica discovery, health, load
    drain: Drain                   # on SIGTERM: when requests in flight must end
    ledger: ClientLedger           # strikes of clients that held responses unread (probation.py)
    fanout: Fanout                 # control calls to every engine replica (weights, LoRA)
    adapters: Adapters             # the LoRA adapters every engine holds (adapters.py)
    weights: WeightsUpdater        # live weight updates, one at a time (its lock; weights.py)
    trajectories: Trajectories     # which generation replica holds which RL trajectory (trajectories.py)
    rl_fetches: AdmissionGate      # trajectory downloads relayed at once (routers/rl.py)
    weight_uploads: AdmissionGate  # one weight upload at a time (routers/rl_weights.py)

    @classmethod
    def create(cls, cfg: GatewayConfig) -> "GatewayState":
        metrics = GatewayMetrics()
        # reads are bounded per wait by Deadline (idle limit, request deadline), not by httpx
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
                                 timeout=httpx.Timeout(None, connect=cfg.connect_timeout_s,
                                                       pool=cfg.connect_timeout_s))
        und = EndpointPool("understanding", cfg.und_urls, cfg.retry_down_after_s, cfg.eject_max_s)
        gen = EndpointPool("generation", cfg.gen_urls, cfg.retry_down_after_s, cfg.eject_max_s)
        janitor = Janitor()
        ledger = ClientLedger(cfg.strike_decay_s)
        metrics.on_probation.set_function(ledger.on_probation)
        monitor = ReplicaMonitor(http, [und, gen], engine_headers(cfg.internal_token),
                                 interval_s=cfg.health_interval_s, timeout_s=cfg.health_timeout_s,
                                 dns_refresh_s=cfg.dns_refresh_s)
        fanout = Fanout(http, [und, gen], cfg.internal_token)
        return cls(config=cfg, metrics=metrics, http=http, und=und, gen=gen,
                   orchestrator=Orchestrator(cfg, http, und, gen, metrics, janitor),
                   images=ImageChecker(cfg.images, cfg.image_workers),
                   admission=AdmissionGate(cfg.max_concurrent_requests, "requests"), janitor=janitor,
                   monitor=monitor, drain=Drain(cfg.graceful_shutdown_s), ledger=ledger, fanout=fanout,
                   adapters=Adapters.from_knobs(cfg.model_name), weights=WeightsUpdater(fanout),
                   trajectories=Trajectories(http, gen, cfg.internal_token),
                   rl_fetches=AdmissionGate(cfg.rl_max_trajectory_fetches, "trajectory fetches"),
                   weight_uploads=AdmissionGate(1, "weight uploads"))

    async def start(self) -> None:
        await self.monitor.start()

    def deadline(self) -> Deadline:
        """The time limits of one request, starting now."""
        return Deadline(self.config.upstream_idle_timeout_s, self.config.request_timeout_s)

    async def close(self) -> None:
        await self.monitor.close()
        await self.janitor.drain(3 * CONTROL_TIMEOUT_S)
        await self.http.aclose()
        self.images.close()
