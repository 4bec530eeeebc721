"""The in-job side of the knob lease for a serving job: apply the sidecar's config between
decode steps, ack it, and say which version is in force.

The job hands ``attach_serving`` an ``apply`` callback, called with the whole config at a batch
boundary; if it raises, the previous values are re-applied and the version is acked as failed.
Torch-free, so a serving stack that is not PyTorch can use it too::

    session = tuner.job.attach_serving(
        job="serve", sidecar="http://127.0.0.1:4318", apply=engine.apply_knobs,
        defaults={"kv.key_bits": 8, "kv.value_bits": 8})
    engine.instrumentation.config_version = lambda: session.version
    while serving:
        session.boundary()          # between decode steps: the newest config takes effect
        engine.step()
    session.close()

docs/lease-protocol.md, 'The serving session' explains boundaries, actions, traces and fail-open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from collectors import JobFingerprint
from tuner._knobs import Knob, KnobSpace, KnobValue
from tuner.job._actuators import ActuatorRegistry, CallbackActuator
from tuner.job._errors import ServeClientError
from tuner.job._lease_client import LeaseClient, LeaseUpdate, NullLease, apply_span
from tuner.prefix_cache import PREFIX_CACHE_KNOBS
from tuner.routing import ROUTING_KNOBS, SHARDING_KNOB

log = logging.getLogger(__name__)

KV_BITS_CHOICES: tuple[int, ...] = (2, 4, 6, 8, 16, 32)
"""``tuner.kv_cache.BITS``: 2/4/6/8 quantised, 16 = bfloat16 and 32 = float32 unquantised."""
KV_BITS_KNOBS: tuple[Knob, ...] = (
    Knob(name="kv.key_bits", default=32, choices=KV_BITS_CHOICES,
         description="Bits per cached key (tokens quantised from the switch on)"),
    Knob(name="kv.value_bits", default=32, choices=KV_BITS_CHOICES,
         description="Bits per cached value (tokens quantised from the switch on)"),
)
SERVING_KNOBS: tuple[Knob, ...] = (*KV_BITS_KNOBS, *PREFIX_CACHE_KNOBS, *ROUTING_KNOBS,
                                   SHARDING_KNOB)
"""Every knob a serving job may declare; a job declares those it applies (``knobs=``)."""
NO_STATE = "a serving job holds no training state to snapshot or restore"
"""Why a serving job acks every one-shot action as failed."""


def available_memory_mib() -> float:
    """Memory the host could give now (MiB), as the kernel counts it (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20


def _within_memory(knob: Knob) -> Knob:
    """A cache-size knob bounded by what the host has free at attach (half of it, never
    below the job's own setting), so no search asks for a cache the machine cannot hold."""
    if knob.name != "prefix_cache.capacity_mib" or knob.high is None:
        return knob
    high = max(float(knob.default), min(knob.high, available_memory_mib() / 2))
    return knob if high >= knob.high else dataclasses.replace(knob, high=high)


class ServeSession:
    """One serving job's live config; made by ``attach_serving``. Call ``boundary`` from the
    decode loop's thread only."""

    def __init__(self, *, job: str, sidecar: str | None,
                 apply: Callable[[Mapping[str, KnobValue]], None],
                 knobs: Sequence[Knob] = SERVING_KNOBS,
                 defaults: Mapping[str, KnobValue] | None = None,
                 lease_ttl_s: float | None = None, tracer: Tracer | None = None,
                 fingerprint: JobFingerprint | None = None) -> None:
        if lease_ttl_s is not None and not lease_ttl_s > 0:
            raise ServeClientError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        defaults = dict(defaults or {})
        names = {k.name for k in knobs}
        unknown = sorted(set(defaults) - names)
        if unknown:
            raise ServeClientError(f"defaults for undeclared knob(s) {', '.join(unknown)}")
        self.job = job
        self.knobs = KnobSpace.of(_within_memory(
            dataclasses.replace(k, default=defaults[k.name]) if k.name in defaults else k)
            for k in knobs)
        self.values: dict[str, KnobValue] = self.knobs.defaults()
        """The config values in force (the job's launch values until the first switch)."""
        self.version = 0
        self.batches_done = 0
        self.switches: list[tuple[int, int]] = []
        """(batch, version) of every config that took effect, for logs and tests."""
        self.actuators = ActuatorRegistry([CallbackActuator(self.knobs, apply)])
        """What puts the config in force: the job's ``apply``, one piece (``tuner.job``)."""
        self._tracer = tracer or trace.get_tracer("tuner.job")
        self._started = False
        self._applied_seq = 0
        self._lease: LeaseClient | NullLease = (
            LeaseClient(sidecar, job=job, kind="serve", world_size=1, lease_ttl_s=lease_ttl_s,
                        applied_version=lambda: self.version, fingerprint=fingerprint)
            if sidecar is not None else NullLease())

    def boundary(self) -> bool:
        """A batch boundary: the newest config takes effect; True when one did."""
        if not self._started:
            self._started = True
            self._lease.start(list(self.knobs.knobs.values()), self.values)
        update = self._lease.poll()
        switched = False
        if update is not None and update.seq != self._applied_seq:
            switched = self._apply(update)
        self.batches_done += 1
        return switched

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop talking to the sidecar (idempotent)."""
        self._lease.shutdown(timeout_s)
        self._lease = NullLease()

    def __enter__(self) -> ServeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _apply_span(self, update: LeaseUpdate) -> contextlib.AbstractContextManager[Span | None]:
        return apply_span(self._tracer, update, job=self.job,
                          attributes={"seedance.step": self.batches_done})

    def _apply(self, update: LeaseUpdate) -> bool:
        config, batch = update.config, self.batches_done
        results: list[dict[str, Any]] = [
            {**action, "status": "failed", "error": NO_STATE} for action in update.actions]
        previous = dict(self.values)
        with self._apply_span(update) as span:
            try:
                values = self.knobs.validate(config.values)
                self.actuators.apply(values)
                self.values = values
                status, error = "applied", None
            except Exception as exc:
                status, error = "failed", f"{type(exc).__name__}: {exc}"
                log.warning("job %s: config v%d failed at batch %d (%s); keeping v%d",
                            self.job, config.version, batch, error, self.version)
                with contextlib.suppress(Exception):
                    self.actuators.apply(previous)
                if span is not None:
                    span.set_status(Status(StatusCode.ERROR, error))
        self._applied_seq = update.seq
        switched = status == "applied" and config.version != self.version
        if switched:
            changed = sorted(k for k in self.values if previous.get(k) != self.values[k])
            self.version = config.version
            self.switches.append((batch, config.version))
            log.info("job %s: config v%d in force from batch %d%s", self.job, config.version,
                     batch, f" ({', '.join(changed)})" if changed else "")
        self._lease.ack(update, {"version": config.version, "step": batch, "status": status,
                                 "error": error, "actions": results})
        return switched


def attach_serving(*, job: str, sidecar: str | None,
                   apply: Callable[[Mapping[str, KnobValue]], None],
                   knobs: Sequence[Knob] = SERVING_KNOBS,
                   defaults: Mapping[str, KnobValue] | None = None,
                   lease_ttl_s: float | None = None,
                   tracer: Tracer | None = None,
                   fingerprint: JobFingerprint | None = None) -> ServeSession:
    """A ``ServeSession`` (kind ``serve``); nothing talks to the sidecar until the first
    ``boundary()``.

    ``apply(values)`` gets the whole config (every declared knob) at a batch boundary and
    applies what changed; it raises to refuse. ``knobs``: the knobs the job declares (default
    ``SERVING_KNOBS``); ``defaults``: their values at launch, the baseline the job proposes.
    ``fingerprint``: what kind of job it is, for the fleet priors (a torch model's:
    ``collectors.torch_fingerprint.job_fingerprint``).
    """
    return ServeSession(job=job, sidecar=sidecar, apply=apply, knobs=knobs, defaults=defaults,
                        lease_ttl_s=lease_ttl_s, tracer=tracer, fingerprint=fingerprint)
