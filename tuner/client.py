"""The in-job side of the knob lease: apply the sidecar's config at step boundaries, ack it.

Imported by the training job (it needs torch), never by the sidecar. Works with any
``nn.Module`` and ``torch.optim`` optimizer::

    session = tuner.client.attach(model, optimizer, job="gpt", sidecar="http://127.0.0.1:4318",
                                  global_batch=32)
    warmup = session.knob("warmup_steps", 100, low=0, high=1000, integer=True)
    for x, y in loader:                                   # x: one global batch (this rank's part)
        with session.step(tokens=x.numel(), samples=len(x)):
            n = session.micro_batches(32)                 # live micro_batch knob, global batch fixed
            for xs, ys in zip(x.chunk(n), y.chunk(n)):
                (model(xs, ys) / n).backward()
            session.after_backward()
            optimizer.step(); optimizer.zero_grad()
    session.close()

What happens at the start of each ``session.step()`` (a step boundary): the newest config a
background thread received by long-polling the sidecar is applied (the hot path never waits on
HTTP): one-shot actions first (snapshot; full or local rollback via ``tuner.checkpoint``), then
the built-in knobs (``precision.<group>`` via ``tuner.precision``, ``threads`` via
``torch.set_num_threads``, ``micro_batch`` read through ``micro_batches``) and the user knobs
(``handle.value``). The version is acked with the step number and becomes the
``seedance.config.version`` of every metric point from then on (the session owns the
``TrainingInstrumentation`` and, unless given a meter, the OTLP export to the sidecar).

Traces: a config that comes with a W3C ``traceparent`` (one sent for a change) is applied inside
a span ``job.apply`` (version, step, rank) that is a child of it, so the change's trace shows
the job switching. Unless given a meter, the session exports its spans to the sidecar over OTLP
(``/v1/traces``) through its own TracerProvider; with a meter, the global one (a no-op unless
the process installed one).

Multi-rank: only rank 0 talks to the sidecar. At every boundary rank 0 broadcasts one int64
("which update is newest"); only when it differs from the one in force does it broadcast the
update itself (``broadcast_object_list``), so every rank switches at the same step.

Priors: at attach the session measures what each dtype's matmul buys on the model's device
(``collectors.torch_profile.dtype_speedups``, cached per device model): a precision not faster
than fp32 here stays a legal value of ``precision.<group>`` but is in the knob's
``search_excludes``, so no search proposes it; fp16 is a risky value (a person approves it)
unless the job gave ``attach`` its GradScaler. Every 50th step (and the first) a
``ModuleGroupProfiler`` times each precision group's share of the forward and reports it with
the groups' dtypes, the input of the sidecar's compute priors (which group to try first).

Fail open: if the lease cannot be renewed for ``lease_ttl_s`` (sidecar gone), the job goes back
to the last baseline it was sent at the next boundary, logs it once, trains on, and re-attaches
when the sidecar answers again. With ``sidecar=None`` the session is a null object: knobs keep
their defaults and nothing talks to the network.

A trial never kills the job:

- Shadow step: a config not run before in this process is first tried on the last batch the
  model saw (its root forward's arguments, kept by reference through a forward pre-hook): one
  forward and one backward of the sum of the floating outputs (in fp32), no optimizer step.
  Everything it touches is put back: every ``.grad`` (``None`` included), the buffers (BatchNorm
  running statistics and ``num_batches_tracked``) and the CPU and CUDA RNG states. A config that
  raises there is acked ``failed`` with the error, the config in force stays, and the session
  refuses it for the rest of the process (acked ``failed`` again, not tried again). The cost is
  one forward and backward per new config; restart-scope knobs do not make a config new.
  Before the first forward there is no batch, so no shadow step: the config takes effect
  untried (a step that then raises is handled as below). The model's other state (a counter
  of its own, say) is not restored.
- An exception inside ``with session.step()`` under an experimental config (its live knobs
  differ from the baseline the sidecar last sent) is treated like an inf step under a
  GradScaler: the baseline is put back in force, the step is skipped (gradients set to None, the
  grad scaler's record of an ``unscale_`` dropped), the exception is logged and swallowed
  (``skipped_steps`` counts them), the config is refused from then on and the failure is acked
  to the sidecar (a ``failed`` ack of the version in force, after its ``applied`` one). Unless
  the same batch fails under the baseline too: then the shadow step of the last batch under
  the baseline raises as well, the experimental config stays in force and the original
  exception propagates. Exceptions under the baseline, and ``KeyboardInterrupt`` /
  ``SystemExit`` anywhere, propagate as before. An exception raised outside the model (the
  user's own code) is judged the same way, so a bug of the job that happens to strike first
  under a trial costs that trial and surfaces one step later. Multi-rank: the shadow verdict
  is agreed by all ranks (one all-reduce per new config); a step skip is taken by each rank
  that raised, which keeps the ranks in step when the config fails the same way on all of them
  (the usual case) and cannot when one rank fails alone (its peers wait in a collective).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.metrics import Meter
from opentelemetry.trace import Span, Status, StatusCode
from torch import nn
from torch.utils import _pytree as pytree

from collectors import (
    SeedanceError,
    Telemetry,
    TelemetryConfig,
    Tracing,
    setup_telemetry,
    setup_tracing,
)
from collectors.torch_profile import ModuleGroupProfiler, dtype_speedups
from collectors.torch_training import (
    NullTrainingInstrumentation,
    TrainingInstrumentation,
    _unwrap,
    assign_groups,
)
from tuner._knobs import SCHEDULER_KNOBS, Config, Knob, KnobSpace, KnobValue
from tuner._lease_client import KnobHandle, _Lease, _NoLease, _Update, apply_span
from tuner.checkpoint import Checkpointer, Snapshot
from tuner.precision import PrecisionHandle, PrecisionPolicy, apply_precision, norm_only

log = logging.getLogger(__name__)

PRECISION_CHOICES: tuple[str, ...] = ("fp32", "bf16", "fp16")
ConfigKey = tuple[tuple[str, KnobValue], ...]
"""The live knob values of a config, sorted: what the shadow step and the refusals go by."""
Batch = tuple[tuple[Any, ...], dict[str, Any]]
"""A root forward's positional and keyword arguments."""


class ClientError(SeedanceError):
    """The session is used in a way it cannot honour (a knob declared too late, say)."""


class ConfigRefusedError(ClientError):
    """The config failed before in this process (shadow step or a step under it)."""


def _knob_group_name(group: str) -> str:
    name = re.sub(r"\W", "_", group)
    return name if name.isidentifier() else f"_{name}"


def default_precision_groups(model: nn.Module, module_groups: Mapping[str, Sequence[str]] | None
                             ) -> dict[str, tuple[str, ...]]:
    """Precision groups named like the instrumentation's gradient groups: each group is the
    modules that own its parameters (exact names), so ``precision.ffn`` acts on exactly the
    parameters whose norms are reported as ``ffn``. Parameters of the root module are left out
    (casting the root would cast everything)."""
    names = [n for n, p in _unwrap(model).named_parameters() if p.requires_grad]
    groups: dict[str, list[str]] = {}
    seen: set[str] = set()
    for name, group in zip(names, assign_groups(names, module_groups), strict=True):
        owner = name.rpartition(".")[0]
        if owner and owner not in seen:
            seen.add(owner)
            groups.setdefault(group, []).append(owner)
    return {g: tuple(m) for g, m in groups.items()}


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
        self.job = job
        self.model = _unwrap(model)
        self.optimizer = optimizer
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.version = 0
        self.steps_done = 0
        self.switches: list[tuple[int, int]] = []
        """(step, version) of every config that took effect, for logs and tests."""
        self.skipped_steps = 0
        """Steps skipped because they raised under an experimental config."""
        self._grad_scaler = grad_scaler
        self._snapshot_max_bytes = snapshot_max_bytes
        self._checkpointer: Checkpointer | None = None
        self._snapshots: dict[str, Snapshot] = {}
        self._precision: PrecisionHandle | None = None
        self._telemetry: Telemetry | None = None
        self._tracing: Tracing | None = None
        self._tracer = trace.get_tracer("tuner.client")
        if meter is None and sidecar is not None:
            export = TelemetryConfig(job=job, rank=self.rank, otlp_endpoint=sidecar,
                                     otlp_protocol="http/protobuf",
                                     export_interval_s=export_interval_s)
            self._telemetry = setup_telemetry(export)
            meter = self._telemetry.meter("tuner.client")
            self._tracing = setup_tracing(export)
            self._tracer = self._tracing.tracer("tuner.client")
        self.instrumentation: TrainingInstrumentation | NullTrainingInstrumentation = (
            TrainingInstrumentation(model, optimizer, meter, grad_scaler=grad_scaler,
                                    module_groups=module_groups,
                                    config_version=lambda: self.version)
            if meter is not None else NullTrainingInstrumentation())
        groups = (dict(precision_groups) if precision_groups is not None
                  else default_precision_groups(model, module_groups))
        self._precision_groups = {_knob_group_name(g): tuple(p) for g, p in groups.items()}
        # Norm layers compute in fp32 whatever they are given, so a group of norms only would be
        # a knob that changes nothing: the group stays (local rollback), its knob does not.
        self._precision_knobs = tuple(g for g, p in self._precision_groups.items()
                                      if not norm_only(self.model, p))
        self._knobs: dict[str, Knob] = {}
        self._handles: dict[str, KnobHandle] = {}
        self._started = False
        # What each dtype buys here (a matmul micro-benchmark, cached per device model): a
        # precision slower than fp32 on this device stays settable but is never searched.
        self.speedups: Mapping[str, float] = (
            dtype_speedups(_device_of(self.model)) if sidecar is not None else {})
        slower = tuple(p for p in PRECISION_CHOICES
                       if p != "fp32" and self.speedups and self.speedups.get(p, 0.0) <= 1.0)
        # fp16 without a loss scaler underflows: a person decides (bf16 keeps fp32's range)
        risky = ("fp16",) if grad_scaler is None else ()
        for group in self._precision_knobs:
            self._declare(Knob(name=f"precision.{group}", default="fp32",
                               choices=PRECISION_CHOICES, risky_values=risky,
                               search_excludes=slower,
                               description=f"compute precision of module group {group}"))
        self._profiler = (ModuleGroupProfiler(self.model, self._precision_groups, meter,
                                              config_version=lambda: self.version,
                                              speedups=self.speedups)
                          if meter is not None and self.speedups else None)
        cpus = max(_usable_cpus(), torch.get_num_threads())
        if cpus > 1:
            self._declare(Knob(name="threads", default=torch.get_num_threads(), low=1,
                               high=cpus, integer=True, description="torch.set_num_threads"))
        if kind == "train":
            for knob in SCHEDULER_KNOBS:  # restart scope: read at the next launch
                self._declare(knob)
        self._global_batch = global_batch
        if global_batch is not None:
            if global_batch % self.world_size:
                raise ClientError(f"global_batch {global_batch} is not a multiple of the world "
                                  f"size {self.world_size}")
            per_rank = global_batch // self.world_size
            sizes = tuple(d for d in range(1, per_rank + 1) if per_rank % d == 0)
            self._declare(Knob(name="micro_batch", default=micro_batch or per_rank,
                               choices=sizes, description="samples per micro-batch and rank"))
        self._values: dict[str, KnobValue] = {}
        self._key: ConfigKey = ()
        self._applied_seq = 0
        self._update: _Update | None = None  # the update in force: a later failure is acked to it
        self._baseline: Config | None = None  # the sidecar's, as of the last update applied
        self._passed: set[ConfigKey] = set()
        self._failed: dict[ConfigKey, str] = {}
        self._started_batch: Batch | None = None  # the root forward's last input
        self._last_batch: Batch | None = None  # the last input its forward got through
        self._shadowing = False
        # DataParallel's replicas share the model's hooks and see one chunk each, on their own
        # device: record and replay the whole batch through the wrapper there.
        self._replay = model if isinstance(model, nn.DataParallel) else self.model
        self._batch_hooks = [] if sidecar is None else [
            self._replay.register_forward_pre_hook(self._start_batch, with_kwargs=True,
                                                   prepend=True),
            self._replay.register_forward_hook(self._end_batch)]
        self._lease: _Lease | _NoLease = (
            _Lease(sidecar, job=job, kind=kind, world_size=self.world_size,
                   lease_ttl_s=lease_ttl_s, applied_version=lambda: self.version)
            if sidecar is not None and self.rank == 0 else _NoLease())
        self._sync = sidecar is not None and self.world_size > 1
        self._flag_device = torch.device(
            "cuda", torch.cuda.current_device()) if self._sync and dist.get_backend() == "nccl" \
            else torch.device("cpu")

    # ---- declaring -------------------------------------------------------------------------

    def knob(self, name: str, default: KnobValue, choices: Sequence[KnobValue] | None = None,
             low: float | None = None, high: float | None = None, *, integer: bool = False,
             log: bool = False, scope: str = "live", risk: str = "low",
             description: str = "") -> KnobHandle:
        """Declare a knob of your own (before the first step); read ``.value`` each step."""
        return self._declare(Knob(
            name=name, default=default, choices=tuple(choices) if choices is not None else None,
            low=low, high=high, integer=integer, log=log, scope=scope,  # type: ignore[arg-type]
            risk=risk, description=description))  # type: ignore[arg-type]

    def _declare(self, knob: Knob) -> KnobHandle:
        if self._started:
            raise ClientError(f"knob {knob.name}: declare knobs before the first step")
        if knob.name in self._knobs:
            raise ClientError(f"knob {knob.name} is already declared")
        self._knobs[knob.name] = knob
        handle = self._handles[knob.name] = KnobHandle(knob)
        return handle

    @property
    def knobs(self) -> KnobSpace:
        return KnobSpace.of(self._knobs.values())

    @property
    def values(self) -> dict[str, KnobValue]:
        """The config values in force (the knob defaults before the first step)."""
        return {n: h.value for n, h in self._handles.items()}

    @property
    def precision_groups(self) -> Mapping[str, tuple[str, ...]]:
        return dict(self._precision_groups)

    def micro_batches(self, global_batch: int) -> int:
        """How many micro-batches this rank accumulates so the global batch stays
        ``global_batch`` under the live ``micro_batch`` knob (declared by ``attach(global_batch=
        ...)``)."""
        if "micro_batch" not in self._handles:
            raise ClientError("no micro_batch knob: pass global_batch= to attach()")
        if global_batch != self._global_batch:
            raise ClientError(f"global_batch {global_batch} differs from the {self._global_batch} "
                              "given to attach()")
        return global_batch // self.world_size // int(self._handles["micro_batch"].value)

    # ---- the loop ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, *, tokens: int = 0, samples: int = 0) -> Iterator[None]:
        """One optimizer step; the newest config takes effect as it begins. An exception under
        an experimental config skips the step instead of ending the job (module docstring)."""
        self._boundary()
        profiled = (self._profiler.step(self.steps_done) if self._profiler is not None
                    else contextlib.nullcontext())
        try:
            with self.instrumentation.step(tokens=tokens, samples=samples), profiled:
                yield
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
        self._lease = _NoLease()
        self.instrumentation.flush()
        if self._telemetry is not None:
            self._telemetry.shutdown(timeout_s)
            self._telemetry = None
        if self._tracing is not None:
            self._tracing.shutdown(timeout_s)
            self._tracing = None
        if self._precision is not None:
            self._precision.remove()
            self._precision = None
        if self._profiler is not None:
            self._profiler.close()
            self._profiler = None
        for hook in self._batch_hooks:
            hook.remove()
        self._batch_hooks.clear()
        self._started_batch = self._last_batch = None

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
            self._lease.start(list(self._knobs.values()), self._values)
        update = self._lease.poll()
        if self._sync:
            update = self._broadcast(update)
        if update is not None and update.seq != self._applied_seq:
            self._apply(update)

    def _broadcast(self, update: _Update | None) -> _Update | None:
        seq = update.seq if update is not None else self._applied_seq
        flag = torch.tensor([seq], dtype=torch.int64, device=self._flag_device)
        dist.broadcast(flag, src=0)
        if int(flag.item()) == self._applied_seq:
            return None
        box: list[Any] = [update]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    def _apply_span(self, update: _Update, step: int) -> contextlib.AbstractContextManager[
            Span | None]:
        return apply_span(self._tracer, update, job=self.job,
                          attributes={"seedance.step": step, "seedance.rank": self.rank})

    def _apply(self, update: _Update) -> None:
        step, config = self.steps_done, update.config
        if update.baseline is not None:
            self._baseline = update.baseline
        with self._apply_span(update, step) as span:
            results = [self._run_action(action) for action in update.actions]
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
            if key not in self._passed and self._last_batch is not None:
                self._shadow_step(self._last_batch)
                tried = key
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if self._sync:
            error = self._agree(error)
        if error is None:
            if tried is not None:
                self._passed.add(tried)
            return None
        if key is not None:
            self._failed.setdefault(key, error)
        with contextlib.suppress(Exception):
            self._set_values(previous)
        return error

    def _agree(self, error: str | None) -> str | None:
        """A new config fails on every rank when it fails on one (ranks run one config)."""
        flag = torch.tensor([error is not None], dtype=torch.int64, device=self._flag_device)
        dist.all_reduce(flag)
        if error is None and int(flag.item()):
            return "failed on another rank"
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
            if self._started_batch is not None:  # the step's own batch, if its forward began
                self._shadow_step(self._started_batch)
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

    def _shadow_step(self, batch: Batch) -> None:
        """Forward and backward of ``batch`` under the config in force, no optimizer step;
        raises what the model raises, and puts back the gradients, buffers and RNG states."""
        args, kwargs = batch
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        buffers = [(b, b.clone()) for b in self.model.buffers()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._shadowing = True
        try:
            for p in params:
                p.grad = None
            with torch.enable_grad():
                total = _float_sum(self._replay(*args, **kwargs))
                if total.requires_grad:
                    total.backward()
        finally:
            self._shadowing = False
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _start_batch(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the root model: keep its input (references, detached)."""
        if not self._shadowing:
            self._started_batch = (_detached(args), _detached(kwargs))

    def _end_batch(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of the root model (not called when the forward raises): a new config's
        shadow step replays a batch that got through, never one that broke the job's code."""
        if not self._shadowing:
            self._last_batch = self._started_batch

    def _config_key(self, values: Mapping[str, KnobValue]) -> ConfigKey:
        return tuple(sorted((k, v) for k, v in values.items()
                            if (knob := self._knobs.get(k)) is None or knob.scope == "live"))

    def _set_values(self, values: Mapping[str, KnobValue]) -> None:
        values = self.knobs.validate(values)
        changed = {k: v for k, v in values.items() if self._values.get(k) != v}
        if any(k.startswith("precision.") for k in changed):
            self._set_precision({g: str(values[f"precision.{g}"])
                                 for g in self._precision_knobs})
        if "threads" in changed:
            torch.set_num_threads(int(values["threads"]))
        for name, value in values.items():
            self._handles[name].value = value
        self._values = dict(values)
        self._key = self._config_key(values)

    def _set_precision(self, precisions: Mapping[str, str]) -> None:
        if self._precision is not None:
            self._precision.remove()
            self._precision = None
        if any(p != "fp32" for p in precisions.values()):
            self._precision = apply_precision(self.model, PrecisionPolicy.from_groups(
                self._precision_groups, precisions))  # type: ignore[arg-type]

    def _run_action(self, action: Mapping[str, Any]) -> dict[str, Any]:
        result = {**action, "status": "done", "error": None}
        try:
            change_id = action.get("change_id") or ""
            if action["kind"] == "snapshot":
                self._snapshots[change_id] = self._checkpoint().snapshot(label=change_id)
            elif action["kind"] == "rollback":
                snapshot = (self._snapshots[change_id] if change_id in self._snapshots
                            else self._checkpoint().latest())
                if action.get("scope", "full") == "full":
                    self._checkpoint().full_rollback(snapshot)
                else:
                    self._local_rollback(snapshot, str(action["group"]))
            else:
                raise ClientError(f"unknown action kind {action['kind']!r}")
        except Exception as exc:
            result.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            log.warning("job %s: action %s failed: %s", self.job, dict(action), result["error"])
        return result

    def _local_rollback(self, snapshot: Snapshot, group: str) -> None:
        """Weights and optimizer state of one group; its precision is the config's to set."""
        if group not in self._precision_groups:
            raise ClientError(f"unknown module group {group!r}; groups: "
                              f"{sorted(self._precision_groups)}")
        self._checkpoint().local_rollback(snapshot, list(self._precision_groups[group]))

    def _checkpoint(self) -> Checkpointer:
        if self._checkpointer is None:
            max_bytes = self._snapshot_max_bytes or 2 * _state_bytes(self.model, self.optimizer)
            self._checkpointer = Checkpointer(self.model, self.optimizer, max_bytes=max_bytes)
        return self._checkpointer


def _detached(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, tree)


def _float_sum(output: Any) -> torch.Tensor:
    """One fp32 scalar from every floating tensor of a model's output (a loss, logits, a dict)."""
    sums = [t.float().sum() for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(sums[1:], sums[0]) if sums else torch.zeros(())


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, buffers and optimizer state now, with Adam-like state assumed if none yet."""
    tensors = [*model.parameters(), *model.buffers()]
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    own = sum(t.numel() * t.element_size() for t in tensors)
    held = sum(t.numel() * t.element_size() for t in state)
    return own + (held or 2 * own) + 1024


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


__all__ = ["ClientError", "ConfigRefusedError", "KnobHandle", "Session", "attach", "default_precision_groups"]
