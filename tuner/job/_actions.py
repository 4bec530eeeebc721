"""A config's one-shot actions in a training job: snapshot, full or local rollback.

They run at the boundary before the config's knobs, through ``tuner.checkpoint``; each is
reported back with the ack (``done`` or ``failed`` with the error), and a failed one never
stops the job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tuner.checkpoint import Checkpointer, Snapshot
from tuner.job._errors import ClientError

log = logging.getLogger(__name__)


class ActionRunner:
    """Runs one job's actions; snapshots are kept by the change that asked for them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, job: str,
                 precision_groups: Mapping[str, tuple[str, ...]],
                 snapshot_max_bytes: int | None) -> None:
        self._model = model
        self._optimizer = optimizer
        self._job = job
        self._precision_groups = precision_groups
        self._snapshot_max_bytes = snapshot_max_bytes
        self._checkpointer: Checkpointer | None = None
        self._snapshots: dict[str, Snapshot] = {}

    def run(self, action: Mapping[str, Any]) -> dict[str, Any]:
        """``action`` with its ``status`` and ``error``, as the ack reports it."""
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
            log.warning("job %s: action %s failed: %s", self._job, dict(action), result["error"])
        return result

    def _local_rollback(self, snapshot: Snapshot, group: str) -> None:
        """Weights and optimizer state of one group; its precision is the config's to set."""
        if group not in self._precision_groups:
            raise ClientError(f"unknown module group {group!r}; groups: "
                              f"{sorted(self._precision_groups)}")
        self._checkpoint().local_rollback(snapshot, list(self._precision_groups[group]))

    def _checkpoint(self) -> Checkpointer:
        if self._checkpointer is None:
            max_bytes = (self._snapshot_max_bytes
                         or 2 * _state_bytes(self._model, self._optimizer))
            self._checkpointer = Checkpointer(self._model, self._optimizer, max_bytes=max_bytes)
        return self._checkpointer


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, buffers and optimizer state now, with Adam-like state assumed if none yet."""
    tensors = [*model.parameters(), *model.buffers()]
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    own = sum(t.numel() * t.element_size() for t in tensors)
    held = sum(t.numel() * t.element_size() for t in state)
    return own + (held or 2 * own) + 1024
