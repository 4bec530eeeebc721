"""The job side of the knob lease, shared by every in-job session (torch-free).

``LeaseClient`` long-polls the sidecar on a background thread and publishes the newest config
as a ``LeaseUpdate``; the job's loop picks it up at its own boundary (a training step in
``Session``, a batch boundary between decode steps in ``ServeSession``), applies it and acks it
through ``LeaseClient.ack``. A lease that cannot be renewed for its TTL publishes the last
baseline it was sent (fail open). ``NullLease`` is the null object for jobs without a sidecar
and for ranks other than 0. The protocol is docs/lease-protocol.md."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from opentelemetry.trace import Span, Tracer

from collectors import JobFingerprint, traceparent_context
from collectors.names import ATTR_SEEDANCE_CONFIG_VERSION, ATTR_SEEDANCE_JOB
from tuner._knobs import Config, Knob, KnobValue
from tuner._token import find_token

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 10.0
MAX_POLL_S = 30.0


@dataclass(frozen=True, kw_only=True)
class LeaseUpdate:
    """A config to apply at the next boundary; `seq` orders updates within this job.

    `baseline` is the sidecar's baseline as of this update: the config a job reverts to when a
    step fails under an experimental one (it travels with the update to every rank).
    """

    seq: int
    config: Config
    baseline: Config | None = None
    actions: tuple[Mapping[str, Any], ...] = ()
    change_id: str | None = None
    traceparent: str | None = None
    session: str | None = None  # the lease session to ack to; None for a lapse (nobody to ack)


class NullLease:
    """Null lease: ranks other than 0 and jobs without a sidecar."""

    def start(self, knobs: Sequence[Knob], baseline: Mapping[str, KnobValue]) -> None:
        """Nothing to attach to."""

    def poll(self) -> LeaseUpdate | None:
        """No config ever comes."""
        return None

    def ack(self, update: LeaseUpdate, body: dict[str, Any]) -> None:
        """Nobody to ack to."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Nothing to stop."""


class LeaseClient:
    """Rank 0's lease: a long-poll thread, an ack thread and the lapse clock.

    The poll thread only publishes `LeaseUpdate`s; the training thread picks the newest with
    `poll()` (an attribute read plus a clock read), which is also where a lapse is noticed, so
    the switch to the baseline happens at the first boundary after the TTL ran out.
    """

    def __init__(self, url: str, *, job: str, kind: str, world_size: int,
                 lease_ttl_s: float | None, applied_version: Callable[[], int],
                 timeout_s: float = 5.0, token: str | None = None,
                 fingerprint: JobFingerprint | None = None) -> None:
        token = token if token is not None else find_token()
        self._http = httpx.Client(
            base_url=url.rstrip("/"), timeout=timeout_s,
            headers={"Authorization": f"Bearer {token}"} if token else None)
        self._job = job
        self._kind = kind
        self._world_size = world_size
        self._ask_ttl_s = lease_ttl_s
        self._fingerprint = fingerprint.to_json() if fingerprint is not None else None
        self._ttl_s = lease_ttl_s or DEFAULT_LEASE_TTL_S
        self._applied_version = applied_version  # callable: the version the job runs now
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._stop = threading.Event()
        self._acks: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._knobs: list[dict[str, Any]] = []
        self._baseline_values: dict[str, KnobValue] = {}
        self.latest: LeaseUpdate | None = None
        self._session: str | None = None
        self._received = -1
        self._baseline: Config | None = None
        self._renewed_at = 0.0
        self._lapsed = False

    def start(self, knobs: Sequence[Knob], baseline: Mapping[str, KnobValue]) -> None:
        self._knobs = [k.to_json() for k in knobs]
        self._baseline_values = dict(baseline)
        for target, name in ((self._poll_loop, "lease-poll"), (self._ack_loop, "lease-ack")):
            thread = threading.Thread(target=target, name=f"{name}-{self._job}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def poll(self) -> LeaseUpdate | None:
        if (self._baseline is not None and not self._lapsed
                and time.monotonic() >= self._renewed_at + self._ttl_s):
            self._lapse()
        return self.latest

    def ack(self, update: LeaseUpdate, body: dict[str, Any]) -> None:
        if update.session is not None:
            self._acks.put((update.session, body))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._acks.put(None)
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()
        self._http.close()

    # ---- background ------------------------------------------------------------------------

    def _publish(self, config: Config, **fields: Any) -> None:
        self.latest = LeaseUpdate(seq=next(self._seq), config=config, baseline=self._baseline,
                              **fields)

    def _lapse(self) -> None:
        with self._lock:
            if (self._baseline is None or self._lapsed
                    or time.monotonic() < self._renewed_at + self._ttl_s):
                return
            self._lapsed = True
            self._session = None  # the poll thread re-attaches
            self._publish(self._baseline)
        log.warning("job %s: lease not renewed for %.1f s (sidecar unreachable); back to the "
                    "baseline config v%d at the next step, training on", self._job, self._ttl_s,
                    self._baseline.version)

    def _poll_loop(self) -> None:
        backoff_s = 0.1
        while not self._stop.is_set():
            try:
                if self._session is None:
                    self._attach()
                else:
                    self._long_poll()
                backoff_s = 0.1
            except httpx.HTTPError as exc:
                log.debug("lease call failed: %s", exc)
                self._stop.wait(min(backoff_s, self._ttl_s / 4))
                backoff_s = min(backoff_s * 2, 2.0)
            except Exception:
                log.exception("lease thread error; going on")
                self._stop.wait(1.0)

    def _attach(self) -> None:
        started = time.monotonic()
        body = {"rank": 0, "world_size": self._world_size, "kind": self._kind,
                "knobs": self._knobs, "baseline": self._baseline_values,
                "lease_ttl_s": self._ask_ttl_s, "version": int(self._applied_version()),
                "fingerprint": self._fingerprint}
        r = self._http.post(f"/v1/jobs/{self._job}/attach", json=body)
        if r.status_code != 200:
            log.warning("attach of job %s refused (%d): %s", self._job, r.status_code,
                        _detail(r))
            self._stop.wait(self._ttl_s / 2)
            return
        data = r.json()
        config = _config(data["config"])
        with self._lock:
            was_lapsed = self._lapsed
            self._session, self._ttl_s = data["session"], float(data["lease_ttl_s"])
            self._baseline = _config(data["baseline"])
            self._renewed_at, self._lapsed, self._received = started, False, config.version
            self._publish(config, session=self._session)
        log.log(logging.WARNING if was_lapsed else logging.INFO,
                "job %s attached to the sidecar (session %s, config v%d, lease %.1f s)",
                self._job, self._session, config.version, self._ttl_s)

    def _long_poll(self) -> None:
        session, started = self._session, time.monotonic()
        # A quarter of the TTL: the lease counts from the start of the last answered call, so
        # two polls back to back still renew well inside the TTL.
        wait_s = min(self._ttl_s / 4, MAX_POLL_S)
        # A slow answer that still comes before the lapse renews the lease: wait for it until
        # then (a busy sidecar answers late; only a dead one never does).
        lapses_in_s = self._renewed_at + self._ttl_s - started
        r = self._http.get(f"/v1/jobs/{self._job}/lease",
                           params={"session": session, "version": self._received,
                                   "wait_s": wait_s},
                           timeout=max(lapses_in_s, wait_s + min(self._timeout_s,
                                                                 self._ttl_s / 4)))
        with self._lock:
            if session != self._session:  # lapsed meanwhile: this answer is stale
                return
            if r.status_code in (404, 409):
                log.info("lease of job %s ended (%d: %s); re-attaching", self._job,
                         r.status_code, _detail(r))
                self._session = None
                return
            r.raise_for_status()
            data = r.json()
            self._renewed_at = started
            self._baseline = _config(data["baseline"])
            config = _config(data["config"])
            if config.version != self._received:
                self._received = config.version
                self._publish(config, actions=tuple(data["actions"]),
                              change_id=data["change_id"], traceparent=data["traceparent"],
                              session=session)

    def _ack_loop(self) -> None:
        while True:
            item = self._acks.get()
            if item is None:
                return
            session, body = item
            for attempt in range(3):
                try:
                    r = self._http.post(f"/v1/jobs/{self._job}/ack",
                                        json={"session": session, **body})
                    if r.status_code != 200:
                        log.warning("ack of v%s refused (%d): %s", body["version"],
                                    r.status_code, _detail(r))
                    break
                except httpx.HTTPError as exc:
                    log.debug("ack of v%s failed (try %d): %s", body["version"], attempt + 1,
                              exc)
                    if self._stop.wait(0.2):
                        break
            else:
                log.warning("ack of v%s not delivered", body["version"])


def _config(data: Mapping[str, Any]) -> Config:
    return Config(int(data["version"]), dict(data["values"]))


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail"))
    except ValueError:
        return r.text[:200]


@contextlib.contextmanager
def apply_span(tracer: Tracer, update: LeaseUpdate, *, job: str,
               attributes: Mapping[str, Any]) -> Iterator[Span | None]:
    """``job.apply``, a child of the update's traceparent; nothing when it has none.

    Shared by the training and the serving client, so a change's trace shows the job switching
    the same way whichever kind of job it is.
    """
    try:
        context = traceparent_context(update.traceparent) if update.traceparent else None
    except Exception as exc:
        log.warning("job %s: ignoring the traceparent of v%d: %s", job, update.config.version,
                    exc)
        context = None
    if context is None:
        yield None
        return
    with tracer.start_as_current_span("job.apply", context=context, attributes={
            ATTR_SEEDANCE_CONFIG_VERSION: update.config.version, ATTR_SEEDANCE_JOB: job,
            "seedance.change.id": update.change_id or "", **attributes}) as span:
        yield span
