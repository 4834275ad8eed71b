"""The gateway as the application's ingress: the gateway's own FastAPI app (services.gateway.app.create_app, the
same flags `u1serve up` gives it) served by Serve's HTTP proxy. Its engine replicas come from the registry
(followed every heartbeat: replicas that start, stop or are lost join and leave the gateway's pools); routing,
health probes, retries and undo are the gateway's own."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from ray import serve

from .engine import stack_spec
from .settings import RayAppSettings, parse_stack_args

log = logging.getLogger("u1serve.ray")


def gateway_config(settings: RayAppSettings, und_urls: list[str], gen_urls: list[str]):
    """The GatewayConfig of `u1serve up` with these flags, pointed at these replicas, no DNS refresh (the registry
    is the discovery)."""
    from services.gateway.config import build_arg_parser, config_from_args
    from services.launch.stack import SECRET_ENV
    spec = stack_spec(settings, "gateway")
    # the environment `u1serve up` gives the gateway, less the secrets: the token is read from its file (or the
    # node's own environment), the API keys from --api-key-file (in the argv) -- this replica's environment is
    # its actor's, readable where a secret should not be
    os.environ.update({k: v for k, v in spec.env.items() if k not in SECRET_ENV})
    argv = spec.argv[spec.argv.index("services.gateway.server") + 1:]
    token_file = parse_stack_args(settings.stack_args).internal_token_file
    if token_file:
        argv += ["--internal-token-file", token_file]
    cfg = config_from_args(build_arg_parser().parse_args(argv))
    return dataclasses.replace(cfg, und_urls=und_urls, gen_urls=gen_urls, dns_refresh_s=0.0)


@serve.ingress()
class Gateway:
    async def __init__(self, settings: dict, registry, *engines):
        from services.gateway.app import create_app
        self.settings = RayAppSettings.from_dict(settings)
        self.registry = registry
        replicas = await self._first_replicas(self.settings.engine_start_timeout_s)
        cfg = gateway_config(self.settings, *(self._urls(replicas, k) for k in ("und", "gen")))
        self.gateway_app = create_app(cfg)
        self.gateway_state = self.gateway_app.state.gateway
        self._follow = asyncio.get_running_loop().create_task(self._follow_registry())

    @staticmethod
    def _urls(replicas: dict, kind: str) -> list[str]:
        return [r["url"] for r in replicas.get(kind, [])]

    async def _first_replicas(self, timeout_s: float) -> dict:
        """The engines as soon as at least one of each kind has registered (Serve starts all deployments at once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            replicas = await self.registry.replicas.remote()
            if replicas["und"] and replicas["gen"]:
                return replicas
            if time.monotonic() > deadline:
                raise TimeoutError(f"no understanding and generation replica registered within {timeout_s} s")
            await asyncio.sleep(0.5)

    async def _follow_registry(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                replicas = await self.registry.replicas.remote()
            except Exception as e:       # the registry is being replaced; its state comes back with the beats
                log.warning("registry read failed: %s", e)
                continue
            for pool, kind in ((self.gateway_state.und, "und"), (self.gateway_state.gen, "gen")):
                urls = self._urls(replicas, kind)
                pool.set_urls(urls)          # an empty list keeps the last known (they are probed, and ejected)

    def __serve_build_asgi_app__(self):
        return self.gateway_app
