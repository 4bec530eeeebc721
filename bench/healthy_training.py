"""A healthy demo training run judged by every training detector: how long, and what is found.

``python bench/healthy_training.py --steps 1000`` trains the demo GPT (workloads.train defaults)
with the real instrumentation exporting every step into a real store, then evaluates the
training detectors over sliding windows of ``--window-steps`` steps every ``--every`` steps.
Writes bench/results/healthy_training.json: wall time, ms per step, findings (should be none).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench._targets import Target, at_least, holds, judged
from collectors._otel import TelemetryConfig, setup_telemetry
from collectors._store import TimeSeriesStore
from collectors.torch_training import TrainingInstrumentation
from policies import StoreWindow
from policies.detectors import (
    GradientCollapseDetector,
    GradientUnderflowDetector,
    InputBoundDetector,
    NonFiniteDetector,
    SmallBatchPrecisionDetector,
)
from workloads.train import TrainConfig, Trainer

JOB = "healthy-demo"
TARGET_STEPS = 1000


def targets(result: dict) -> list[Target]:
    """Issue #3: the demo training job runs 1,000 healthy steps with no finding of any kind."""
    return [at_least("healthy steps run", TARGET_STEPS, result["steps"], "issue #3"),
            holds("findings on the healthy run", "none", len(result["findings"]),
                  not result["findings"], "issue #3")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=TARGET_STEPS)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--window-steps", type=int, default=100)
    p.add_argument("--every", type=int, default=50)
    a = p.parse_args()
    trainer = Trainer(TrainConfig(steps=a.steps, threads=a.threads))
    detectors = [GradientCollapseDetector(), GradientUnderflowDetector(), NonFiniteDetector(),
                 SmallBatchPrecisionDetector(), InputBoundDetector()]
    with tempfile.TemporaryDirectory() as tmp, \
            TimeSeriesStore(Path(tmp) / "ts.db", raw_retention_s=None) as store, \
            setup_telemetry(TelemetryConfig(job=JOB, export_interval_s=3600.0),
                            store_sink=lambda d: store.write(d.points)) as telemetry:
        instr = TrainingInstrumentation(trainer.model, trainer.optimizer,
                                        telemetry.meter("bench"), grad_scaler=trainer.scaler)
        start = time.perf_counter()
        times, losses = [], []
        for _ in range(a.steps):
            losses.append(float(trainer.step(instr)))
            telemetry.force_flush()
            times.append(time.time_ns())
        train_s = time.perf_counter() - start
        store.flush()
        findings = []
        for end in range(a.window_steps, a.steps + 1, a.every):
            window = StoreWindow(store, job=JOB, since_ns=times[end - a.window_steps],
                                 until_ns=times[end - 1])
            findings += [f.to_dict() for d in detectors for f in d.evaluate(window)]
    result = {"steps": a.steps, "train_s": train_s, "ms_per_step": train_s / a.steps * 1e3,
              "first_loss": losses[0], "last_loss": losses[-1], "findings": findings}
    result = judged(result, targets(result))
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/healthy_training.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "findings"}),
          f"findings: {len(findings)}")


if __name__ == "__main__":
    main()
