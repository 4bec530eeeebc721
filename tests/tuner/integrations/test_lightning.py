"""``tuner.integrations.lightning.SeedanceCallback`` in real ``lightning.Trainer`` runs of tiny
random-init Llama- and BERT-like models on CPU, against a real sidecar on loopback."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from torch.utils.data import DataLoader

from tests.tuner.integrations._harness import (
    JOB,
    JUDGED,
    TrialWatch,
    counted,
    job_series,
    needs_threads_knob,
    tuning_sidecar,
)
from tests.tuner.integrations._tiny import SEQ, Tokens, tiny_model
from tuner.integrations.lightning import SeedanceCallback

pytestmark = pytest.mark.integration

BATCH = 8


class LM(lightning.LightningModule):
    """A tiny transformers LM trained by Lightning; it keeps each batch's loss."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = tiny_model(family)
        self.losses: list[float] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch["input_ids"], batch["labels"])
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StopWhen(lightning.Callback):
    """Ends fitting once a trial was judged or ``timeout_s`` passed (a bound, not a measure)."""

    def __init__(self, watch: TrialWatch, timeout_s: float) -> None:
        self.watch, self.deadline = watch, time.monotonic() + timeout_s

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: Any) -> None:
        if self.watch.done.is_set() or time.monotonic() > self.deadline:
            trainer.should_stop = True


def fit(module: LM, callbacks: list[Any], *, steps: int, accumulation: int = 1) -> None:
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulation,
        callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(Tokens(), batch_size=BATCH, shuffle=True))


def test_a_lightning_run_is_tuned_by_trials_the_sidecar_judges(tmp_path: Path) -> None:
    with tuning_sidecar(tmp_path) as live:
        watch = TrialWatch(live)
        seedance = SeedanceCallback(job=JOB, sidecar=live.url, lease_ttl_s=10,
                                    on_attach=needs_threads_knob)
        fit(LM("llama"), [seedance, StopWhen(watch, 90)], steps=100_000)
        trials = watch.stop()
        acks = live.get(f"/v1/jobs/{JOB}/acks")
    judged = [t for t in trials if t["state"] in JUDGED]
    print([(t["values"], t["state"]) for t in trials])
    assert judged, trials
    assert all(list(t["values"]) == ["threads"] for t in trials), trials
    assert any(a["status"] == "applied" and a["version"] > 1 for a in acks), acks
    assert seedance.session is None  # closed at on_train_end


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_step_loss_tokens_and_gradient_norms_reach_the_sidecar(tmp_path: Path,
                                                               family: str) -> None:
    steps, accumulation = 10, 2
    total_tokens = steps * BATCH * SEQ * accumulation
    module = LM(family)
    with tuning_sidecar(tmp_path, tune=False) as live:
        fit(module, [SeedanceCallback(job=JOB, sidecar=live.url)], steps=steps,
            accumulation=accumulation)
        step = job_series(tmp_path, "seedance.train.step",
                          lambda f: not f.empty and f["value"].max() == steps - 1)
        loss = job_series(tmp_path, "seedance.train.loss")
        norm = job_series(tmp_path, "seedance.train.grad.norm")
        groups = job_series(tmp_path, "seedance.train.grad.group_norm")
        tokens = job_series(tmp_path, "seedance.train.tokens",
                            lambda f: counted(f) >= total_tokens)
    # one session step per optimizer step (not per batch): the last step index
    assert step["value"].max() == steps - 1
    # a step's loss is the mean of its batches' losses as training_step returned them
    means = [sum(module.losses[i:i + accumulation]) / accumulation
             for i in range(0, len(module.losses), accumulation)]
    assert len(means) == steps
    assert loss["value"].between(min(means) - 1e-4, max(means) + 1e-4).all(), (loss, means)
    assert (norm["value"] > 0).all()
    assert {"attention", "ffn"} <= set(groups["seedance.module_group"])
    assert counted(tokens) == total_tokens
