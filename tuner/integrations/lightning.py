"""A Lightning ``Trainer`` attached to the sidecar by one callback::

    from tuner.integrations.lightning import SeedanceCallback

    trainer = lightning.Trainer(max_steps=10_000, callbacks=[
        SeedanceCallback(job="my-llm", sidecar="http://127.0.0.1:4318")])
    trainer.fit(module, loader)

It is a thin driver of ``tuner.job.Session`` (docs/lease-protocol.md, 'The training session'):
the session attaches to the ``LightningModule`` and its one optimizer at ``on_train_start``,
each optimizer step is a session step (from the ``on_train_batch_start`` of its first
micro-batch to the ``on_train_batch_end`` at which ``trainer.global_step`` moved, so a new
config takes effect at a step boundary), the gradient norms are read at
``on_before_optimizer_step`` (after AMP unscaled them, before Lightning clips them) and the
session closes at ``on_train_end`` or ``on_exception``. The precision groups and ``threads``
are the session's own.

What Lightning decides, and so what this sees:

- Tokens and samples come from each batch (``count=`` counts other batches than ``input_ids``
  or integer token tensors); the step's loss is the sum of its micro-batches' losses as
  Lightning hands them over (divided by the accumulation; their mean under manual
  optimisation).
- A new config's shadow step replays the module's last ``forward`` input, so it needs a
  ``training_step`` that calls ``self(...)``; without one, new configs run without it.
- No ``micro_batch`` knob: the data loader's batch size is fixed when Lightning builds it, so
  the micro-batch size cannot change mid-run; changing ``trainer.accumulate_grad_batches`` (which
  Lightning does re-read each batch) would change the global batch, which the knob must keep.
- A step that raises ends the run, as it would without the callback: Lightning owns the loop,
  so the session cannot skip it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning
import torch

from tuner.integrations._held_step import Count, HeldStep, count_batch
from tuner.job import ClientError, Session


class SeedanceCallback(lightning.Callback):
    """Attaches the ``LightningModule`` and its optimizer to the sidecar as job ``job``.

    ``sidecar``: the sidecar's base URL (None: a null session that only runs the loop).
    ``on_attach``: called with the ``Session`` before the first step, to declare knobs of your
    own (``session.knob``). The other options are ``tuner.job.attach``'s.
    """

    def __init__(self, *, job: str, sidecar: str | None, lease_ttl_s: float | None = None,
                 module_groups: Mapping[str, Sequence[str]] | None = None,
                 precision_groups: Mapping[str, Sequence[str]] | None = None,
                 export_interval_s: float = 1.0, count: Count = count_batch,
                 on_attach: Callable[[Session], object] | None = None) -> None:
        self.held = HeldStep(job=job, sidecar=sidecar, lease_ttl_s=lease_ttl_s,
                             module_groups=module_groups, precision_groups=precision_groups,
                             export_interval_s=export_interval_s, count=count,
                             on_attach=on_attach)
        self._step_began_at = 0  # trainer.global_step when the step held open began

    @property
    def session(self) -> Session | None:
        """The session while the Trainer fits."""
        return self.held.session

    def on_train_start(self, trainer: lightning.Trainer,
                       pl_module: lightning.LightningModule) -> None:
        """The optimizer exists now: attach the session."""
        if len(trainer.optimizers) != 1:
            raise ClientError(f"job {self.held.job}: the callback drives one optimizer, the "
                              f"module has {len(trainer.optimizers)}")
        self.held.attach(pl_module, trainer.optimizers[0])

    def on_train_batch_start(self, trainer: lightning.Trainer,
                             pl_module: lightning.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The first batch of an optimizer step begins the step; each counts."""
        if not self.held.in_step:
            self.held.begin()
            self._step_began_at = trainer.global_step
        self.held.add_batch(batch)

    def on_before_optimizer_step(self, trainer: lightning.Trainer,
                                 pl_module: lightning.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Backward is done, clipping not yet: read the norms."""
        self.held.after_backward()

    def on_train_batch_end(self, trainer: lightning.Trainer,
                           pl_module: lightning.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Keep the batch's loss; end the step once the optimizer stepped."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            # automatic optimisation hands over the loss divided by the accumulation
            self.held.add_loss(loss, share=pl_module.automatic_optimization)
        if trainer.global_step != self._step_began_at:  # the optimizer stepped
            self.held.end()

    def on_train_end(self, trainer: lightning.Trainer,
                     pl_module: lightning.LightningModule) -> None:
        """Give up the lease."""
        self.held.close()

    def on_exception(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                     exception: BaseException) -> None:
        """Give up the lease: the run ends here."""
        self.held.close()
