"""Every detector the sidecar runs keeps the ``policies.Detector`` contract.

Parametrised over ``all_detectors()`` (one of each class ``policies.detectors`` exports, the
set the sidecar runs), so a new detector is held to it without a line here: a stable unique
name; too little data is no finding, and neither is a window of NaN (missing data, not a
fault); ``evaluate`` is pure (the same window, the same findings, the window untouched);
every finding it returns on its positive scenarios is complete (who, what, why, in units).
The positive scenarios are the detector suites' own (``tests/policies/scenarios_*``); those
that run a real torch job are left to ``test_scenarios_training.py``, here only their count.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from collectors import Point
from collectors._catalogue import CATALOGUE
from collectors._points import MetricKind
from policies import Detector, FrameStore, StoreWindow
from seedancectl._sidecar import all_detectors
from tests.policies import scenarios_hardware, scenarios_serving, scenarios_training
from tests.policies.scenarios_hardware import JOB, S, Scenario

DETECTORS = all_detectors()
SCENARIOS: tuple[Scenario, ...] = (*scenarios_hardware.SCENARIOS, *scenarios_serving.SCENARIOS,
                                   *scenarios_training.SCENARIOS)
CHEAP_POSITIVE = [s for s in SCENARIOS if not s.healthy and s.source != "real"]
NAN_IS_THE_FAULT = {"non_finite": "a NaN loss or gradient is what it detects"}
SCENARIOS_ELSEWHERE = {"compute_priors": "tests/policies/test_priors.py, on measured profiles"}
ATTRIBUTES = {"service.name": JOB, "seedance.rank": "0", "gpu.index": "0", "hw.id": "0",
              "seedance.module_group": "ffn", "seedance.precision": "fp32",
              "seedance.replica": "0", "seedance.config.version": "1"}


@pytest.fixture(params=DETECTORS, ids=lambda d: d.name)
def detector(request: pytest.FixtureRequest) -> Detector:
    return request.param  # type: ignore[no-any-return]


def _whole(store: FrameStore) -> StoreWindow:
    return StoreWindow(store, job=JOB, since_ns=0, until_ns=10**19)


def _nan_store() -> FrameStore:
    """Every metric of the catalogue, ten exports of NaN (a histogram's count, sum and
    buckets too), with the attributes detectors group by."""
    points = []
    for spec in CATALOGUE:
        names = ([spec.name + ".count", spec.name + ".sum"] if spec.kind == MetricKind.HISTOGRAM
                 else [spec.name])
        for i in range(10):
            t = 1000 * S + i * 10 * S
            points += [Point(name, math.nan, t, ATTRIBUTES) for name in names]
            if spec.kind == MetricKind.HISTOGRAM:
                points += [Point(spec.name + ".bucket", math.nan, t, {**ATTRIBUTES, "le": le})
                           for le in ("0.1", "1.0", "+Inf")]
    return FrameStore.from_points(points)


def test_names_are_unique_and_every_detector_has_a_positive_scenario() -> None:
    names = [d.name for d in DETECTORS]
    assert len(names) == len(set(names)) and all(n and n == n.strip() for n in names)
    positive = {s.detector for s in SCENARIOS if not s.healthy}
    healthy = {s.detector for s in SCENARIOS if s.healthy}
    elsewhere = set(SCENARIOS_ELSEWHERE)
    assert set(names) - positive - elsewhere == set(), "a detector without a positive scenario"
    assert set(names) - healthy - elsewhere == set(), "a detector without a healthy scenario"


def test_an_empty_window_is_no_finding(detector: Detector) -> None:
    assert detector.evaluate(_whole(FrameStore({}))) == []


def test_a_window_of_nan_is_no_finding(detector: Detector) -> None:
    if detector.name in NAN_IS_THE_FAULT:
        pytest.skip(NAN_IS_THE_FAULT[detector.name])
    assert detector.evaluate(_whole(_nan_store())) == []


@pytest.mark.parametrize("scenario", CHEAP_POSITIVE, ids=lambda s: f"{s.detector}:{s.name}")
def test_findings_are_complete_and_evaluate_is_pure(scenario: Scenario) -> None:
    built = scenario.build()
    detector = scenario.make()
    before = {name: frame.copy() for name, frame in built.store._frames.items()}
    found = []
    for t in built.eval_ns:
        window = StoreWindow(built.store, job=JOB, since_ns=t - int(built.window_s * S),
                             until_ns=t)
        first = detector.evaluate(window)
        assert detector.evaluate(window) == first  # the same window, the same answer
        found += first
    assert found, f"{scenario.name}: its positive scenario found nothing"
    for name, frame in built.store._frames.items():  # the window was only read
        pd.testing.assert_frame_equal(frame, before[name])
    for finding in found:
        assert finding.detector == detector.name and finding.job == JOB
        assert finding.id == "" and finding.opened_at_ns is None  # the engine's to set
        evidence = finding.evidence
        assert evidence.summary.strip() and evidence.model.strip()
        assert evidence.measurements, f"{finding.detector}: a finding without its numbers"
        assert all(m.name and m.unit for m in evidence.measurements)
        assert all(t.unit for t in evidence.thresholds)
        assert all(c.knob and c.expected_effect for c in finding.suggested_changes)
