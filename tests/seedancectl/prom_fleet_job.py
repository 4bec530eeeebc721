"""Run as a separate process by test_prometheus_fleet: a small REAL training job (an MLP on CPU
with AdamW) attached to a sidecar over its lease, exporting OTLP to it. Each step sleeps
``step_pause_ms`` (its own live knob) inside the step, so two configs differ in throughput by a
known factor. It ends by itself after ``RUN_S`` seconds, should the test not stop it.

Usage: python prom_fleet_job.py SIDECAR_URL JOB
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from tuner.job import attach

TOKENS_PER_STEP = 64
RUN_S = 300.0


def main(sidecar: str, job: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = attach(model, optimizer, job=job, sidecar=sidecar, export_interval_s=0.5)
    pause = session.knob("step_pause_ms", 60.0, low=5.0, high=80.0,
                         description="sleep inside each step (test job)")
    data = torch.Generator().manual_seed(0)
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        x = torch.randn(8, 16, generator=data)
        with session.step(tokens=TOKENS_PER_STEP, samples=8):
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            session.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            session.record_loss(loss)
            time.sleep(float(pause.value) / 1000)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
