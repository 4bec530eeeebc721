"""Live tuning end to end with real parts: the sidecar process (``seedancectl sidecar``) tunes
the real demo GPT (``workloads.train --sidecar``) on CPU; the verdicts are the rollout
controller's own interleaved A/B comparisons, read over the operator API.

Nothing is simulated. Bounds on waiting are generous (the box is a shared 2-core CPU); no test
asserts how long something took in absolute terms except the lease protocol's own promise
(back to the baseline within the lease TTL plus the step in progress).
"""

from __future__ import annotations

import json
import math
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from collectors._store import TimeSeriesStore
from collectors.torch_profile import dtype_speedups
from seedancectl._api_types import AckJSON, ChangeDetailJSON, ChangeJSON, FindingJSON
from seedancectl._session import SEARCH_DONE, TrainingSession, run_training_session
from seedancectl._session_config import SessionConfig
from seedancectl._session_result import Trial

pytestmark = pytest.mark.integration

def _interval(trial: Trial) -> tuple[float, float]:
    """Tokens/s of the candidate relative to its baseline: (1 + ci_low, 1 + ci_high)."""
    return 1 + trial.ci_low, 1 + trial.ci_high


def test_live_tuning_session_on_default_settings_keeps_only_measured_gains(
        tmp_path: Path) -> None:
    config = SessionConfig(out=tmp_path, trials=4)  # the sidecar on its defaults
    result = run_training_session(config, timeout_s=900)
    print(json.dumps(result.to_json(), indent=1))  # the numbers the issue asks to report
    (tmp_path / "session.json").write_text(json.dumps(result.to_json(), indent=1))

    measured = [t for t in result.trials if t.measured]
    # 4 trials, or fewer once every single move from the kept config was tried (on a CPU
    # without bf16 instructions the demo GPT has two: threads and micro-batch)
    assert len(measured) >= 4 or (SEARCH_DONE in result.notes and measured), result.notes
    seen: set[str] = set()
    for t in measured:  # a config is measured again only when the search says why
        config = json.dumps(t.values, sort_keys=True)
        assert config not in seen or t.origin.startswith(("again:", "revisit:")), t
        seen.add(config)
    for trial in result.trials:  # one knob at a time, from the baseline of then
        assert len([k for k in trial.values if trial.values[k] != trial.baseline[k]]) == 1
        assert not any(str(v) == "fp16" for v in trial.values.values())  # slower on a CPU
    for trial in measured:  # a kept trial's interval excludes zero from above
        assert (trial.state == "kept") == (trial.ci_low > 0 and "loss" not in (
            trial.ended_because or "")), trial

    # The kept config re-measured against the first baseline, interleaved, by the same
    # sequential test: the first baseline is not measurably faster. That is the one claim
    # "kept is best so far" can soundly make after a search: each verdict was a single test
    # against the baseline of its time, so intervals chained across baselines are no interval.
    if result.kept == result.baseline:
        assert result.remeasure is None
    else:
        again = result.remeasure
        assert again is not None and again.measured, again
        assert again.ci_low <= 0, f"the first baseline beat the kept config: {again}"


def _finding_opened_s(session: TrainingSession, group: str) -> tuple[FindingJSON, float]:
    findings = session.api.findings(job=session.config.job, include_closed=True)
    found = [f for f in findings if f["detector"] in ("gradient_underflow", "gradient_collapse")
             and f["resource"].get("module_group") == group]
    assert found, f"no gradient finding on {group}: {findings}"
    return found[0], found[0]["opened_at_ns"] / 1e9


def test_fp16_underflow_is_detected_and_rolled_back_locally(tmp_path: Path) -> None:
    fp16 = dtype_speedups("cpu").get("fp16", 0.0)
    if fp16 >= 0.5:  # measured on a Xeon with AVX512-FP16: 1.01x, and no finding in 300 s
        pytest.skip(f"fp16 matmuls run at {fp16:.2f}x fp32 here, not emulated: this drill's "
                    "fp16 underflow was never detected on such a CPU (open question, see #13's "
                    "closing note); it runs where fp16 is emulated")
    # A job whose GradScaler backed off to 2**-24 and may not grow again: fine in fp32, but
    # an operator forcing fp16 onto the ffn group makes that group's gradients flush to zero.
    # fp16 matmuls are emulated on most CPUs (15x slower for this group here): the harm bound
    # and the regression verdict would roll the change back before the underflow finding
    # opens, so this drill of the underflow path keeps the candidate in force for 40 steps
    # and the throughput verdicts off
    config = SessionConfig(out=tmp_path, tune=False, grad_scaler=True, loss_scale=2.0**-24,
                           loss_scale_growth_interval=10**9, warm_steps=20,
                           rollout_settings={"max_slowdown": 0.0, "min_steps": 40,
                                             "early_stop_pairs": 24})
    with TrainingSession(config) as session:
        change = session.propose({"precision.ffn": "fp16"}, "operator: fp16 on the ffn group")
        done = session.wait_change(change["id"], ["rolled_back", "kept", "failed"], 600)
        assert done["state"] == "rolled_back", done
        assert done["plan"]["rollback"] == "local", done["plan"]
        assert "gradient_underflow" in done["plan"]["ended_because"]

        def restored_too() -> ChangeDetailJSON | None:
            """The change once its ``restored`` event, journaled just after the verdict, is in
            (a read between the two once saw the verdict alone)."""
            now = session.change(change["id"])
            return now if any(e["kind"] == "restored" for e in now["events"]) else None

        done = session.wait(restored_too, 60, "the rollback's restored event",
                            watch=(session.train,))
        events: dict[str, dict[str, Any]] = {}
        for event in done["events"]:
            events.setdefault(event["kind"], event)  # the first of each kind
        assert events["snapshot"]["at_ns"] < events["desired"]["at_ns"]  # before the risk
        rolled = events["rolled_back"]
        assert rolled["detail"]["group"] == "ffn"
        assert rolled["detail"]["action"]["scope"] == "local"
        assert rolled["detail"]["restore"]["precision.ffn"] == "fp32"
        restored = events["restored"]["version_after"]

        finding, opened_s = _finding_opened_s(session, "ffn")
        applied_s = done["plan"]["applied_at_s"]
        assert opened_s >= applied_s
        # the job ran both one-shot actions and acked the restored config (ffn in fp32)
        def acked() -> list[AckJSON] | None:
            acks = session.api.acks(config.job)
            return acks if any(a["version"] >= restored for a in acks) else None

        acks = session.wait(acked, 120, "the job to ack the restored config",
                            watch=(session.train,))
        actions = [x for a in acks for x in a["actions"]]
        assert any(x["kind"] == "snapshot" and x["status"] == "done" for x in actions)
        assert any(x["kind"] == "rollback" and x["scope"] == "local" and x["group"] == "ffn"
                   and x["status"] == "done" for x in actions), actions
        back = next(a for a in acks if a["version"] >= restored)
        assert back["status"] == "applied"
        knobs = session.api.knobs(config.job)
        assert knobs["desired"]["values"]["precision.ffn"] == "fp32"

        # the loss keeps falling after the rollback; loss is a gauge read once per export, not
        # per step, so how many readings 80 steps give depends on the box's speed: wait for 10
        session.wait_steps(back["step"] + 80, 600)
        deadline = time.monotonic() + 120
        while True:
            with TimeSeriesStore(tmp_path / "metrics.db", readonly=True) as store:
                loss = store.query("seedance.train.loss", resolution="raw")
                norms = store.query("seedance.train.grad.group_norm", resolution="raw")
            versions = loss["seedance.config.version"].astype(int)
            after = loss[versions >= restored].sort_values("time")["value"].to_numpy()
            if len(after) >= 10 or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert len(after) >= 10 and all(math.isfinite(v) for v in after)
        third = len(after) // 3
        assert after[-third:].mean() < after[:third].mean(), after
        ffn = norms[(norms["seedance.module_group"] == "ffn")
                    & (norms["seedance.config.version"].astype(int) >= restored)]
        assert (ffn["value"] > 0).any(), "the ffn group learns again"
        detect_s = opened_s - applied_s
        rollback_s = rolled["at_ns"] / 1e9 - applied_s
        print(f"fp16 applied -> finding opened {detect_s:.1f} s -> rolled back "
              f"{rollback_s:.1f} s (finding {finding['id']}: {finding['evidence']['summary']})")


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _logged_at(line: str) -> float:
    match = _LOG_TIME.match(line)
    assert match, line
    return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _candidate_in_force(session: TrainingSession, *, measured: int) -> ChangeJSON | None:
    """A trial in flight whose candidate the job runs now, after ``measured`` windows."""
    for change in session.changes(source="trial"):
        plan = change["plan"]
        if (change["state"] == "observing" and plan.get("acked")
                and plan["arms"][plan["index"]] == "candidate"
                and len(change["windows"]) >= measured):
            return change
    return None


def test_sidecar_killed_mid_trial_job_returns_to_baseline_within_the_lease(
        tmp_path: Path) -> None:
    ttl_s = 3.0
    config = SessionConfig(out=tmp_path, lease_ttl_s=ttl_s, warm_steps=20,
                           rollout_settings={"loss_tolerance": 1.0})
    with TrainingSession(config) as session:
        change = session.wait(lambda: _candidate_in_force(session, measured=1), 600,
                              "a trial's candidate in force", watch=(session.train,))
        baseline_version = session.job_status()["baseline"]["version"]  # type: ignore[index]
        step_s = max(w["step_s"] for w in change["windows"])
        session.kill_sidecar()
        killed_at = time.time()

        def back_line() -> str | None:
            return next((line for line in session.log_lines()
                         if "back to the baseline" in line and _logged_at(line) > killed_at),
                        None)
        line = session.wait(back_line, 120, "the job to give up the lease",
                            watch=(session.train,))
        assert f"baseline config v{baseline_version} " in line
        switched = session.wait(lambda: next((x for x in session.log_lines() if
                                              f"config v{baseline_version} in force" in x
                                              and _logged_at(x) > killed_at), None),
                                60, "the baseline in force", watch=(session.train,))
        # the lease was last renewed before the kill: the baseline is in force at the first
        # step boundary after the TTL (the step in progress may finish first)
        delay_s = _logged_at(switched) - killed_at
        print(f"sidecar SIGKILLed -> baseline v{baseline_version} in force after {delay_s:.1f} s "
              f"(lease {ttl_s:g} s, candidate step {step_s:.2f} s)")
        assert delay_s <= ttl_s + 2 * step_s + 1.0
        at_step = int(re.search(r"from step (\d+)", switched)[1])  # type: ignore[index]
        session.wait_steps(at_step + 20, 300)  # trains on without its sidecar
        assert session.train is not None and session.train.poll() is None
