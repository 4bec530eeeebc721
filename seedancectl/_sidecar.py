"""The sidecar process: receiver, store, NVML sampler, scrapers, policy engine, rollout
controller and tuning loop behind one loopback server.

It composes the packages; it decides nothing itself. Every source hands decoded metrics to
one sink that writes the store and refreshes the Prometheus view, so a point is stored and
exported the same way whether it came from a job over OTLP, from NVML or from a scrape. The
policy engine, the measurement and the searches read one reader: the store, or the Prometheus
that ``metrics_source`` names; the controller's guardrails read the engine's findings; the
tuning loop (one thread) ticks the controller, runs one Optuna search per job the config tunes,
and tells a person, through the webhook, about every proposal that waits for them.
"""

from __future__ import annotations

import gc
import hmac
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from opentelemetry.metrics import Histogram
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sqlalchemy.exc import OperationalError
from starlette.types import ASGIApp

import policies.detectors
from collectors import (
    CardinalityLimit,
    DecodedMetrics,
    Forwarder,
    ForwarderConfig,
    LatestValueCollector,
    MetricsServer,
    ReceiverStats,
    Scraper,
    SeedanceError,
    SeriesLimiter,
    StoreReader,
    Telemetry,
    TelemetryConfig,
    TimeSeriesStore,
    otlp_router,
    serve_metrics,
    setup_telemetry,
    yield_cpu,
)
from collectors.names import ATTR_SERVICE_NAME
from dashboards.web import web_router
from policies import Detector, EngineConfig, Finding, PolicyEngine, WindowSource
from policies.detectors import KvDecompressionConfig, KvDecompressionCostDetector
from seedancectl._api import api_router, resolve_token
from seedancectl._config import SidecarConfig
from seedancectl._direct_routes import DirectRoutes
from seedancectl._fleet_api import fleet_router
from seedancectl._health import (
    SIDECAR,
    RollbackFailedCheck,
    UnwritableCheck,
    readiness,
    register_health_metrics,
    sidecar_job,
)
from seedancectl._job_searches import JobSearches, auto_bounds, study_name
from seedancectl._logs import configure_sidecar_logging
from seedancectl._malloc import fix_mmap_threshold
from seedancectl._metrics_source import prometheus_reader
from seedancectl._request_duration import RequestDuration, request_duration_histogram
from seedancectl._sources import build_gpu_sampler, build_scrapers
from seedancectl._state_schema import migrate
from seedancectl._traces import SidecarTraces
from seedancectl._webhook import Notifier, WebhookNotifier, approval_message
from tuner import (
    STOPPED,
    Change,
    FleetMember,
    GradientCollapseFindings,
    Guardrail,
    JobRegistry,
    MeasureConfig,
    NonFiniteValues,
    RolloutConfig,
    RolloutController,
    TuningLoop,
    VersionLedger,
    lease_router,
    read_token,
)
from tuner.serving_guardrails import ServingGuardrailConfig, ServingSLOGuardrail

log = logging.getLogger(__name__)

NOTIFIED_EVENT = "notified"


def all_detectors(config: SidecarConfig | None = None) -> list[Detector]:
    """One of every detector `policies.detectors` exports, each with its default config, or
    the one ``config`` gives it (``[sidecar.kv_decompression]``)."""
    configured: dict[type, Callable[[], Detector]] = {} if config is None else {
        KvDecompressionCostDetector: lambda: KvDecompressionCostDetector(
            KvDecompressionConfig(**config.kv_decompression.model_dump()))}
    found = (getattr(policies.detectors, name) for name in policies.detectors.__all__)
    return [configured.get(cls, cls)() for cls in found
            if isinstance(cls, type) and issubclass(cls, Detector) and not inspect.isabstract(cls)]


class IngestBackpressure(SeedanceError):
    """A source sent more than its share of what the store can buffer: retry later (429)."""

    http_status = 429
    retry_after_s = 2


class Sidecar:
    """Owns the sidecar's parts and their lifecycle; start() and shutdown() are idempotent.

    After start(): ``store``, ``reader`` (what series are read from: the store or
    Prometheus), ``engine`` (PolicyEngine), ``controller`` (RolloutController), ``tuning`` (the
    loop thread) and ``notifier`` are set; the API reads them. ``token`` is the
    bearer token mutating API calls need (``token_path`` its file, if any).
    """

    def __init__(self, config: SidecarConfig, *, environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.latest = LatestValueCollector(idle_s=config.series_idle_s)
        self.registry.register(self.latest)
        self.store: TimeSeriesStore | None = None
        self.reader: StoreReader | None = None
        self.stats = ReceiverStats()
        self.limiter = SeriesLimiter(CardinalityLimit(
            max_per_metric=config.max_series_per_metric, max_per_job=config.max_series_per_job,
            idle_s=config.series_idle_s))
        self.jobs = JobRegistry(lease_ttl_s=config.lease_ttl_s)
        self.fleet = FleetMember(config.state_db, self.jobs, url=config.advertised_url,
                                 heartbeat_s=config.fleet_heartbeat_s,
                                 study_of=lambda job: study_name(config, job))
        """This sidecar in the fleet sharing its state DB: it claims each job that attaches."""
        self.engine: PolicyEngine | None = None
        self.controller: RolloutController | None = None
        self.tuning: TuningLoop | None = None
        self.searches: JobSearches | None = None
        self.notifier: Notifier = Notifier()
        self.token: str | None = None
        self.token_path: Path | None = None
        self._environ = os.environ if environ is None else environ
        self._ledger: VersionLedger | None = None
        self.state_db_error: tuple[float, str] | None = None
        """(monotonic time, message) of the last state-DB write the API saw fail."""
        self._job_tokens: dict[str, str] = {}
        self._forwarder = (
            Forwarder(ForwarderConfig(url=config.upstream_otlp_endpoint))
            if config.upstream_otlp_endpoint else None
        )
        self._telemetry: Telemetry | None = None
        self._request_duration: Histogram | None = None
        """The API's own answer times (``seedancectl._request_duration``), once telemetry runs."""
        self.traces = SidecarTraces(config)  # spans of changes and jobs; see _traces
        # Built here, not in start(), so a bad trace or scrape URL fails before serving.
        self._gpu_sampler = build_gpu_sampler(config)
        self._scrapers = build_scrapers(config, sink=self.sink)
        self._prometheus = prometheus_reader(config)  # its scrape interval fits the windows
        self._metrics_server: MetricsServer | None = None
        self._notified: set[str] = set()
        self._notify_lock = threading.Lock()
        self._lock = threading.Lock()
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    def sink(self, decoded: DecodedMetrics) -> None:
        """Where every source's metrics go: the store and the Prometheus view, series within
        the cardinality limit only."""
        assert self.store is not None, "sink called before start()"
        self._fair_share(decoded.first_attributes)
        decoded = self.limiter.admit_decoded(decoded)
        # the view first: while the store refuses writes, /metrics still shows why
        self.latest.update(decoded)
        self.store.write_decoded(decoded)

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            config = self.config
            self.token, self.token_path = resolve_token(config, self._environ)
            self._job_tokens = {name: read_token(job.token_file)
                                for name, job in config.jobs.items()
                                if job.token_file is not None}
            migrate(config.state_db)  # before any store opens its tables
            config.store.parent.mkdir(parents=True, exist_ok=True)
            self.store = TimeSeriesStore(config.store, max_bytes=(
                None if config.store_max_mib is None else int(config.store_max_mib * 2**20)))
            self.reader = self.store if self._prometheus is None else self._prometheus
            self.traces.start()
            self._telemetry = setup_telemetry(
                TelemetryConfig(job=config.telemetry_job,
                                export_interval_s=config.export_interval_s),
                store_sink=self.sink,
            )
            self._gpu_sampler.register(self._telemetry.meter("seedance.nvml"),
                                       job=self._gpu_job)
            register_health_metrics(self._telemetry.meter("seedance.sidecar"), self)
            self._request_duration = request_duration_histogram(
                self._telemetry.meter("seedance.sidecar"))
            self._gpu_sampler.start()
            self._scrapers = build_scrapers(config, sink=self.sink)
            for scraper in self._scrapers:
                scraper.start()
            if self._forwarder is not None:
                self._forwarder.start()
            if config.prometheus_port is not None:
                self._metrics_server = serve_metrics(self.registry, config.prometheus_port)
            self._ledger = VersionLedger(config.state_db)
            self.jobs.keep_versions_in(self._ledger)
            self.fleet.start()  # before the controller recovers: it recovers only its jobs
            self.jobs.start()
            self._start_tuning()
            self._started = True

    def _gpu_job(self) -> str | None:
        """The job the host's GPUs run: the one attached, while exactly one is."""
        attached = {s.job for s in self.jobs.jobs() if s.state == "attached"}
        return next(iter(attached)) if len(attached) == 1 else None

    def _judges(self, job: str) -> bool:
        """Whether this sidecar's engine judges ``job``: its own self checks, and the jobs it
        owns in the fleet (not another sidecar's self checks, which no fleet row names)."""
        if job.startswith(SIDECAR):
            return job == sidecar_job(self)
        return self.fleet.owns(job)

    def _start_tuning(self) -> None:
        """Engine -> controller (guardrails fed by the engine) -> notifier -> tuning loop; all
        read series from ``reader``, and the engine judges the jobs the store lists (those that
        report to this sidecar). The engine reads what the store has committed, not
        committing the buffer for each pass (``TimeSeriesStore.committed``)."""
        config, store, reader = self.config, self.store, self.reader
        assert store is not None and reader is not None and self._telemetry is not None
        committed = store.committed()
        windows = WindowSource(committed, reader=committed if reader is store else reader)
        self.engine = PolicyEngine(
            all_detectors(config), windows, db_url=config.state_db,
            config=EngineConfig(interval_s=config.policy_interval_s,
                                window_s=config.policy_window_s,
                                open_after=config.policy_open_after,
                                close_after=config.policy_close_after),
            meter_provider=self._telemetry.provider,
            self_checks=[UnwritableCheck(self), RollbackFailedCheck(self)], owns=self._judges)
        guardrails: list[Guardrail] = [NonFiniteValues(),
                                       GradientCollapseFindings(self.engine.active)]
        guardrails.append(ServingSLOGuardrail(ServingGuardrailConfig(
            **config.serving_slo.model_dump())))
        rollout = config.rollout
        self.controller = RolloutController(
            self.jobs, reader, db_url=config.state_db, guardrails=guardrails,
            config=RolloutConfig(
                min_pairs=rollout.min_pairs, max_pairs=rollout.max_pairs,
                trial_budget_s=rollout.trial_budget_s, min_gain=rollout.min_gain,
                max_slowdown=rollout.max_slowdown,
                early_stop_pairs=rollout.early_stop_pairs,
                ack_timeout_s=rollout.ack_timeout_s, window_timeout_s=rollout.window_timeout_s,
                restore_attempts=rollout.restore_attempts,
                proposal_ttl_s=config.approval.proposal_ttl_s,
                default_mode=config.approval.mode,
                auto_bounds=auto_bounds(config),
                measure=MeasureConfig(
                    warmup_steps=rollout.warmup_steps, min_steps=rollout.min_steps,
                    min_window_s=rollout.min_window_s, max_window_s=rollout.max_window_s,
                    tokens_per_step=rollout.tokens_per_step, confidence=rollout.confidence,
                    loss_tolerance=rollout.loss_tolerance,
                    min_token_agreement=config.serving_slo.min_token_agreement)),
            tracing=self.traces.tracing, owns=self.fleet.owns,
            meter_provider=self._telemetry.provider)
        self.controller.recover()
        for job, job_config in config.jobs.items():
            if job_config.mode is not None and self.controller.mode(job) != job_config.mode:
                self.controller.set_mode(job, job_config.mode, by="config",
                                         reason=f"approval mode {job_config.mode} from the "
                                                "sidecar's configuration")
        self.notifier = (WebhookNotifier(config.webhook_url, timeout_s=config.webhook_timeout_s,
                                         on_result=self._notified_result)
                         if config.webhook_url else Notifier())
        self.notifier.start()
        self.engine.start()
        self.searches = JobSearches(config, jobs=self.jobs, reader=reader, engine=self.engine,
                                    controller=self.controller, also=self.notify_waiting)
        self.tuning = self.searches.loop
        self.tuning.start()

    @staticmethod
    def _drain(controller: RolloutController) -> None:
        """Roll back this sidecar's changes in flight (the rollout thread has stopped), so
        a fleet finds none left in flight by a sidecar that is gone."""
        try:
            drained = controller.drain()
        except Exception:  # a state DB that is down: the next start recovers them
            log.exception("could not roll back the changes in flight at shutdown")
            return
        for change in drained:
            log.info("change %s of job %s rolled back: %s", change.id, change.job, STOPPED)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
            if self.tuning is not None:
                self.tuning.shutdown(timeout_s)
            if self.controller is not None:
                self._drain(self.controller)
            if self.searches is not None:
                self.searches.release()
            if self.searches is not None:
                self.searches.close()
            self.notifier.shutdown(timeout_s)
            if self.engine is not None:
                self.engine.shutdown(timeout_s)
            if self.controller is not None:
                self.controller.close()
            self.traces.shutdown(timeout_s)
            self.jobs.shutdown(timeout_s)
            self.fleet.shutdown(timeout_s)
            if self._ledger is not None:
                self._ledger.close()
            for scraper in self._scrapers:
                scraper.shutdown(timeout_s)
            self._gpu_sampler.shutdown(timeout_s)
            if self._telemetry is not None:
                self._request_duration = None
                self._telemetry.shutdown(timeout_s)
            if self._forwarder is not None:
                self._forwarder.shutdown(timeout_s)
            if self._metrics_server is not None:
                self._metrics_server.stop()
            if self.store is not None:
                self.store.close()
            if self._prometheus is not None:
                self._prometheus.close()

    # ---- people -------------------------------------------------------------------------------

    def notify_waiting(self) -> None:
        """Announce, once each, the proposals that wait for a person."""
        if self.controller is None or self.notifier.url is None:
            return
        for change in self.controller.changes(states=["proposed"]):
            with self._notify_lock:
                if change.id in self._notified:
                    continue
                self._notified.add(change.id)
            if any(e["kind"] == NOTIFIED_EVENT for e in self.controller.events(
                    change_id=change.id)):
                continue  # announced before a restart
            self.notifier.notify(change, approval_message(
                change, evidence=self.evidence(change),
                sidecar_url=f"http://{self.config.listen}"))

    def evidence(self, change: Change) -> list[str]:
        """In words: the trial behind a change, and the findings open on its job."""
        lines = []
        if change.source == "trial":
            lines.append(f"Optuna trial {change.meta.get('trial')} of study "
                         f"{change.meta.get('study')}")
        findings: list[Finding] = [] if self.engine is None else [
            f for f in self.engine.active() if f.job == change.job]
        lines += [f.render() for f in findings[:3]]
        return lines

    def _notified_result(self, change: Change, delivered: bool, detail: str) -> None:
        """The webhook's outcome, in the audit log (a restart does not announce it again)."""
        assert self.controller is not None
        self.controller.journal.record(
            change.job, NOTIFIED_EVENT, "webhook",
            f"{'delivered' if delivered else 'NOT delivered'}: {detail}",
            change_id=change.id, detail={"delivered": delivered})

    # ---- HTTP ---------------------------------------------------------------------------------

    def admit(self, resource: Callable[[], Mapping[str, str] | None]) -> None:
        """The fair share, judged before a body is decoded by what its first resource says:
        a job over its share is turned away without the decode its retries would cost. A
        resource that does not name its job is left to the check after the decode."""
        self._fair_share(resource, unnamed=None)

    def _fair_share(self, attributes: Callable[[], Mapping[str, str] | None], *,
                    unnamed: str | None = "") -> None:
        """One source cannot take the store's whole buffer from the others: while it is over
        half full, a job holding more than half of it is told to come back later (429) when
        another job's points wait too (the sidecar's own telemetry, a few hundred points a
        second written in-process, is no such job); the others go on. A job alone in the buffer is not
        turned away: a write at the buffer's limit waits for the store's flusher to take it
        (the store's own backpressure),
        where a 429 would idle every one of its exporters for the whole Retry-After, the store
        a fraction of that from empty (`bench/otlp_ingest.py`: 64 exporters refused at once,
        each second). ``attributes`` (the first Point's or resource's) is only read while a
        refusal can happen; without a service.name they are job ``unnamed`` (None: not
        judged)."""
        store = self.store
        assert store is not None
        half = store.config.max_buffered_points // 2
        if store.buffered < half or store.write_error is not None:
            return  # (a store that cannot commit refuses everyone itself: 503)
        first = attributes()
        job = None if first is None else first.get(ATTR_SERVICE_NAME, unnamed)
        if job is None:
            return
        by_job = store.buffered_by(ATTR_SERVICE_NAME)
        waiting = by_job.get(job, 0)
        if waiting > half and any(n for other, n in by_job.items()
                                  if other not in (job, self.config.telemetry_job)):
            raise IngestBackpressure(f"job {job!r} has {waiting} points waiting for the store "
                                     f"(over half its buffer, other jobs waiting): retry later")

    @property
    def scrapers(self) -> list[Scraper]:
        return list(self._scrapers)

    def forwarders(self) -> dict[str, Forwarder]:
        """The upstream forwarders that run, by signal."""
        found = {"metrics": self._forwarder, "traces": self.traces.forwarder}
        return {signal: f for signal, f in found.items() if f is not None}

    def may_hold_lease(self, job: str, token: str) -> bool:
        """The sidecar's own token, or the one the operator issued to this job alone."""
        mine = [t for t in (self.token, self._job_tokens.get(job)) if t]
        return any(hmac.compare_digest(token.encode(), t.encode()) for t in mine)

    def app(self) -> ASGIApp:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self.start()
            try:
                yield
            finally:
                self.shutdown()

        app = FastAPI(title="seedance sidecar", lifespan=lifespan)
        ingest = otlp_router(
            self.sink, admit=self.admit, max_body_bytes=self.config.max_body_bytes,
            forwarder=self._forwarder, stats=self.stats, span_sink=self.traces.sink,
            traces_forwarder=self.traces.forwarder,
            ingest_token=(read_token(self.config.ingest_token_file)
                          if self.config.ingest_token_file is not None else None))
        app.include_router(ingest)
        app.include_router(lease_router(self.jobs, self.may_hold_lease))
        app.include_router(api_router(self))
        app.include_router(web_router(self))
        app.include_router(fleet_router(self))

        @app.get("/healthz")
        def healthz() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/readyz")
        def readyz(response: Response) -> dict[str, object]:
            reasons = readiness(self)
            response.status_code = 503 if reasons else 200
            return {"ready": not reasons, "job": self.config.job, "reasons": reasons}

        @app.exception_handler(OperationalError)
        async def state_db_unwritable(_: Request, exc: OperationalError) -> JSONResponse:
            """A state DB that cannot write (disk full, read-only) is a 503 with the reason,
            and the sidecar is unready until it writes again."""
            reason = str(exc.orig) if exc.orig is not None else str(exc).splitlines()[0]
            self.state_db_error = (time.monotonic(), reason)
            log.error("state DB write failed: %s", reason)
            return JSONResponse({"detail": f"state DB not writable: {reason}"}, status_code=503,
                                headers={"Retry-After": "30"})

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        # the ingest hot path skips the framework (`seedancectl._direct_routes`); every
        # request, direct or not, is timed
        return RequestDuration(DirectRoutes(app, ingest), histogram=lambda: self._request_duration)


GC_THRESHOLDS = (10_000, 10, 100)
"""The sidecar's garbage-collector thresholds (CPython's are 700, 10, 10). Objects that live
a few seconds (a buffered batch, a request's rows) outlived two young collections at the
default and reached the old generation, so with the start-up heap frozen (`settle_heap`) a
full collection came every 10-20 s in each sidecar of a 16-sidecar fleet, each holding the
interpreter lock 15-440 ms on a busy node; the API's calls over 100 ms came with them. Here
young collections are rarer, such objects die before one, and a full collection waits for 100
middle ones: one per sidecar in a 2-minute fleet run where there were 10 or more, RSS alike.
The fleet's API p99 (``bench/fleet.py``, ``docs/scale.md``): 88 ms in the full N = 16 run where
the three before took 178-186; median 103 against 145 ms over 2-minute runs, which move by a
factor of three at the same code, so the rest of the tail has other causes. Garbage in
reference cycles waits longer for its collection: at most the objects of 10,000 allocations
in the young generation."""


def settle_heap() -> None:
    """Collect, then freeze what survives (the imports, the config): a full collection held
    the GIL about 60 ms walking the ~240k objects they leave, stalling every request in flight;
    frozen, they are never walked again (and are never freed, as they live as long as the
    process anyway)."""
    gc.collect()
    gc.freeze()


SWITCH_INTERVAL_S = 0.001
"""How long a thread holds the interpreter lock while another waits (CPython's is 5 ms). A
request thread gives the lock up at each database call and socket write, and while a fold or
a policy pass runs it waits up to the whole interval to get it back, each time; on
a busy node (``bench/api_latency.py``, two sidecars side by side with 2 busy cores) the API's
p99 went 26.4 -> 20.8, 23.5 -> 18.3 and 16.8 -> 17.0 ms (median ratio 0.79), the sidecar's
CPU 0.23 of a core in both."""


def settle_interpreter() -> None:
    """`settle_heap`, then collect at `GC_THRESHOLDS`, switch threads at `SWITCH_INTERVAL_S`
    and fix malloc's mmap threshold (`seedancectl._malloc`): the sidecar process's
    interpreter, set once before it serves."""
    fix_mmap_threshold()
    settle_heap()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


KEEP_ALIVE_S = 75
"""How long the sidecar keeps an idle HTTP connection open. Longer than clients keep theirs
in their pools (httpx 5 s, like uvicorn's own default), so the client closes first: with equal
timeouts a client reusing a connection as the server closes it gets a reset (nginx: 75 s)."""


def run_sidecar(sidecar: Sidecar) -> None:
    """Serve until interrupted; the lifespan starts and stops the parts."""
    config = sidecar.config
    yield_cpu(config.nice)
    tls = config.tls_cert_file is not None
    server = uvicorn.Server(uvicorn.Config(
        sidecar.app(), host=config.host.strip("[]"), port=config.port, log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_certfile=str(config.tls_cert_file) if tls else None,
        ssl_keyfile=str(config.tls_key_file) if tls else None))
    configure_sidecar_logging()  # after uvicorn's own logging set-up, which resets handlers
    if not config.loopback:
        log.warning("listening on %s, reachable from other hosts (%s)", config.listen,
                    "TLS" if tls else "allow_insecure_listen: "
                    "plain HTTP, bearer tokens readable on the wire")
    settle_interpreter()
    server.run()
