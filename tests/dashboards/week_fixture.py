"""A recorded week for report tests: a real demo run, REPLAYED with its times shifted.

Source: ``tests/data/demo_run/metrics.db``, the store of one real ``seedancectl demo --minutes
0.5`` run (sidecar + small GPT training on CPU + the replayed H100 NVML trace). Its steady part
(exports 8-29) is replayed, cycling, as a job that holds a real lease in a real
``JobRegistry``: points go into a real ``TimeSeriesStore`` at times SHIFTED into ISO week
2026-W47 (a 30-minute run each day), every point labelled ``seedance.replayed=true`` so the
report's footer says "times shifted".

SIMULATED on top of the recording, so that every report section has something to show: the
effect of a config is a factor on the recorded step times (``EFFECT``; tokens/s divided by it),
and ``precision.ffn=bf16`` makes the loss NaN. Each interval's steps are put in the histogram
bucket of their mean step time (the recording has no per-step times). Changes go through the
real ``RolloutController`` (proposed, approved by a person, kept, rolled back by a measured
regression, by the NaN-loss guardrail and by an operator, rejected, auto-approved, left
pending); findings through the real ``FindingStore``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from collectors._points import CONFIG_VERSION_ATTR, REPLAYED_ATTR, Point
from collectors._store import TimeSeriesStore
from policies import Evidence, Finding, FindingStore, Measurement, sqlite_url
from tuner._guardrails import NonFiniteValues
from tuner._knobs import Knob
from tuner._lease import JobRegistry
from tuner._rollout import RolloutController
from tuner._verdict import RolloutConfig
from tuner._windows import MeasureConfig

RECORDING = Path(__file__).resolve().parents[1] / "data" / "demo_run" / "metrics.db"
JOB = "demo-train"
WEEK = (2026, 47)
NS = 1_000_000_000
STEADY = slice(8, None)
"""The recorded exports replayed: after the run's own warm-up (loss below 2.6)."""
RUN_EXPORTS = 1800
"""Exports per daily run (one a second: 30 minutes)."""
KNOBS = (
    Knob(name="micro_batch", default=8, choices=(1, 2, 4, 8)),
    Knob(name="prefetch", default=2, low=1, high=8, integer=True),
    Knob(name="precision", default="fp32", choices=("fp32", "bf16"), risk="high"),
    Knob(name="precision.ffn", default="fp32", choices=("fp32", "bf16"), risk="high"),
    Knob(name="threads", default=2, low=1, high=4, integer=True, scope="restart"),
)
EFFECT: Mapping[tuple[str, Any], float] = {
    ("micro_batch", 4): 0.8, ("micro_batch", 2): 1.1, ("prefetch", 6): 1.3,
    ("prefetch", 3): 0.75,
}
"""SIMULATED: step-time factor of a knob value (below 1 = faster)."""
MEASURE = MeasureConfig(warmup_steps=2, min_steps=4, min_window_s=0.5)
CONFIG = RolloutConfig(min_pairs=3, max_pairs=8, trial_budget_s=3600.0,
                       proposal_ttl_s=2 * 86_400.0, measure=MEASURE)


def week_start_ns() -> int:
    return int(datetime.fromisocalendar(*WEEK, 1).replace(tzinfo=UTC).timestamp()) * NS


@dataclass(frozen=True, kw_only=True)
class RecordedWeek:
    store_path: Path
    state_url: str
    since_ns: int
    until_ns: int
    job: str
    week: str


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now = now_s

    def __call__(self) -> float:
        return self.now


class Recording:
    """The demo run's steady exports as per-interval deltas and gauge values."""

    def __init__(self, path: Path) -> None:
        with TimeSeriesStore(path, readonly=True) as store:
            def values(name: str, **where: str) -> np.ndarray:
                frame = store.query(name, where={"service.name": JOB, **where},
                                    resolution="raw") if not name.startswith("hw.") else \
                    store.query(name, resolution="raw")
                return frame["value"].to_numpy(dtype=np.float64)

            count = values("seedance.train.step.duration.count")
            total = values("seedance.train.step.duration.sum")
            self.steps = np.diff(count)[STEADY]
            self.step_s = np.diff(total)[STEADY]
            self.tokens_per_s = values("seedance.train.tokens_per_second")[1:][STEADY]
            self.loss = values("seedance.train.loss")[1:][STEADY]
            self.grad_norm = values("seedance.train.grad.norm")[1:][STEADY]
            self.gpu_util = values("hw.gpu.utilization")
            self.mem_util = values("hw.gpu.memory.utilization")
            buckets = store.query("seedance.train.step.duration.bucket", resolution="raw")
            self.bounds = sorted({float(b) for b in buckets["le"]})
        self.n = len(self.steps)


class ReplayJob:
    """REPLAYED job: holds a real lease, acks each config, writes recorded exports (shifted)."""

    def __init__(self, registry: JobRegistry, store: TimeSeriesStore, rec: Recording,
                 clock: Clock) -> None:
        self.registry, self.store, self.rec, self.clock = registry, store, rec, clock
        self.session, self.config = registry.attach(JOB, knobs=KNOBS, baseline={})
        self.cursor = 0
        self.step = 0
        self.cumulative: dict[int, np.ndarray] = {}  # version -> count, sum, buckets...

    def run(self, exports: int) -> None:
        lease = self.registry.lease(JOB, self.session, -1, 0.0)
        self.config = lease.config
        version = self.config.version
        self.registry.ack(JOB, self.session, version=version, step=self.step,
                          status="applied",
                          actions=[{**a, "status": "done"} for a in lease.actions])
        values = self.config.values
        factor = math.prod(EFFECT.get((k, v), 1.0) for k, v in values.items())
        nan_loss = values.get("precision.ffn") == "bf16"
        rec, bounds = self.rec, self.rec.bounds
        attrs = {"service.name": JOB, "host.name": "vm", "seedance.rank": "0",
                 CONFIG_VERSION_ATTR: str(version), REPLAYED_ATTR: "true"}
        gpu = {"host.name": "vm", "gpu.index": "0", REPLAYED_ATTR: "true"}
        cum = self.cumulative.setdefault(version, np.zeros(2 + len(bounds)))
        points: list[Point] = []
        for _ in range(exports):
            i = self.cursor % rec.n
            self.cursor += 1
            self.clock.now += 1.0
            t = int(self.clock.now * NS)
            steps, step_s = rec.steps[i], rec.step_s[i] * factor
            self.step += int(steps)
            cum[0] += steps
            cum[1] += step_s
            mean_step_s = step_s / steps if steps else 0.0
            cum[2:] += steps * (np.array(bounds) >= mean_step_s)
            points += [
                Point("seedance.train.step.duration.count", cum[0], t, attrs),
                Point("seedance.train.step.duration.sum", cum[1], t, attrs),
                Point("seedance.train.tokens_per_second", rec.tokens_per_s[i] / factor, t,
                      attrs),
                Point("seedance.train.loss", math.nan if nan_loss else rec.loss[i], t, attrs),
                Point("seedance.train.grad.norm", rec.grad_norm[i], t, attrs),
                Point("seedance.train.step", float(self.step), t, attrs),
                Point("hw.gpu.utilization", rec.gpu_util[i % len(rec.gpu_util)], t, gpu),
                Point("hw.gpu.memory.utilization", rec.mem_util[i % len(rec.mem_util)], t, gpu),
            ]
            points += [Point("seedance.train.step.duration.bucket", cum[2 + j], t,
                             {**attrs, "le": "+Inf" if math.isinf(b) else f"{b:g}"})
                       for j, b in enumerate(bounds)]
        self.store.write(points)
        self.store.flush()


def _drive(ctl: RolloutController, job: ReplayJob, change_id: str, window: int) -> str:
    for k in range(60):
        ctl.tick()
        state = ctl.get(change_id).state
        if state not in ("approved", "applying", "observing"):
            return state
        job.run(window + (k * 7) % 11 - 5)  # unequal windows: each sees other recorded noise
    raise AssertionError(f"change {change_id} still {ctl.get(change_id).state}")


def _finding(detector: str, severity: str, summary: str, value: float, opened_ns: int,
             closed_ns: int | None, fid: str) -> Finding:
    return Finding(detector=detector, job=JOB, severity=severity,  # type: ignore[arg-type]
                   evidence=Evidence(summary=summary, model="fixture (replayed week)",
                                     measurements=(Measurement(name="value", value=value),)),
                   resource={"gpu": "0"}, id=fid, opened_at_ns=opened_ns,
                   closed_at_ns=closed_ns)


def build_week(out: Path) -> RecordedWeek:
    """Build the recorded week under ``out`` (store + state database); see the module doc."""
    out.mkdir(parents=True, exist_ok=True)
    since = week_start_ns()
    day_s = 86_400.0
    start_s = since / NS
    clock = Clock(start_s + 9 * 3600)
    state_url = sqlite_url(out / "state.db")
    store = TimeSeriesStore(out / "metrics.db", raw_retention_s=None,
                            rollup_1m_retention_s=None, rollup_1h_retention_s=None)
    registry = JobRegistry(lease_ttl_s=30 * day_s, clock=clock)
    ctl = RolloutController(registry, store, db_url=state_url, clock=clock,
                            guardrails=[NonFiniteValues()], config=CONFIG)
    findings = FindingStore(state_url)
    rec = Recording(RECORDING)
    job = ReplayJob(registry, store, rec, clock)
    window = rec.n

    def day(d: int, hour: float) -> None:
        clock.now = max(clock.now, start_s + d * day_s + hour * 3600)

    def run_rest(d: int) -> None:
        job.run(max(0, RUN_EXPORTS - int(clock.now - (start_s + d * day_s + 9 * 3600))))

    # A finding open since before the week, closed on Monday.
    findings.save(_finding("input_bound", "warning", "data wait is 30% of step time", 0.3,
                           since - 2 * 86_400 * NS, since + 10 * 3600 * NS, "f-input"))
    # Monday: a person approves a faster micro-batch after 90 minutes; it is kept.
    job.run(300)
    a = ctl.propose(JOB, {"micro_batch": 4}, reason="trial 1", source="trial")
    clock.now += 90 * 60
    ctl.approve(a.id, "alice", "looks safe")
    _drive(ctl, job, a.id, window)
    run_rest(0)
    # Tuesday: a slower prefetch, approved after 45 minutes, rolled back (regression).
    day(1, 9)
    job.run(300)
    findings.save(_finding("bandwidth_saturation", "critical", "PCIe receive at 91% of peak",
                           0.91, int(clock.now * NS), None, "f-pcie"))
    b = ctl.propose(JOB, {"prefetch": 6}, reason="finding f-pcie", source="finding")
    clock.now += 45 * 60
    ctl.approve(b.id, "bob")
    _drive(ctl, job, b.id, window)
    run_rest(1)
    # Wednesday: a risky precision change, rejected after 5 hours.
    day(2, 9)
    job.run(600)
    c = ctl.propose(JOB, {"precision": "bf16"}, reason="trial 2", source="trial")
    clock.now += 5 * 3600
    ctl.reject(c.id, "carol", "no bf16 before the release")
    # Thursday: bf16 on the FFN turns the loss NaN: the guardrail rolls it back.
    day(3, 9)
    job.run(300)
    d = ctl.propose(JOB, {"precision.ffn": "bf16"}, reason="trial 3", source="trial")
    clock.now += 20 * 60
    ctl.approve(d.id, "alice")
    _drive(ctl, job, d.id, window)
    run_rest(3)
    findings.save(_finding("gradient_underflow", "info", "3% of FFN gradients are zero", 0.03,
                           int((start_s + 3 * day_s + 12 * 3600) * NS),
                           int((start_s + 3 * day_s + 15 * 3600) * NS), "f-underflow"))
    # Friday: auto mode approves a faster prefetch; it is kept.
    day(4, 9)
    ctl.set_mode(JOB, "auto", by="alice", reason="trust low-risk live knobs")
    job.run(300)
    e = ctl.propose(JOB, {"prefetch": 3}, reason="trial 4", source="trial")
    _drive(ctl, job, e.id, window)
    run_rest(4)
    # Saturday: an operator rolls Friday's change back.
    day(5, 9)
    job.run(900)
    ctl.rollback(JOB, "dave", "suspected data-loader stalls after prefetch 3")
    run_rest(5)
    # Sunday: one change waits for a person; a restart change is approved, not yet applied.
    day(6, 9)
    ctl.set_mode(JOB, "suggest", by="alice")
    job.run(RUN_EXPORTS)
    ctl.propose(JOB, {"micro_batch": 2}, reason="trial 5", source="trial")
    g = ctl.propose(JOB, {"threads": 1}, reason="operator idea", source="operator", by="erin")
    clock.now += 10 * 60
    ctl.approve(g.id, "erin", "at the next restart")
    ctl.close()
    findings.close()
    store.close()
    iso = f"{WEEK[0]}-W{WEEK[1]:02d}"
    return RecordedWeek(store_path=out / "metrics.db", state_url=state_url, since_ns=since,
                        until_ns=since + 7 * 86_400 * NS, job=JOB, week=iso)
