"""``tuner.integrations.hf.SeedanceCallback`` in real ``transformers.Trainer`` runs of tiny
random-init GPT-2-, Llama- and BERT-like models on CPU, against a real sidecar on loopback."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

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
from tuner.integrations.hf import SeedanceCallback

pytestmark = pytest.mark.integration

BATCH = 8


class StopWhen(TrainerCallback):
    """Ends training once ``done`` is set or ``timeout_s`` passed (a bound, not a measure)."""

    def __init__(self, watch: TrialWatch | None, timeout_s: float) -> None:
        self.watch, self.deadline = watch, time.monotonic() + timeout_s

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if (self.watch is not None and self.watch.done.is_set()) \
                or time.monotonic() > self.deadline:
            control.should_training_stop = True


def trainer(tmp_path: Path, family: str, callbacks: list[Any], *, steps: int,
            accumulation: int = 1, logging_steps: int = 5) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=steps,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3,
        logging_steps=logging_steps,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0)
    return Trainer(model=tiny_model(family), args=args, train_dataset=Tokens(),
                   callbacks=callbacks)


def test_a_trainer_run_is_tuned_by_trials_the_sidecar_judges(tmp_path: Path) -> None:
    with tuning_sidecar(tmp_path) as live:
        watch = TrialWatch(live)
        seedance = SeedanceCallback(job=JOB, sidecar=live.url, lease_ttl_s=10,
                                    on_attach=needs_threads_knob)
        trainer(tmp_path, "gpt2", [seedance, StopWhen(watch, 90)], steps=100_000).train()
        trials = watch.stop()
        acks = live.get(f"/v1/jobs/{JOB}/acks")
    judged = [t for t in trials if t["state"] in JUDGED]
    print([(t["values"], t["state"]) for t in trials])
    assert judged, trials
    assert all(list(t["values"]) == ["threads"] for t in trials), trials
    # the job put each trial's configs in force at step boundaries and acked them
    assert any(a["status"] == "applied" and a["version"] > 1 for a in acks), acks
    assert seedance.session is None  # closed at on_train_end


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_step_loss_tokens_and_gradient_norms_reach_the_sidecar(tmp_path: Path,
                                                               family: str) -> None:
    steps, accumulation = 12, 2
    total_tokens = steps * BATCH * SEQ * accumulation
    with tuning_sidecar(tmp_path, tune=False) as live:
        seedance = SeedanceCallback(job=JOB, sidecar=live.url)
        run = trainer(tmp_path, family, [seedance], steps=steps, accumulation=accumulation,
                      logging_steps=1)
        run.train()
        knobs = live.get(f"/v1/jobs/{JOB}/knobs")
        step = job_series(tmp_path, "seedance.train.step",
                          lambda f: not f.empty and f["value"].max() == steps - 1)
        loss = job_series(tmp_path, "seedance.train.loss")
        norm = job_series(tmp_path, "seedance.train.grad.norm")
        groups = job_series(tmp_path, "seedance.train.grad.group_norm")
        tokens = job_series(tmp_path, "seedance.train.tokens",
                            lambda f: counted(f) >= total_tokens)
    # one session step per optimizer step (not per micro-batch): the last step index
    assert step["value"].max() == steps - 1
    # the loss the Trainer itself logs for each step (its micro-batches' losses combined as it
    # combines them); the gauge is read once per export, so it is some of those steps'
    logged = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
    assert len(logged) == steps
    assert loss["value"].between(min(logged) - 1e-3, max(logged) + 1e-3).all(), (loss, logged)
    assert (norm["value"] > 0).all()
    assert {"attention", "ffn"} <= set(groups["seedance.module_group"])
    # every micro-batch's tokens count, each step: BATCH x SEQ x accumulation
    assert counted(tokens) == total_tokens
    assert any(k["name"].startswith("precision.") for k in knobs["knobs"]), knobs
