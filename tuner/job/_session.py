"""The training job's session: apply the sidecar's config at step boundaries, ack it.

Imported by the training job (it needs torch), never by the sidecar; the package docstring
(``tuner.job``) shows a loop. At each ``session.step()`` the newest config a background thread
long-polled from the sidecar is applied (one-shot actions first, then the changed knobs through
their ``Actuator``s) and acked; its version tags every metric point from then on. Only rank 0
talks to the sidecar. Fail open: a lease not renewed for ``lease_ttl_s`` sends the job back to
its baseline; ``sidecar=None`` gives a null session. A trial never kills the job: an untried
config runs a shadow step first, and a step that raises under a trial is skipped.

docs/lease-protocol.md, 'The training session' explains boundaries, traces, fail-open and failures.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.metrics import Meter
from opentelemetry.trace import Span, Status, StatusCode
from torch import nn

from collectors import Telemetry, TelemetryConfig, Tracing, setup_telemetry, setup_tracing
from collectors.names import ATTR_SEEDANCE_RANK
from collectors.torch_fingerprint import job_fingerprint
from collectors.torch_profile import ModuleGroupProfiler, dtype_speedups
from collectors.torch_training import (
    NullTrainingInstrumentation,
    StepCounts,
    TrainingInstrumentation,
    _unwrap,
)
from tuner._knobs import Config, Knob, KnobSpace, KnobValue
from tuner.job._actions import ActionRunner
from tuner.job._actuators import ActuatorRegistry, KnobHandle
from tuner.job._errors import ClientError, ConfigRefusedError
from tuner.job._lease_client import LeaseClient, LeaseUpdate, NullLease, apply_span
from tuner.job._ranks import RankSync
from tuner.job._shadow import ShadowStep
from tuner.job._torch_actuators import default_precision_groups, knob_group_name
from tuner.job._training_knobs import TrainingKnobs

log = logging.getLogger(__name__)

ConfigKey = tuple[tuple[str, KnobValue], ...]
"""The live knob values of a config, sorted: what the shadow step and the refusals go by."""


class Session:
    """One job's live config; made by ``attach``. Use it from the training thread only."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, job: str,
                 sidecar: str | None, kind: str = "train",
                 grad_scaler: torch.amp.GradScaler | None = None,
                 module_groups: Mapping[str, Sequence[str]] | None = None,
                 lease_ttl_s: float | None = None, meter: Meter | None = None,
                 precision_groups: Mapping[str, Sequence[str]] | None = None,
                 global_batch: int | None = None, micro_batch: int | None = None,
                 snapshot_max_bytes: int | None = None, export_interval_s: float = 1.0) -> None:
        if lease_ttl_s is not None and not lease_ttl_s > 0:
            raise ClientError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        if global_batch is not None and global_batch % self.world_size:
            raise ClientError(f"global_batch {global_batch} is not a multiple of the world size "
                              f"{self.world_size}")
        self.job = job
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.version = 0
        self.steps_done = 0
        self.switches: list[tuple[int, int]] = []
        """(step, version) of every config that took effect, for logs and tests."""
        self.skipped_steps = 0
        """Steps skipped because they raised under an experimental config."""
        self._grad_scaler = grad_scaler
        self._telemetry: Telemetry | None = None
        self._tracing: Tracing | None = None
        self._tracer = trace.get_tracer("tuner.job")
        if meter is None and sidecar is not None:
            export = TelemetryConfig(job=job, rank=self.rank, otlp_endpoint=sidecar,
                                     otlp_protocol="http/protobuf",
                                     export_interval_s=export_interval_s)
            self._telemetry = setup_telemetry(export)
            meter = self._telemetry.meter("tuner.job")
            self._tracing = setup_tracing(export)
            self._tracer = self._tracing.tracer("tuner.job")
        self.instrumentation: TrainingInstrumentation | NullTrainingInstrumentation = (
            TrainingInstrumentation(model, optimizer, meter, grad_scaler=grad_scaler,
                                    module_groups=module_groups,
                                    config_version=lambda: self.version,
                                    grad_interval_s=export_interval_s)
            if meter is not None else NullTrainingInstrumentation())
        groups = (dict(precision_groups) if precision_groups is not None
                  else default_precision_groups(model, module_groups))
        self._precision_groups = {knob_group_name(g): tuple(p) for g, p in groups.items()}
        self._started = False
        # What each dtype buys here (a matmul micro-benchmark, cached per device model): a
        # precision slower than fp32 on this device stays settable but is never searched.
        self.speedups: Mapping[str, float] = (
            dtype_speedups(_device_of(self.model)) if sidecar is not None else {})
        self._profiler = (ModuleGroupProfiler(self.model, self._precision_groups, meter,
                                              config_version=lambda: self.version,
                                              speedups=self.speedups)
                          if meter is not None and self.speedups else None)
        self._global_batch = global_batch
        self._knobs = TrainingKnobs(
            self.model, self._precision_groups, speedups=self.speedups,
            grad_scaler=grad_scaler is not None, kind=kind, micro_batch=micro_batch,
            per_rank_batch=global_batch // self.world_size if global_batch is not None else None)
        self._values: dict[str, KnobValue] = {}
        self._key: ConfigKey = ()
        self._applied_seq = 0
        self._update: LeaseUpdate | None = None  # in force: a later failure is acked to it
        self._baseline: Config | None = None  # the sidecar's, as of the last update applied
        self._passed: set[ConfigKey] = set()
        self._failed: dict[ConfigKey, str] = {}
        self._shadow = ShadowStep(
            self.model, model if isinstance(model, nn.DataParallel) else self.model,
            record=sidecar is not None)
        self._actions = ActionRunner(self.model, optimizer, job=job,
                                     precision_groups=self._precision_groups,
                                     snapshot_max_bytes=snapshot_max_bytes)
        self._lease: LeaseClient | NullLease = (
            LeaseClient(sidecar, job=job, kind=kind, world_size=self.world_size,
                        lease_ttl_s=lease_ttl_s, applied_version=lambda: self.version,
                        fingerprint=job_fingerprint(self.model, world_size=self.world_size,
                                                    speedups=self.speedups))
            if sidecar is not None and self.rank == 0 else NullLease())
        self._ranks = RankSync() if sidecar is not None and self.world_size > 1 else None

    # ---- declaring -------------------------------------------------------------------------

    def knob(self, name: str, default: KnobValue, choices: Sequence[KnobValue] | None = None,
             low: float | None = None, high: float | None = None, *, integer: bool = False,
             log: bool = False, scope: str = "live", risk: str = "low",
             description: str = "") -> KnobHandle:
        """Declare a knob of your own (before the first step); read ``.value`` each step."""
        if self._started:
            raise ClientError(f"knob {name}: declare knobs before the first step")
        return self._knobs.declare(Knob(
            name=name, default=default, choices=tuple(choices) if choices is not None else None,
            low=low, high=high, integer=integer, log=log, scope=scope,  # type: ignore[arg-type]
            risk=risk, description=description))  # type: ignore[arg-type]

    @property
    def knobs(self) -> KnobSpace:
        """Every knob the job declared, the session's own first."""
        return self._knobs.space

    @property
    def actuators(self) -> ActuatorRegistry:
        """What puts each knob in force, by prefix (``tuner.job.Actuator``)."""
        return self._knobs.actuators

    @property
    def values(self) -> dict[str, KnobValue]:
        """The config values in force (the knob defaults before the first step)."""
        return {**self.knobs.defaults(), **self._values}

    @property
    def precision_groups(self) -> Mapping[str, tuple[str, ...]]:
        """Module-name patterns of each ``precision.<group>``, by group."""
        return dict(self._precision_groups)

    def micro_batches(self, global_batch: int) -> int:
        """How many micro-batches this rank accumulates so the global batch stays
        ``global_batch`` under the live ``micro_batch`` knob (declared by ``attach(global_batch=
        ...)``)."""
        if self._knobs.micro_batch is None:
            raise ClientError("no micro_batch knob: pass global_batch= to attach()")
        if global_batch != self._global_batch:
            raise ClientError(f"global_batch {global_batch} differs from the {self._global_batch} "
                              "given to attach()")
        return global_batch // self.world_size // int(self._knobs.micro_batch.value)

    # ---- the loop ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, *, tokens: int = 0, samples: int = 0) -> Iterator[StepCounts]:
        """One optimizer step; the newest config takes effect as it begins. An exception under
        an experimental config skips the step instead of ending the job (module docstring).
        The counts it yields may grow until the step ends (a framework fetches batches in it)."""
        self._boundary()
        profiled = (self._profiler.step(self.steps_done) if self._profiler is not None
                    else contextlib.nullcontext())
        try:
            with self.instrumentation.step(tokens=tokens, samples=samples) as counts, profiled:
                yield counts
        except Exception as exc:
            self._skip_or_raise(exc)
        else:
            self._passed.add(self._key)
        finally:
            self.steps_done += 1

    def data_wait(self) -> contextlib.AbstractContextManager[None]:
        return self.instrumentation.data_wait()

    def after_backward(self, *, unscaled: bool | None = None) -> None:
        self.instrumentation.after_backward(unscaled=unscaled)

    def record_loss(self, loss: torch.Tensor | float) -> None:
        self.instrumentation.record_loss(loss)

    def flush(self) -> None:
        self.instrumentation.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop talking to the sidecar, flush metrics, remove hooks (idempotent)."""
        self._lease.shutdown(timeout_s)
        self._lease = NullLease()
        self.instrumentation.flush()
        if self._telemetry is not None:
            self._telemetry.shutdown(timeout_s)
            self._telemetry = None
        if self._tracing is not None:
            self._tracing.shutdown(timeout_s)
            self._tracing = None
        self._knobs.precision.remove()
        if self._profiler is not None:
            self._profiler.close()
            self._profiler = None
        self._shadow.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- boundary ----------------------------------------------------------------------------

    def _boundary(self) -> None:
        if not self._started:
            self._started = True
            self._values = self.knobs.defaults()
            self._key = self._config_key(self._values)
            self._lease.start(list(self.knobs.knobs.values()), self._values)
        update = self._lease.poll()
        if self._ranks is not None:
            update = self._ranks.newest(update, self._applied_seq)
        if update is not None and update.seq != self._applied_seq:
            self._apply(update)

    def _apply_span(self, update: LeaseUpdate, step: int) -> contextlib.AbstractContextManager[
            Span | None]:
        return apply_span(self._tracer, update, job=self.job,
                          attributes={"seedance.step": step, ATTR_SEEDANCE_RANK: self.rank})

    def _apply(self, update: LeaseUpdate) -> None:
        step, config = self.steps_done, update.config
        if update.baseline is not None:
            self._baseline = update.baseline
        with self._apply_span(update, step) as span:
            results = [self._actions.run(action) for action in update.actions]
            previous = dict(self._values)
            error = self._switch(config.values)
            status = "applied" if error is None else "failed"
            if error is not None:
                log.warning("job %s: config v%d failed at step %d (%s); keeping v%d", self.job,
                            config.version, step, error, self.version)
                if span is not None:
                    span.set_status(Status(StatusCode.ERROR, error))
        self._applied_seq = update.seq
        if status == "applied":
            self._update = update
        if status == "applied" and config.version != self.version:
            self.version = config.version  # the instrumentation reads it at each step start
            self.switches.append((step, config.version))
            changed = sorted(k for k in config.values if previous.get(k) != config.values[k])
            log.info("job %s: config v%d in force from step %d%s", self.job, config.version,
                     step, f" ({', '.join(changed)})" if changed else "")
        self._lease.ack(update, {"version": config.version, "step": step, "status": status,
                                 "error": error, "actions": results})

    def _switch(self, values: Mapping[str, KnobValue]) -> str | None:
        """Put ``values`` in force, on a shadow step first when they are new; the error when
        they fail (then the values in force before stay, and these are refused from now on)."""
        previous = dict(self._values)
        key: ConfigKey | None = None
        tried: ConfigKey | None = None
        error = None
        try:
            values = self.knobs.validate(values)
            key = self._config_key(values)
            if key in self._failed:
                raise ConfigRefusedError(f"it failed before in this process ({self._failed[key]})")
            self._set_values(values)
            if key not in self._passed and self._shadow.last_batch is not None:
                self._shadow.run(self._shadow.last_batch)
                tried = key
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if self._ranks is not None:
            error = self._ranks.agree(error)
        if error is None:
            if tried is not None:
                self._passed.add(tried)
            return None
        if key is not None:
            self._failed.setdefault(key, error)
        with contextlib.suppress(Exception):
            self._set_values(previous)
        return error

    def _skip_or_raise(self, exc: Exception) -> None:
        """``exc`` ended a step: skip the step under the baseline, unless the config in force is
        the baseline or the batch fails under the baseline too (then raise ``exc``)."""
        baseline = self._baseline
        if baseline is None or self._config_key(baseline.values) == self._key:
            raise exc
        step, version, trial, key = self.steps_done, self.version, dict(self._values), self._key
        try:
            self._set_values(baseline.values)
            if self._shadow.started_batch is not None:  # the step's own batch, if it began
                self._shadow.run(self._shadow.started_batch)
            baseline_fails = False
        except Exception:
            baseline_fails = True
        if baseline_fails:  # not the config's fault: it stays, and the job sees its exception
            with contextlib.suppress(Exception):
                self._set_values(trial)
            raise exc
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self._grad_scaler is not None:
            # unscale_ may have run before the failure and no update() will follow it; the
            # scaler would refuse the next unscale_, and it has no public reset for one optimizer
            self._grad_scaler._per_optimizer_states.pop(id(self.optimizer), None)
        error = f"{type(exc).__name__}: {exc}"
        self._failed[key] = error
        self._passed.discard(key)
        self.skipped_steps += 1
        self.version = baseline.version
        self.switches.append((step, baseline.version))
        log.warning("job %s: step %d raised under config v%d (%s); step skipped, back to the "
                    "baseline v%d", self.job, step, version, error, baseline.version)
        if self._update is not None:
            self._lease.ack(self._update, {
                "version": version, "step": step, "status": "failed", "actions": [],
                "error": f"step {step} raised {error}; skipped, back to the baseline "
                         f"v{baseline.version}"})

    def _config_key(self, values: Mapping[str, KnobValue]) -> ConfigKey:
        return tuple(sorted((k, v) for k, v in values.items() if self._knobs.live(k)))

    def _set_values(self, values: Mapping[str, KnobValue]) -> None:
        """Put ``values`` in force: each actuator whose knobs changed gets its part."""
        values = self.knobs.validate(values)
        self._knobs.actuators.apply(values, previous=self._values)
        self._values = dict(values)
        self._key = self._config_key(values)


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, *, job: str,
           sidecar: str | None, kind: str = "train",
           grad_scaler: torch.amp.GradScaler | None = None,
           module_groups: Mapping[str, Sequence[str]] | None = None,
           lease_ttl_s: float | None = None, meter: Meter | None = None,
           precision_groups: Mapping[str, Sequence[str]] | None = None,
           global_batch: int | None = None, micro_batch: int | None = None,
           snapshot_max_bytes: int | None = None, export_interval_s: float = 1.0) -> Session:
    """A ``Session`` for one job; nothing talks to the sidecar until the first step.

    ``sidecar``: the sidecar's base URL (lease API and OTLP), None for a null session.
    ``module_groups``: fnmatch patterns over parameter names for the gradient groups;
    ``precision_groups``: patterns over module names for ``precision.<group>`` (default: the
    modules owning each gradient group's parameters; a group of norm layers only gets no knob,
    norms compute in fp32 anyway: ``tuner.precision``). ``global_batch`` declares the
    ``micro_batch`` knob (divisors of the per-rank batch, default ``micro_batch`` or one
    micro-batch). ``lease_ttl_s``: asked of the sidecar (None: its default). ``meter``: record
    metrics there instead of exporting OTLP to the sidecar. Call in every rank, after
    ``torch.distributed.init_process_group``.
    """
    return Session(model, optimizer, job=job, sidecar=sidecar, kind=kind,
                   grad_scaler=grad_scaler, module_groups=module_groups,
                   lease_ttl_s=lease_ttl_s, meter=meter, precision_groups=precision_groups,
                   global_batch=global_batch, micro_batch=micro_batch,
                   snapshot_max_bytes=snapshot_max_bytes, export_interval_s=export_interval_s)


