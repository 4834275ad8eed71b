"""Prometheus metrics of the gateway (its own registry, so several apps can live in one process). It is also the
request middleware's hooks object (begin / first_byte / end)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

KNOWN_ROUTES = {"/v1/chat/completions", "/v1/images/generations", "/v1/images/edits",
                "/v1/models", "/health", "/metrics"}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("u1serve_gateway_requests_total", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("u1serve_gateway_request_seconds", "Time to the response head",
                                 ["route"], registry=r,
                                 buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.in_flight = Gauge("u1serve_gateway_requests_in_flight", "Requests being served",
                               registry=r)
        self.image_jobs_running = Gauge("u1serve_gateway_image_jobs_running",
                                        "Image jobs between prefix request and last image", registry=r)
        self.images = Counter("u1serve_gateway_images_total", "Images returned", registry=r)
        self.image_job_seconds = Histogram("u1serve_gateway_image_job_seconds",
                                           "Image job wall time (prefix + denoise)", registry=r,
                                           buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320))
        self.denoise_steps = Counter("u1serve_gateway_denoise_steps_total",
                                     "Denoise progress events relayed", registry=r)
        self.upstream_errors = Counter("u1serve_gateway_upstream_errors_total",
                                       "Errors from or reaching the engines", ["service", "code"],
                                       registry=r)
        self.cancelled = Counter("u1serve_gateway_cancelled_total",
                                 "Requests whose client went away", registry=r)
        self.timeouts = Counter("u1serve_gateway_upstream_timeouts_total",
                                "Requests ended by an upstream idle timeout or the request deadline",
                                ["code"], registry=r)
        self.slow_readers = Counter("u1serve_gateway_slow_readers_cut_total",
                                    "Responses cut because the client took no byte for --stream-write-timeout-s",
                                    registry=r)
        self.strikes = Counter("u1serve_gateway_client_strikes_total",
                               "Responses a client held unread with its window closed for --strike-hold-s",
                               registry=r)
        self.probation_refused = Counter("u1serve_gateway_probation_refused_total",
                                         "Requests refused (429 client_on_probation) while their client had strikes",
                                         registry=r)
        self.on_probation = Gauge("u1serve_gateway_clients_on_probation", "Clients with strikes now", registry=r)

    @staticmethod
    def route_label(path: str) -> str:
        return path if path in KNOWN_ROUTES else "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- kit.middleware.Hooks ----------------------------------------------------------------------
    def begin(self, path: str) -> None:
        self.in_flight.inc()

    def first_byte(self, path: str, seconds: float) -> None:
        self.latency.labels(self.route_label(path)).observe(seconds)

    def end(self, path: str, status: int) -> None:
        self.in_flight.dec()
        self.requests.labels(self.route_label(path), str(status)).inc()
