"""In-job training instrumentation for any ``nn.Module`` and ``torch.optim`` optimizer.

Only a training job imports it (it imports torch; the sidecar never does). It records the
catalogue's TRAINING_METRICS through an OpenTelemetry ``Meter``, each point tagged with the
``seedance.config.version`` in force when its step began; docs/tuning.md ("What the job
reports") measures its cost per step. Usage in a plain loop::

    instr = TrainingInstrumentation(model, optimizer, meter, config_version=lambda: client.version)
    for _ in range(steps):
        with instr.data_wait():
            x, y = next(batches)
        with instr.step(tokens=x.numel(), samples=x.shape[0]):
            loss = model(x, y)
            loss.backward()
            instr.after_backward()        # before optimizer.step() / zero_grad()
            optimizer.step()
            optimizer.zero_grad()
            instr.record_loss(loss)
"""

from __future__ import annotations

import collections
import fnmatch
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from torch import nn

from collectors._catalogue import BY_NAME
from collectors._errors import SeedanceError
from collectors._points import CONFIG_VERSION_ATTR
from collectors.names import (
    ATTR_SEEDANCE_MODULE_GROUP,
    ATTR_SEEDANCE_NONFINITE_WHAT,
    TRAIN_DATA_WAIT_DURATION,
    TRAIN_NONFINITE_STEPS,
    TRAIN_STEP_DURATION,
    TRAIN_STEP_LOSS,
    TRAIN_TOKENS,
)

log = logging.getLogger(__name__)

MODULE_GROUP_ATTR = ATTR_SEEDANCE_MODULE_GROUP
NONFINITE_WHAT_ATTR = ATTR_SEEDANCE_NONFINITE_WHAT
OTHER_GROUP = "other"

DEFAULT_MODULE_GROUPS: Mapping[str, tuple[str, ...]] = {
    # Order matters: a parameter joins the first group with a matching pattern, so norms inside
    # attention blocks (q_norm, k_norm) count as norms. Matching ignores case.
    "norm": ("*ln_*", "*norm*"),
    "embedding": ("*wte*", "*wpe*", "*embed*", "*tok_emb*", "*pos_emb*"),
    "head": ("lm_head.*", "*.lm_head.*", "head.*", "*.head.*", "*classifier*", "output.*"),
    "attention": ("*attn*", "*attention*", "*qkv*", "*q_proj*", "*k_proj*", "*v_proj*",
                  "*o_proj*", "*.query.*", "*.key.*", "*.value.*"),
    "ffn": ("*mlp*", "*ffn*", "*feed_forward*", "*feedforward*", "*fc1*", "*fc2*", "*up_proj*",
            "*down_proj*", "*gate_proj*", "*intermediate*"),
}
"""Groups by common naming (GPT-2/nanoGPT, Llama, BERT); see ``assign_groups`` for fallback."""

_BACKLOG_LIMIT = 256
"""Queued entries the training thread publishes itself when no reader collects them (a meter
without readers, a no-op meter): memory stays bounded and the cost is a batch, not a step."""

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                   0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP and DataParallel hide the model under ``.module``; group by the model's own names."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def assign_groups(names: Sequence[str],
                  module_groups: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """The group of each parameter name: the first group with a matching fnmatch pattern.

    Unmatched names go to ``other``. With the default groups, a model whose names match none of
    them (a CNN, say) is grouped by top-level child module instead (``conv1``, ``layer2``, ...).
    """
    groups = DEFAULT_MODULE_GROUPS if module_groups is None else module_groups
    lowered = {g: tuple(p.lower() for p in pats) for g, pats in groups.items()}
    out = []
    for name in names:
        low = name.lower()
        out.append(next(
            (g for g, pats in lowered.items() if any(fnmatch.fnmatchcase(low, p) for p in pats)),
            OTHER_GROUP,
        ))
    if module_groups is None and all(g == OTHER_GROUP for g in out):
        return [name.split(".", 1)[0] if "." in name else OTHER_GROUP for name in names]
    return out


@dataclass(slots=True)
class StepCounts:
    """What one step processed. ``step()`` reads it when the step ends, so a framework loop that
    fetches its batches inside the step (the HF Trainer, Lightning) adds them as they come."""

    tokens: int = 0
    samples: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Row:
    """What one step measured; tensors may still live on the device."""

    step: int
    version: int
    duration_s: float  # inside step()
    wall_s: float  # duration_s plus the data waits before the step
    tokens: int
    samples: int
    learning_rate: float
    loss: torch.Tensor | float | None
    grad: torch.Tensor | None  # float64: [sq per group | zeros | nonfinite per group | scale]
    has_norms: bool  # grad starts with the squared norm of each group
    numel: tuple[int, ...] | None  # elements per group when element stats were taken
    has_scale: bool  # grad ends with the GradScaler scale


@dataclass(frozen=True, slots=True)
class _Wait:
    """One data wait, stamped with the config version in force when it ended."""

    version: int
    seconds: float


_Entry = tuple[_Row, torch.Tensor | None, Any] | _Wait
"""A queued step (its pinned host copy and CUDA event when its tensors are on a GPU) or wait."""


class _PublishHook:
    """An observable gauge that never observes: its callback, run by each reader's collect
    before the collect reads the instruments, records the steps queued by every
    instrumentation on its meter; it exports nothing. One per meter, since the SDK keeps the
    first callback of an instrument name; it holds the instrumentations weakly."""

    NAME = "seedance.train.publish"
    _of_meter: weakref.WeakKeyDictionary[Meter, _PublishHook] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, meter: Meter) -> None:
        self.queues: weakref.WeakSet[TrainingInstrumentation] = weakref.WeakSet()
        meter.create_observable_gauge(self.NAME, callbacks=[self._on_collect])

    @classmethod
    def of(cls, meter: Meter) -> _PublishHook:
        with cls._lock:
            hook = cls._of_meter.get(meter)
            if hook is None:
                hook = cls._of_meter[meter] = cls(meter)
            return hook

    def _on_collect(self, options: CallbackOptions) -> Iterable[Observation]:
        for instrumentation in list(self.queues):
            instrumentation._drain(wait=False)
        return ()


class TrainingInstrumentation:
    """Records step time, throughput, loss and gradient health for one model and optimizer.

    Call it from the training thread. What a step measured is queued there, and recorded into
    ``meter``'s gauges, counters and histograms on the export thread, when a reader collects
    (``_PublishHook``): the training thread does no OpenTelemetry work on its own time, where
    the SDK's record path, run cold between steps, cost about 0.25 ms a step (docs/tuning.md).
    Each collect records every step queued before it, so exports carry what they did before.
    ``config_version`` is an int or a callable returning one, read when each step begins; it can
    also be assigned later (``instr.config_version = 7``).

    Gradient norms are read about once per ``grad_interval_s`` of the job's own time (its steps
    and data waits; 0: every step), and the element statistics on every ``stats_every``-th
    reading. A reading is taken on the step that completes the interval since the last one
    (predicted from the previous step's length), so readings are never further apart than the
    interval: with the export interval, every export carries a fresh reading and no reading goes
    unseen (a gauge exports only its last value), while the norm pass costs the same on a 10 ms
    step as on a 1 s one. Time outside the instrumented steps (evaluation, a checkpoint, a bench's
    uninstrumented arm) does not bring a reading forward. The loss and the GradScaler's scale are
    read every step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        meter: Meter,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
        module_groups: Mapping[str, Sequence[str]] | None = None,
        config_version: Callable[[], int] | int = 0,
        attributes: Mapping[str, str | int] | None = None,
        stats_every: int = 10,
        grad_interval_s: float = 1.0,
    ) -> None:
        if stats_every < 1:
            raise SeedanceError(f"stats_every must be >= 1, got {stats_every}")
        if not grad_interval_s >= 0 or math.isinf(grad_interval_s):
            raise SeedanceError(f"grad_interval_s must be a finite number >= 0, got "
                                f"{grad_interval_s!r}")
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.stats_every = stats_every
        self.grad_interval_s = grad_interval_s
        self._grads_read = 0
        self._since_read_s = math.inf  # the job's own time since the last reading
        self._last_step_s = 0.0
        self.config_version = config_version
        self._base_attributes = dict(attributes or {})
        named = [(n, p) for n, p in _unwrap(model).named_parameters() if p.requires_grad]
        if not named:
            raise SeedanceError("model has no trainable parameters")
        group_of = assign_groups([n for n, _ in named], module_groups)
        self.groups: tuple[str, ...] = tuple(dict.fromkeys(group_of))
        self.group_of_parameter: dict[str, str] = {
            n: g for (n, _), g in zip(named, group_of, strict=True)}
        self._params = [p for _, p in named]
        self._gids = [self.groups.index(g) for g in group_of]
        self._device = self._params[0].device
        self._full_index = torch.tensor(self._gids, device=self._device)
        self._instruments(meter)
        self._attr_cache: dict[int, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        self._step_index = 0
        self._in_step = False
        self._step_version = 0
        self._wait_outside_s = 0.0
        self._loss: torch.Tensor | float | None = None
        self._grad: torch.Tensor | None = None
        self._has_norms = False
        self._numel: tuple[int, ...] | None = None
        self._has_scale = False
        self._pending: collections.deque[_Entry] = collections.deque()
        self._publish_lock = threading.Lock()  # the export thread's collects and flush()
        self._last: dict[str, Any] = {}
        _PublishHook.of(meter).queues.add(self)

    # ---- configuration ---------------------------------------------------------------------

    @property
    def config_version(self) -> int:
        """The version stamped on the next step, read from the source when that step begins."""
        return int(self._version_source())

    @config_version.setter
    def config_version(self, value: Callable[[], int] | int) -> None:
        self._version_source = value if callable(value) else (lambda v=int(value): v)

    def _instruments(self, meter: Meter) -> None:
        def spec(name: str) -> dict[str, str]:
            return {"name": name, "unit": BY_NAME[name].unit,
                    "description": BY_NAME[name].description}

        self._h_step = meter.create_histogram(
            **spec(TRAIN_STEP_DURATION),
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS_S)
        self._h_wait = meter.create_histogram(
            **spec(TRAIN_DATA_WAIT_DURATION),
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS_S)
        # no bounds: only the sum and count travel, and a window's mean loss is their ratio
        self._h_loss = meter.create_histogram(**spec(TRAIN_STEP_LOSS),
                                              explicit_bucket_boundaries_advisory=[])
        g = {short: meter.create_gauge(**spec(f"seedance.train.{short}")) for short in (
            "tokens_per_second", "samples_per_second", "loss", "step", "grad.norm",
            "grad.group_norm", "grad.nonfinite", "grad.zero_fraction", "grad_scaler.scale",
            "learning_rate")}
        self._g = g
        self._c_nonfinite = meter.create_counter(**spec(TRAIN_NONFINITE_STEPS))
        self._c_tokens = meter.create_counter(**spec(TRAIN_TOKENS))

    def _attrs(self, version: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        cached = self._attr_cache.get(version)
        if cached is None:
            base = {**self._base_attributes, CONFIG_VERSION_ATTR: version}
            cached = (base, [{**base, MODULE_GROUP_ATTR: g} for g in self.groups])
            self._attr_cache = {version: cached}  # versions only move forward; keep one
        return cached

    # ---- the API a loop calls --------------------------------------------------------------

    @contextmanager
    def data_wait(self) -> Iterator[None]:
        """Times fetching a batch; a wait outside ``step()`` counts toward the next step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            waited = time.perf_counter() - start
            version = self._step_version if self._in_step else self.config_version
            self._enqueue(_Wait(version, waited))
            if not self._in_step:
                self._wait_outside_s += waited

    @contextmanager
    def step(self, *, tokens: int = 0, samples: int = 0) -> Iterator[StepCounts]:
        """Times one optimizer step and exports what it measured when it ends without error;
        the counts it yields may grow until then."""
        self._step_version = self.config_version
        self._in_step = True
        self._loss, self._grad, self._numel = None, None, None
        self._has_norms = self._has_scale = False
        counts = StepCounts(tokens=tokens, samples=samples)
        start = time.perf_counter()
        try:
            yield counts
        finally:
            self._in_step = False
        duration_s = time.perf_counter() - start
        wall_s = duration_s + self._wait_outside_s
        self._wait_outside_s = 0.0
        self._since_read_s += wall_s
        self._last_step_s = wall_s
        self._submit(_Row(step=self._step_index, version=self._step_version,
                          duration_s=duration_s, wall_s=wall_s, tokens=counts.tokens,
                          samples=counts.samples,
                          learning_rate=float(self.optimizer.param_groups[0]["lr"]),
                          loss=self._loss, grad=self._grad, has_norms=self._has_norms,
                          numel=self._numel, has_scale=self._has_scale))
        self._step_index += 1

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """The step's loss. A GPU tensor stays on its device until its value is exported; a CPU
        one is read now, as the step ends, since the queue holds it until the next collect."""
        if not isinstance(loss, torch.Tensor):
            self._loss = float(loss)
        elif loss.device.type == "cpu":
            self._loss = (loss if loss.numel() == 1 else loss.detach().reshape(-1)[0]).item()
        else:
            self._loss = loss.detach()

    def after_backward(self, *, unscaled: bool | None = None) -> None:
        """Reads the gradients: call after backward, before ``optimizer.step``/``zero_grad``.

        With a GradScaler the norms are reported unscaled: if ``scaler.unscale_`` already ran
        (detected, or say so with ``unscaled=True``) they are taken as they are, otherwise they
        are divided by the scale in force.
        """
        due = self._since_read_s + self._last_step_s >= self.grad_interval_s
        parts = self._read_grads(self._scale_in_force(unscaled)) if due else []
        self._has_norms = bool(parts)
        self._has_scale = self.grad_scaler is not None and self.grad_scaler.is_enabled()
        if self._has_scale:
            parts.append(self._scale_tensor().to(self._device, torch.float64).reshape(1))
        self._grad = torch.cat(parts) if parts else None

    def _read_grads(self, scale: torch.Tensor | None) -> list[torch.Tensor]:
        """Squared norm per group, and on every ``stats_every``-th reading the exactly-zero and
        non-finite element counts per group; empty when no parameter has a gradient."""
        present = [(p.grad, i) for p, i in zip(self._params, self._gids, strict=True)
                   if p.grad is not None]
        if not present:
            return []
        self._since_read_s = 0.0
        grads = [g for g, _ in present]
        if len(present) == len(self._params):
            index = self._full_index
        else:
            index = torch.tensor([i for _, i in present], device=self._device)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        param_sq = torch.stack([n.to(self._device) for n in norms]).double().square()
        n_groups = len(self.groups)
        group_sq = torch.zeros(n_groups, dtype=torch.float64, device=self._device)
        group_sq.index_add_(0, index, param_sq)
        if scale is not None:
            group_sq = group_sq / scale.to(self._device, torch.float64).square()
        parts = [group_sq]
        if self._grads_read % self.stats_every == 0:
            numel = [0] * n_groups
            for g, i in present:
                numel[i] += g.numel()
            zeros = torch.tensor(numel, dtype=torch.float64, device=self._device)
            nonzero = torch.stack([torch.count_nonzero(g).to(self._device) for g in grads])
            zeros.index_add_(0, index, nonzero.double(), alpha=-1)
            nonfinite = torch.zeros(n_groups, dtype=torch.float64, device=self._device)
            nonfinite.index_add_(0, index, _nonfinite_counts(grads, param_sq))
            parts += [zeros, nonfinite]
            self._numel = tuple(numel)
        self._grads_read += 1
        return parts

    def flush(self) -> None:
        """Records every queued step into the meter, waiting for GPU copies still under way."""
        self._drain(wait=True)

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last published values as a plain dict, for in-job readers (policies, tuner);
        reading it publishes the queued steps whose values are on the host.

        Keys: ``step``, ``config_version``, ``loss``, ``grad_norm``, ``grad_scaler_scale`` and
        ``groups`` = {group: {"norm", and on stats steps "zero_fraction", "nonfinite"}}.
        Values missing from the last step are absent.
        """
        self._drain(wait=False)
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._last.items()}

    # ---- internals -------------------------------------------------------------------------

    def _scale_tensor(self) -> torch.Tensor:
        scaler = self.grad_scaler
        assert scaler is not None
        # GradScaler keeps its scale as a device tensor; reading it avoids get_scale()'s sync.
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            return scale.detach().clone()
        return torch.tensor(float(scaler.get_scale()))

    def _scale_in_force(self, unscaled: bool | None) -> torch.Tensor | None:
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        if unscaled is None:
            try:
                from torch.amp.grad_scaler import OptState

                state = scaler._per_optimizer_states[id(self.optimizer)]["stage"]
                unscaled = state is OptState.UNSCALED
            except (AttributeError, ImportError, KeyError, TypeError):
                log.warning("cannot tell whether unscale_ ran; pass unscaled= to after_backward")
                unscaled = False
        return None if unscaled else self._scale_tensor()

    def _submit(self, row: _Row) -> None:
        device_parts = [t for t in (row.loss, row.grad) if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "cuda" for t in device_parts):
            self._enqueue((row, None, None))  # CPU values are read when published
            return
        flat = torch.cat([t.reshape(-1).to(self._device, torch.float64) for t in device_parts])
        host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._enqueue((row, host, event))

    def _enqueue(self, entry: _Entry) -> None:
        self._pending.append(entry)
        if len(self._pending) > _BACKLOG_LIMIT:
            self._drain(wait=False)

    def _drain(self, *, wait: bool) -> None:
        """Publishes the queue in order, up to a step whose GPU copy is still under way (or
        through it, waiting, when ``wait``). Only this pops the queue, under the lock; the
        training thread only appends to it."""
        with self._publish_lock:
            pending = self._pending
            while pending:
                entry = pending[0]
                if isinstance(entry, _Wait):
                    self._h_wait.record(entry.seconds, self._attrs(entry.version)[0])
                    pending.popleft()
                    continue
                row, host, event = entry
                if event is not None and not event.query():
                    if not wait:
                        return
                    event.synchronize()
                pending.popleft()
                self._publish(row, None if host is None else host.tolist())

    def _count_nonfinite(self, attrs: dict[str, Any], what: str, value: float | None) -> None:
        """Adds 0 or 1 every step, so each version's series exists from its first step."""
        if value is not None:
            self._c_nonfinite.add(0 if math.isfinite(value) else 1,
                                  {**attrs, NONFINITE_WHAT_ATTR: what})

    def _publish(self, row: _Row, flat: list[float] | None) -> None:
        """Sets the gauges for one row; ``flat`` holds its tensors' values if they were copied."""
        values = iter(flat or ())

        def host(x: torch.Tensor | float | None, n: int) -> list[float] | None:
            if x is None:
                return None
            if not isinstance(x, torch.Tensor):
                return [x]
            return [next(values) for _ in range(n)] if flat is not None else x.reshape(-1).tolist()

        loss = host(row.loss, 1)
        grad = host(row.grad, row.grad.numel()) if row.grad is not None else None
        attrs, group_attrs = self._attrs(row.version)
        self._h_step.record(row.duration_s, attrs)
        if row.tokens:
            self._c_tokens.add(row.tokens, attrs)
            self._g["tokens_per_second"].set(row.tokens / row.wall_s, attrs)
        if row.samples:
            self._g["samples_per_second"].set(row.samples / row.wall_s, attrs)
        self._g["step"].set(row.step, attrs)
        self._g["learning_rate"].set(row.learning_rate, attrs)
        last: dict[str, Any] = {"step": row.step, "config_version": row.version}
        self._count_nonfinite(attrs, "loss", loss[0] if loss is not None else None)
        if loss is not None:
            self._g["loss"].set(loss[0], attrs)
            last["loss"] = loss[0]
            if math.isfinite(loss[0]):  # one NaN would end every later window's mean
                self._h_loss.record(loss[0], attrs)
        if grad is not None:
            self._publish_grad(row, grad, attrs, group_attrs, last)
        self._last = last

    def _publish_grad(self, row: _Row, grad: list[float], attrs: dict[str, Any],
                      group_attrs: list[dict[str, Any]], last: dict[str, Any]) -> None:
        n = len(self.groups)
        if row.has_norms:
            total = math.sqrt(sum(grad[:n]))
            self._count_nonfinite(attrs, "grad_norm", total)
            self._g["grad.norm"].set(total, attrs)
            last["grad_norm"] = total
            groups: dict[str, dict[str, float]] = {}
            for i, name in enumerate(self.groups):
                norm = math.sqrt(grad[i])
                self._g["grad.group_norm"].set(norm, group_attrs[i])
                groups[name] = {"norm": norm}
            if row.numel is not None:
                for i, name in enumerate(self.groups):
                    zero_fraction = grad[n + i] / row.numel[i] if row.numel[i] else 0.0
                    self._g["grad.zero_fraction"].set(zero_fraction, group_attrs[i])
                    self._g["grad.nonfinite"].set(grad[2 * n + i], group_attrs[i])
                    groups[name].update(zero_fraction=zero_fraction, nonfinite=grad[2 * n + i])
            last["groups"] = groups
        if row.has_scale:
            self._g["grad_scaler.scale"].set(grad[-1], attrs)
            last["grad_scaler_scale"] = grad[-1]


def _nonfinite_counts(grads: list[torch.Tensor], param_sq: torch.Tensor) -> torch.Tensor:
    """NaN/inf elements per gradient; only a parameter with a non-finite norm can have any."""
    if param_sq.device.type == "cpu":
        counts = torch.zeros(len(grads), dtype=torch.float64)
        for i in torch.nonzero(~torch.isfinite(param_sq)).flatten().tolist():
            counts[i] = float(torch.count_nonzero(~torch.isfinite(grads[i])))
        return counts
    # On an accelerator a host check would synchronise the stream; counting everywhere is cheap.
    return torch.stack(
        [torch.count_nonzero(~torch.isfinite(g)).to(param_sq.device) for g in grads]
    ).double()


class NullTrainingInstrumentation:
    """Same API, records nothing: the baseline of the overhead benchmark and a disabled job."""

    groups: tuple[str, ...] = ()

    @property
    def last_stats(self) -> dict[str, Any]:
        """Always empty: nothing is measured."""
        return {}

    @contextmanager
    def data_wait(self) -> Iterator[None]:
        """Runs the block untimed."""
        yield

    @contextmanager
    def step(self, *, tokens: int = 0, samples: int = 0) -> Iterator[StepCounts]:
        """Runs the block untimed; no metric is exported."""
        yield StepCounts(tokens=tokens, samples=samples)

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Drops the loss."""
        pass

    def after_backward(self, *, unscaled: bool | None = None) -> None:
        """Reads no gradients, so it costs nothing between backward and the optimizer step."""
        pass

    def flush(self) -> None:
        """Nothing waits to be exported."""
        pass


__all__ = [
    "DEFAULT_MODULE_GROUPS",
    "MODULE_GROUP_ATTR",
    "NullTrainingInstrumentation",
    "StepCounts",
    "TrainingInstrumentation",
    "assign_groups",
]
