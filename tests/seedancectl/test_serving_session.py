"""A live tuning session on the real serving job: the real sidecar (tuning on, approval auto
within the operator's bounds, the serving SLO guardrail), the demo serving job in its own
process (``workloads.serve_tuned``: the small GPT, quantised KV cache, prefix cache, closed-loop
load from the seeded load generator) holding a knob lease of kind ``serve``.

The job launches with memory-saving 6-bit keys (8-bit values) read through the torch
dequantise path (``SEEDANCE_KV_NATIVE=0``: there the 6-bit codes cost more to unpack than they
save; the fused kernel makes every width about as fast) and a 2-entry prefix cache (2 entries
miss most of the Zipf mix of 32 prefixes); the operator auto-approves KV widths of 8 bits or
more. 8-bit keys are the one move worth most: beside one busy core, 15 s runs of the job gave
307-315 tokens/s at 6/8 bits and 366-405 at 8/8 (+19-29%), where a launch at 6/6 bits left
single moves of +2-25% (6/8) that the suite's load hid in 90-second trials. The search must keep a
config that measurably beats the launch config in generated tokens/s without breaking the
quality bound; then an operator's change that breaks the p99 SLO
(the job's INJECTED per-step delay knob) and one that breaks the quality bound (2-bit KV) are
rolled back by the guardrail. Every number is measured on this machine; the time limits only
bound the waits. The measured windows are written to ``test-artifacts/serving_session.json``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.seedancectl._live import Live, live_sidecar
from tuner._verdict import RolloutConfig

pytestmark = pytest.mark.integration

JOB = "serve"
SEARCHED = ("kv.key_bits", "kv.value_bits", "prefix_cache.capacity_entries")
SLO_S = 6.0
TRIAL_S = RolloutConfig().trial_budget_s
"""A trial ends within this much job time (plus its last window): the waits allow for it."""
KEPT_WITHIN_S = 900.0
"""The wait for the search's first kept trial: it bounds the wait, it is not the expectation.
Beside a suite worker at the same priority one window's tokens/s swung by +-25% and the first
kept trial took 4-5 trials when it came at all (3 CI runs of 3 failed); with that worker niced
(``tests/conftest.py``) the first trial, 8-bit keys, was kept after 4 pairs at +35%, pair
ratios 1.23-1.43."""
ARTIFACT = Path(__file__).resolve().parents[2] / "test-artifacts" / "serving_session.json"


@pytest.fixture
def session(tmp_path: Path) -> Iterator[tuple[Live, subprocess.Popen[bytes]]]:
    settings: dict[str, Any] = {
        "approval": {"mode": "auto", "proposal_ttl_s": 3,
                     # the operator auto-approves KV widths of 8 bits or more only
                     "bounds": {"kv.key_bits": {"allowed": [8, 16, 32]},
                                "kv.value_bits": {"allowed": [8, 16, 32]}}},
        "jobs": {JOB: {"tune": True, "knobs": list(SEARCHED), "study": "serving-session"}},
        "serving_slo": {"p99_slo_s": SLO_S, "min_token_agreement": 0.98, "min_requests": 20},
        "tuning_interval_s": 0.5,  # the controller's store reads share the box with the job
    }
    with live_sidecar(tmp_path, **settings) as live:
        log = (tmp_path / "job.log").open("wb")
        job = subprocess.Popen(
            [sys.executable, "-m", "workloads.serve_tuned", "--sidecar", live.url, "--job", JOB,
             # the job outlives every wait below: the first kept trial, then three changes
             "--duration-s", str(int(KEPT_WITHIN_S + 4 * (TRIAL_S + 60))),
             "--kv-bits", "6", "8", "--capacity-entries", "2",
             "--n-prefixes", "32",
             "--export-interval-s", "1", "--lease-ttl-s", "30"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SEEDANCE_KV_NATIVE": "0"})
        try:
            yield live, job
        finally:
            job.terminate()
            job.wait(30)
            log.close()
            print((tmp_path / "job.log").read_text()[-3000:])


def _changes(live: Live) -> list[dict[str, Any]]:
    return live.get("/v1/changes", job=JOB)  # type: ignore[no-any-return]


def _wait(live: Live, job: subprocess.Popen[bytes], what: str, timeout_s: float,
          found: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        assert job.poll() is None, "the serving job died"
        result = found()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s; changes: " + \
            json.dumps([(c["state"], c["values"], c.get("reason"), c.get("comparison"))
                        for c in _changes(live)])
        time.sleep(0.5)


def _arm(change: dict[str, Any], arm: str, key: str) -> float:
    values = [float(w[key]) for w in change["windows"] if w["arm"] == arm]
    return sum(values) / len(values) if values else math.nan


def _operator_change(live: Live, job: subprocess.Popen[bytes],
                     values: dict[str, Any]) -> dict[str, Any]:
    reply = live.post(f"/v1/jobs/{JOB}/changes", {"values": values, "by": "oncall",
                                                  "reason": "operator's setting"})
    assert reply.status_code == 201, reply.text
    change = reply.json()
    if change["state"] == "proposed":
        approved = live.post(f"/v1/changes/{change['id']}/approve", {"by": "oncall"})
        assert approved.status_code == 200, approved.text
    return live.wait_state(change["id"], "kept", "rolled_back", "failed",
                           timeout_s=TRIAL_S + 60)


def test_a_live_session_keeps_a_faster_config_and_the_guardrail_rolls_back_breaches(
        session: tuple[Live, subprocess.Popen[bytes]]) -> None:
    live, job = session
    _wait(live, job, "the serving job attaches", 60,
          lambda: any(j["job"] == JOB and j["kind"] == "serve"
                      for j in live.get("/v1/jobs")))
    default = dict(live.get(f"/v1/jobs/{JOB}/knobs")["baseline"]["values"])
    assert (default["kv.key_bits"], default["prefix_cache.capacity_entries"]) == (6, 2)

    _wait(live, job, "a trial is kept", KEPT_WITHIN_S,
          lambda: [c for c in _changes(live)
                   if c["source"] == "trial" and c["state"] == "kept"])
    paused = live.post(f"/v1/jobs/{JOB}/tuning", {"by": "oncall", "action": "pause"})
    assert paused.status_code == 200, paused.text
    time.sleep(1.0)  # a tuning round that began before the pause may still propose its trial
    for change in _changes(live):  # the search's trial in flight: ended now, not at its budget
        if change["state"] in ("applying", "observing"):
            live.post(f"/v1/jobs/{JOB}/rollback", {"by": "oncall", "reason": "drill next",
                                                   "change": change["id"]})  # 409 if it ended
    _wait(live, job, "the search's change in flight ends", TRIAL_S + 60,
          lambda: not [c for c in _changes(live)
                       if c["state"] in ("proposed", "approved", "applying", "observing")])
    # the trial in flight at the pause may have been kept too: the baseline is the last kept
    kept = [c for c in _changes(live) if c["source"] == "trial" and c["state"] == "kept"][-1]

    # The kept config: more generated tokens/s than the launch config, interval above zero,
    # within the quality bound and the SLO in every window it was measured in.
    comparison = kept["comparison"]
    assert comparison["ci_low"] > 0 and comparison["gain"] > 0
    candidate = [w for w in kept["windows"] if w["arm"] == "candidate"]
    assert all(float(w["quality"]) >= 0.98 for w in candidate
               if not math.isnan(float(w["quality"])))
    assert all(float(w["p99_s"]) <= SLO_S for w in candidate)
    baseline_now = live.get(f"/v1/jobs/{JOB}/knobs")["baseline"]["values"]
    assert {k: baseline_now[k] for k in kept["values"]} == kept["values"]

    # An operator's setting that makes every decode step slow (INJECTED delay): the p99 SLO.
    slow = _operator_change(live, job, {"serving.step_delay_s": 0.3})
    assert slow["state"] == "rolled_back"
    assert "exceeds the SLO" in slow["plan"]["ended_because"]
    # An operator's 2-bit KV cache: fast enough, but the greedy tokens drift (quality bound).
    two_bit = _operator_change(live, job, {"kv.key_bits": 2, "kv.value_bits": 2})
    assert two_bit["state"] == "rolled_back"
    assert "token agreement" in two_bit["plan"]["ended_because"]
    assert live.get(f"/v1/jobs/{JOB}/knobs")["baseline"]["values"] == baseline_now

    report = {
        "default": {k: default[k] for k in SEARCHED}, "picked": kept["values"],
        "gain": comparison, "windows": kept["windows"],
        "default_tokens_per_s": _arm(kept, "baseline", "tokens_per_s"),
        "picked_tokens_per_s": _arm(kept, "candidate", "tokens_per_s"),
        "default_p99_s": _arm(kept, "baseline", "p99_s"),
        "picked_p99_s": _arm(kept, "candidate", "p99_s"),
        "default_quality": _arm(kept, "baseline", "quality"),
        "picked_quality": _arm(kept, "candidate", "quality"),
        "trials": [(c["state"], c["values"], (c.get("comparison") or {}).get("gain"),
                    c["plan"].get("ended_because")) for c in _changes(live)],
        "slo_rollback": slow["plan"]["ended_because"],
        "quality_rollback": two_bit["plan"]["ended_because"],
    }
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "windows"}, indent=2,
                     default=str))
