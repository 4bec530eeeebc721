"""A ``tuner.job.Session`` driven by a framework's callbacks instead of a hand-written loop.

A framework begins an optimizer step in one callback and ends it in another, and it fetches
the step's batches in between, so the session's step is held open across callbacks and its
token and sample counts grow as the batches come (``collectors.torch_training.StepCounts``).
Both integrations share this: ``tuner.integrations.hf`` and ``tuner.integrations.lightning``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tuner.job import ClientError, Session, attach

Count = Callable[[Any], tuple[int, int]]
"""(tokens, samples) of one micro-batch as the framework hands it over."""


def count_batch(batch: Any) -> tuple[int, int]:
    """(tokens, samples) of a batch: its ``input_ids`` (a mapping), else its first integer tensor
    with a sequence dimension; samples are that tensor's first dimension. A batch of floats
    (images, say) counts samples only, from its first tensor."""
    tensors: Sequence[Any]
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        tensors = [ids] if isinstance(ids, torch.Tensor) else list(batch.values())
    elif isinstance(batch, torch.Tensor):
        tensors = [batch]
    elif isinstance(batch, Sequence):
        tensors = batch
    else:
        return 0, 0
    found = [t for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0]
    ids = next((t for t in found if t.dim() >= 2 and not t.is_floating_point()), None)
    if ids is not None:
        return ids.numel(), ids.shape[0]
    return 0, (found[0].shape[0] if found else 0)


class HeldStep:
    """The attach options of one job, its ``Session`` once attached, and the step held open."""

    def __init__(self, *, job: str, sidecar: str | None, lease_ttl_s: float | None = None,
                 module_groups: Mapping[str, Sequence[str]] | None = None,
                 precision_groups: Mapping[str, Sequence[str]] | None = None,
                 export_interval_s: float = 1.0, count: Count = count_batch,
                 on_attach: Callable[[Session], object] | None = None) -> None:
        self.job, self.sidecar = job, sidecar
        self._options: dict[str, Any] = {
            "lease_ttl_s": lease_ttl_s, "module_groups": module_groups,
            "precision_groups": precision_groups, "export_interval_s": export_interval_s}
        self._count = count
        self._on_attach = on_attach
        self.session: Session | None = None
        """Set when training begins (the optimizer exists then); None after it ends."""
        self._step: contextlib.ExitStack | None = None
        self._counts: Any = None  # the StepCounts of the step held open
        self._losses: list[torch.Tensor | float] = []
        self._shares = False  # whether the losses are shares of the step's loss, to be summed

    @property
    def in_step(self) -> bool:
        return self._counts is not None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Session:
        """The session for ``model`` and ``optimizer``; ``on_attach`` may declare knobs."""
        if self.session is not None:
            raise ClientError(f"job {self.job}: the callback is already attached to a run")
        self.session = attach(model, optimizer, job=self.job, sidecar=self.sidecar,
                              **self._options)
        if self._on_attach is not None:
            self._on_attach(self.session)
        return self.session

    def begin(self) -> None:
        """An optimizer step begins: the newest config takes effect (``Session.step``)."""
        if self.session is None or self.in_step:
            return
        stack = contextlib.ExitStack()
        counts = stack.enter_context(self.session.step())
        self._step, self._counts, self._losses, self._shares = stack, counts, [], False

    def add_batch(self, batch: Any) -> None:
        """A micro-batch of the step in progress."""
        if self._counts is not None:
            tokens, samples = self._count(batch)
            self._counts.tokens += tokens
            self._counts.samples += samples

    def add_loss(self, loss: torch.Tensor | float, *, share: bool = False) -> None:
        """One micro-batch's loss: the step records their mean, or their sum when each is its
        ``share`` of the step's loss (a framework divided it by the accumulation already)."""
        if self._counts is not None:
            self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)
            self._shares = share

    def after_backward(self) -> None:
        """The step's gradients are complete: read their norms."""
        if self.session is not None and self.in_step:
            self.session.after_backward()

    def end(self) -> None:
        """The optimizer stepped: record the loss and let the session export the step."""
        if self.session is None or self._step is None:
            return
        if len(self._losses) == 1:
            self.session.record_loss(self._losses[0])
        elif self._losses:
            losses = torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in self._losses])
            self.session.record_loss(losses.sum() if self._shares else losses.mean())
        step, self._step, self._counts, self._losses = self._step, None, None, []
        step.close()

    def close(self) -> None:
        """Training ended: drop a step left open, give up the lease, flush (idempotent)."""
        self._step, self._counts, self._losses = None, None, []
        if self.session is not None:
            self.session.close()
            self.session = None
