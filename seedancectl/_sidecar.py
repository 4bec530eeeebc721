"""The sidecar process: receiver, store, NVML sampler and scrapers behind one loopback server.

It composes the collectors; it decides nothing itself. Every source hands decoded metrics to
one sink that writes the store and refreshes the Prometheus view, so a point is stored and
exported the same way whether it came from a job over OTLP, from NVML or from a scrape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from collectors._otel import Telemetry, TelemetryConfig, setup_telemetry
from collectors._otlp_decode import DecodedMetrics
from collectors._otlp_receiver import Forwarder, ForwarderConfig, ReceiverStats, otlp_router
from collectors._prometheus import LatestValueCollector, MetricsServer, serve_metrics
from collectors._store import TimeSeriesStore
from seedancectl._config import SidecarConfig
from seedancectl._sources import build_gpu_sampler, build_scrapers
from tuner._lease import JobRegistry, lease_router

log = logging.getLogger(__name__)


class Sidecar:
    """Owns the sidecar's parts and their lifecycle; start() and shutdown() are idempotent."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.latest = LatestValueCollector()
        self.registry.register(self.latest)
        self.store: TimeSeriesStore | None = None
        self.stats = ReceiverStats()
        self.jobs = JobRegistry()
        self._forwarder = (
            Forwarder(ForwarderConfig(url=config.upstream_otlp_endpoint))
            if config.upstream_otlp_endpoint else None
        )
        self._telemetry: Telemetry | None = None
        # Built here, not in start(), so a bad trace or scrape URL fails before serving.
        self._gpu_sampler = build_gpu_sampler(config)
        self._scrapers = build_scrapers(config, sink=self.sink)
        self._metrics_server: MetricsServer | None = None
        self._lock = threading.Lock()
        self._started = False

    def sink(self, decoded: DecodedMetrics) -> None:
        """Where every source's metrics go: the store and the Prometheus view."""
        assert self.store is not None, "sink called before start()"
        self.store.write(decoded.points)
        self.latest.update(decoded)

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self.config.store.parent.mkdir(parents=True, exist_ok=True)
            self.store = TimeSeriesStore(self.config.store)
            self._telemetry = setup_telemetry(
                TelemetryConfig(job=f"{self.config.job}-sidecar",
                                export_interval_s=self.config.export_interval_s),
                store_sink=self.sink,
            )
            self._gpu_sampler.register(self._telemetry.meter("seedance.nvml"))
            self._gpu_sampler.start()
            self._scrapers = build_scrapers(self.config, sink=self.sink)
            for scraper in self._scrapers:
                scraper.start()
            if self._forwarder is not None:
                self._forwarder.start()
            if self.config.prometheus_port is not None:
                self._metrics_server = serve_metrics(self.registry, self.config.prometheus_port)
            self.jobs.start()
            self._started = True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
            self.jobs.shutdown(timeout_s)
            for scraper in self._scrapers:
                scraper.shutdown(timeout_s)
            self._gpu_sampler.shutdown(timeout_s)
            if self._telemetry is not None:
                self._telemetry.shutdown(timeout_s)
            if self._forwarder is not None:
                self._forwarder.shutdown(timeout_s)
            if self._metrics_server is not None:
                self._metrics_server.stop()
            if self.store is not None:
                self.store.close()

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self.start()
            try:
                yield
            finally:
                self.shutdown()

        app = FastAPI(title="seedance sidecar", lifespan=lifespan)
        app.include_router(
            otlp_router(self.sink, max_body_bytes=self.config.max_body_bytes,
                        forwarder=self._forwarder, stats=self.stats)
        )
        app.include_router(lease_router(self.jobs))

        @app.get("/healthz")
        def healthz() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/readyz")
        def readyz(response: Response) -> dict[str, object]:
            ready = self._started and self.store is not None
            response.status_code = 200 if ready else 503
            return {"ready": ready, "job": self.config.job}

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return app


def run_sidecar(config: SidecarConfig) -> None:
    """Serve until interrupted; the lifespan starts and stops the parts."""
    sidecar = Sidecar(config)
    server = uvicorn.Server(
        uvicorn.Config(sidecar.app(), host=config.host, port=config.port, log_level="warning")
    )
    server.run()
