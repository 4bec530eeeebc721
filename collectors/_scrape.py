"""Scrape sources: a loop per exporter endpoint (dcgm-exporter, vLLM) that feeds a sink.

Each :class:`Scraper` fetches one ``/metrics`` on a fixed grid, maps it with
:func:`collectors._scrape_mapping.map_exposition` and hands the points on; failures are
counted and logged, never raised out of the loop.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx

from collectors._errors import ConfigError
from collectors._points import Point
from collectors._priority import background_thread
from collectors._scrape_mapping import ScrapeError, map_exposition
from collectors._scrape_rules import EXPORTERS
from collectors.names import ATTR_SERVICE_NAME

log = logging.getLogger(__name__)

ScrapeKind = Literal["dcgm", "vllm", "auto"]
"""Which rule table a source's scrapes go through; "auto" recognises the exporter."""


class PointSink(Protocol):
    """Where a scraper hands each scrape's points; called from the scraper's thread."""

    def __call__(self, points: list[Point], /) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrapeSource:
    """One exporter endpoint to scrape; ``job`` becomes the points' ``service.name``."""

    url: str
    job: str
    interval_s: float = 5.0
    timeout_s: float = 2.0
    kind: ScrapeKind = "auto"

    def __post_init__(self) -> None:
        try:
            url = httpx.URL(self.url)
        except httpx.InvalidURL as e:
            raise ConfigError(f"ScrapeSource.url: {e}") from e
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"ScrapeSource.url: expected an http(s) URL, got {self.url!r}")
        if not self.job:
            raise ConfigError("ScrapeSource.job: must not be empty")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"ScrapeSource.interval_s: expected > 0, got {self.interval_s}")
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= self.interval_s):
            raise ConfigError(
                f"ScrapeSource.timeout_s: expected 0 < timeout_s <= interval_s "
                f"({self.interval_s}), got {self.timeout_s}"
            )
        if self.kind != "auto" and self.kind not in EXPORTERS:
            raise ConfigError(
                f"ScrapeSource.kind: expected 'auto' or one of {sorted(EXPORTERS)}, "
                f"got {self.kind!r}"
            )


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """What one scrape did: how many points it handed on, or why it failed."""

    ok: bool
    points: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ScrapeStats:
    """Counts since start; ``last_error`` is the most recent failure's message."""

    scrapes_ok: int = 0
    scrapes_failed: int = 0
    points_total: int = 0
    last_error: str | None = None
    up: bool | None = None
    """Whether the last scrape worked (None before the first)."""


_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


class Scraper:
    """Scrapes one source every ``interval_s`` on its own daemon thread and feeds a sink.

    A failing fetch, parse or sink is logged (on the first failure and on recovery; repeats at
    debug level) and counted in :attr:`stats`; the loop goes on. ``start()`` and
    ``shutdown(timeout_s)`` are idempotent and it is a context manager. Scrapes are scheduled
    on a fixed grid of ``interval_s``; a scrape that overruns skips the slots it missed. The
    HTTP client ignores proxy settings from the environment: exporters are node-local.
    """

    def __init__(self, source: ScrapeSource, sink: PointSink) -> None:
        self.source = source
        self._sink = sink
        self._client = httpx.Client(trust_env=False, headers={"Accept": _ACCEPT})
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stats = ScrapeStats()
        self._failing = False

    @property
    def stats(self) -> ScrapeStats:
        with self._lock:
            return self._stats

    def scrape_once(self) -> ScrapeResult:
        """Fetch, map and hand on one scrape; a failure comes back as the result."""
        try:
            text = self._fetch()
            points = map_exposition(text, time_ns=time.time_ns(), kind=self.source.kind,
                                    attributes={ATTR_SERVICE_NAME: self.source.job})
        except ScrapeError as e:
            return self._record(ScrapeResult(ok=False, error=str(e)))
        try:
            self._sink(points)
        except Exception as e:  # a broken sink must not stop the loop
            log.debug("scrape sink failed", exc_info=True)
            return self._record(ScrapeResult(ok=False, error=f"sink failed: {e!r}"))
        return self._record(ScrapeResult(ok=True, points=len(points)))

    def _fetch(self) -> str:
        deadline = time.monotonic() + self.source.timeout_s
        try:
            with self._client.stream("GET", self.source.url,
                                     timeout=self.source.timeout_s) as response:
                response.raise_for_status()
                chunks = []
                for chunk in response.iter_bytes():
                    if time.monotonic() > deadline:
                        raise ScrapeError(
                            f"{self.source.url}: no full answer within "
                            f"timeout_s={self.source.timeout_s}"
                        )
                    chunks.append(chunk)
                return b"".join(chunks).decode(response.encoding or "utf-8", errors="replace")
        except httpx.HTTPError as e:
            raise ScrapeError(f"{self.source.url}: {type(e).__name__}: {e}") from e

    def _record(self, result: ScrapeResult) -> ScrapeResult:
        with self._lock:
            s = self._stats
            if result.ok:
                self._stats = ScrapeStats(s.scrapes_ok + 1, s.scrapes_failed,
                                          s.points_total + result.points, s.last_error, True)
            else:
                self._stats = ScrapeStats(s.scrapes_ok, s.scrapes_failed + 1, s.points_total,
                                          result.error, False)
            was_failing, self._failing = self._failing, not result.ok
        if not result.ok:
            level = logging.DEBUG if was_failing else logging.WARNING
            log.log(level, "scrape of %s (job %s) failed: %s", self.source.url,
                    self.source.job, result.error)
        elif was_failing:
            log.info("scrape of %s (job %s) works again", self.source.url, self.source.job)
        return result

    def start(self) -> None:
        with self._lock:
            if self._stop.is_set():
                raise ScrapeError(f"scraper for {self.source.url} was shut down; make a new one")
            if self._thread is not None:
                return
            self._thread = background_thread(self._run, name=f"seedance-scrape-{self.source.job}")
            self._thread.start()

    def _run(self) -> None:
        interval_s = self.source.interval_s
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.scrape_once()
            except Exception:  # a bug, but the loop never dies
                log.exception("scrape of %s crashed; going on", self.source.url)
            now = time.monotonic()
            next_at += interval_s * max(1, math.ceil((now - next_at) / interval_s))
            self._stop.wait(max(0.0, next_at - now))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close the client; waits up to ``timeout_s`` for a scrape."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        self._client.close()

    def __enter__(self) -> Scraper:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
