"""The Hugging Face ``transformers.Trainer`` attached to the sidecar by one callback::

    from tuner.integrations.hf import SeedanceCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[SeedanceCallback(job="my-llm", sidecar="http://127.0.0.1:4318")])
    trainer.train()

It is a thin driver of ``tuner.job.Session`` (docs/lease-protocol.md, 'The training session'):
the session attaches at ``on_train_begin`` (the Trainer has built its optimizer by then), each
optimizer step is a session step (``on_step_begin`` to ``on_step_end``, so a new config takes
effect at a step boundary), the gradient norms are read at ``on_pre_optimizer_step`` and the
session closes at ``on_train_end``. The precision groups and ``threads`` are the session's own.

What the Trainer decides, and so what this sees:

- Tokens, samples and the loss come from the model's forward (hooks): the ``input_ids`` of each
  micro-batch (``count=`` counts other batches) and the ``loss`` of its output. The step's loss
  is their mean, or their sum when the Trainer passed ``num_items_in_batch`` (then each is the
  micro-batch's share of the step's loss). A model that returns no loss gets the loss the
  Trainer logs (every ``logging_steps``), recorded with the step after it is logged.
- With ``max_grad_norm > 0`` (the Trainer's default, 1.0) the Trainer clips before the first
  callback that sees the gradients, so the norms are those after clipping.
- No ``micro_batch`` knob: the Trainer builds its data loader with ``per_device_train_batch_size``
  once, before training, so the micro-batch size cannot change mid-run; changing
  ``gradient_accumulation_steps`` alone (the Trainer re-reads it each step) would change the
  global batch, which the knob must keep.
- A step that raises ends the run, as it would without the callback: the Trainer owns the loop,
  so the session cannot skip it (a new config still runs a shadow step first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tuner.integrations._held_step import Count, HeldStep, count_batch
from tuner.job import ClientError, Session


class SeedanceCallback(TrainerCallback):
    """Attaches the Trainer's model and optimizer to the sidecar as job ``job``.

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
        self._hooks: list[Any] = []
        self._model_loss = False  # whether the model's forward gave a loss this run
        self._share = False  # whether the forward in progress got num_items_in_batch
        self._logged_loss: float | None = None

    @property
    def session(self) -> Session | None:
        """The session while the Trainer trains."""
        return self.held.session

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        """The optimizer exists now: attach the session and the forward hooks."""
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if not isinstance(model, nn.Module) or optimizer is None:
            raise ClientError(f"job {self.held.job}: the Trainer gave the callback no model or "
                              "optimizer at on_train_begin")
        self.held.attach(model, optimizer)
        self._hooks = [model.register_forward_pre_hook(self._batch, with_kwargs=True),
                       model.register_forward_hook(self._loss)]

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        """An optimizer step begins: the newest config takes effect."""
        self.held.begin()

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        """Backward is done (and the Trainer clipped): read the norms."""
        self.held.after_backward()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """The optimizer stepped: the step is exported."""
        if self._logged_loss is not None and not self._model_loss:
            self.held.add_loss(self._logged_loss)
        self._logged_loss = None
        self.held.end()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        """Keep the logged loss for a model whose output has none."""
        # logged after on_step_end: the loss joins the next step, the one in progress when a
        # reader sees it
        if logs is not None and isinstance(logs.get("loss"), float):
            self._logged_loss = logs["loss"]

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Give up the lease and take the hooks off."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.held.close()

    def _batch(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._share = kwargs.get("num_items_in_batch") is not None
        self.held.add_batch(kwargs if kwargs else args)

    def _loss(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if loss is not None and self.held.in_step:
            self._model_loss = True
            self.held.add_loss(loss, share=self._share)
