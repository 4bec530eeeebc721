"""What a live tuning session runs: the demo job's settings and its sidecar's configuration.

``SessionConfig`` writes the sidecar's TOML file and the training job's command line for
``seedancectl._session.TrainingSession``; it starts nothing itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors import SeedanceError


class TuningSessionError(SeedanceError):
    """The tuning session could not reach the state it waited for."""


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """One session: the demo job's own settings and a sidecar on its DEFAULT tuning settings.

    The sidecar's configuration file says where it listens and keeps its files, the approval
    ``mode`` and ``tune``, nothing else: the measurement, the knobs searched and their bounds
    are the sidecar's defaults, as a new user would have them. A test that drills a failure
    may add top-level sidecar settings (``sidecar_settings``, e.g. a short ``lease_ttl_s``) or
    rollout settings (``rollout_settings``); the demo adds none.

    No change starts before the job trained ``warm_steps`` steps (the search is paused until
    then). ``loss_scale`` / ``loss_scale_growth_interval`` (with ``grad_scaler``) give the job a
    GradScaler whose scale has backed off and may not grow: the incident set-up."""

    out: Path
    job: str = "demo-train"
    tune: bool = True
    mode: str = "auto"
    trials: int = 8
    global_batch: int = 8
    micro_batch: int = 8
    seq_len: int = 32
    threads: int = 1
    warm_steps: int = 30
    lease_ttl_s: float | None = None
    sidecar_settings: Mapping[str, Any] = field(default_factory=dict)
    rollout_settings: Mapping[str, Any] = field(default_factory=dict)
    grad_scaler: bool = False
    loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "suggest", "off"):
            raise TuningSessionError(f"SessionConfig.mode must be auto, suggest or off, "
                               f"got {self.mode!r}")
        for name in ("trials", "global_batch", "micro_batch", "seq_len", "threads"):
            if getattr(self, name) < 1:
                raise TuningSessionError(f"SessionConfig.{name} must be >= 1")
        if self.global_batch % self.micro_batch:
            raise TuningSessionError("SessionConfig.global_batch must be a multiple of micro_batch")
        for name in ("start_timeout_s", "loss_scale"):
            if not getattr(self, name) > 0:
                raise TuningSessionError(f"SessionConfig.{name} must be > 0")
        if self.lease_ttl_s is not None and not self.lease_ttl_s > 0:
            raise TuningSessionError("SessionConfig.lease_ttl_s must be > 0")

    @property
    def study(self) -> str:
        """The Optuna study the sidecar runs the search in (the sidecar's default name)."""
        return f"seedance:{self.job}"

    def sidecar_toml(self, *, listen: str, token_file: Path) -> str:
        """The sidecar's configuration file for this session."""
        settings: dict[str, Any] = {
            "job": self.job + "-sidecar", "listen": listen,
            "store": str(self.out / "metrics.db"),
            "state_db": "sqlite:///" + str(self.out / "state.db"),
            "nvml": "off", "token_file": str(token_file), **self.sidecar_settings}
        lines = [f"{k} = {_toml(v)}" for k, v in settings.items()]
        lines += ["", "[approval]", f"mode = {_toml(self.mode)}"]
        if self.rollout_settings:
            lines += ["", "[rollout]", *(f"{k} = {_toml(v)}"
                                          for k, v in self.rollout_settings.items())]
        lines += ["", f"[jobs.{_toml(self.job)}]", f"tune = {_toml(self.tune)}",
                  f"mode = {_toml(self.mode)}"]
        return "\n".join(lines) + "\n"

    def train_args(self, url: str) -> list[str]:
        """``workloads.train`` arguments: trains until stopped, holding a lease at ``url``."""
        args = ["-m", "workloads.train", "--sidecar", url, "--job", self.job,
                "--seconds", "86400", "--global-batch", str(self.global_batch),
                "--micro-batch", str(self.micro_batch), "--seq-len", str(self.seq_len),
                "--threads", str(self.threads), "--seed", "0"]
        if self.lease_ttl_s is not None:
            args += ["--lease-ttl-s", str(self.lease_ttl_s)]
        if self.grad_scaler:
            args += ["--grad-scaler", "--loss-scale", repr(self.loss_scale),
                     "--loss-scale-growth-interval", str(self.loss_scale_growth_interval)]
        return args


def _toml(value: Any) -> str:
    """A TOML value for a string, number or bool (JSON writes these the way TOML reads)."""
    return json.dumps(value if isinstance(value, bool | int | float) else str(value))


__all__ = ["SessionConfig", "TuningSessionError"]
