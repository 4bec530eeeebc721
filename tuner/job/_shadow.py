"""The shadow step: a new config tried on the last batch the model saw, with nothing kept.

A config not run before in this process is first tried on the last batch the model saw (its
root forward's arguments, kept by reference through a forward pre-hook): one forward and one
backward of the sum of the floating outputs (in fp32), no optimizer step. Everything it touches
is put back: every ``.grad`` (``None`` included), the buffers (BatchNorm running statistics and
``num_batches_tracked``) and the CPU and CUDA RNG states. The cost is one forward and backward
per new config. Before the first forward there is no batch, so no shadow step. The model's
other state (a counter of its own, say) is not restored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

Batch = tuple[tuple[Any, ...], dict[str, Any]]
"""A root forward's positional and keyword arguments."""


class ShadowStep:
    """Keeps the root forward's input and replays one batch without a trace.

    ``replay`` is what the batch runs through: the model, or the ``nn.DataParallel`` wrapping
    it (its replicas share the model's hooks and see one chunk each, on their own device, so the
    whole batch is recorded and replayed through the wrapper). ``record=False`` (a null
    session) installs no hooks, so there is never a batch to replay.
    """

    def __init__(self, model: nn.Module, replay: nn.Module, *, record: bool) -> None:
        self._model = model
        self._replay = replay
        self.started_batch: Batch | None = None
        """The root forward's last input."""
        self.last_batch: Batch | None = None
        """The last input its forward got through."""
        self._shadowing = False
        self._hooks = [] if not record else [
            replay.register_forward_pre_hook(self._start_batch, with_kwargs=True, prepend=True),
            replay.register_forward_hook(self._end_batch)]

    def run(self, batch: Batch) -> None:
        """Forward and backward of ``batch`` under the config in force, no optimizer step;
        raises what the model raises, and puts back the gradients, buffers and RNG states."""
        args, kwargs = batch
        params = list(self._model.parameters())
        grads = [p.grad for p in params]
        buffers = [(b, b.clone()) for b in self._model.buffers()]
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

    def close(self) -> None:
        """Remove the hooks and drop the batches (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.started_batch = self.last_batch = None

    def _start_batch(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the root model: keep its input (references, detached)."""
        if not self._shadowing:
            self.started_batch = (_detached(args), _detached(kwargs))

    def _end_batch(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of the root model (not called when the forward raises): a new config's
        shadow step replays a batch that got through, never one that broke the job's code."""
        if not self._shadowing:
            self.last_batch = self.started_batch


def _detached(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, tree)


def _float_sum(output: Any) -> torch.Tensor:
    """One fp32 scalar from every floating tensor of a model's output (a loss, logits, a dict)."""
    sums = [t.float().sum() for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(sums[1:], sums[0]) if sums else torch.zeros(())
