"""Findings and evidence: validation, JSON round trip, the one-paragraph rendering."""

from __future__ import annotations

import json
import math

import pytest

from policies import Evidence, Finding, Measurement, SuggestedChange, Threshold, more_severe


def _evidence(value: float = 0.83) -> Evidence:
    return Evidence(
        summary="Memory bandwidth pressure is past the A100 knee",
        model="bandwidth saturation f = 1 - exp(-k x/B), k = 0.8",
        measurements=(Measurement(name="x/B", value=value),
                      Measurement(name="demand", value=1700.0, unit="GB/s")),
        thresholds=(Threshold(measurement="x/B", comparison=">", value=0.72),),
    )


def _finding(**overrides: object) -> Finding:
    fields: dict[str, object] = dict(
        detector="bandwidth_saturation", job="train-a", severity="warning",
        resource={"gpu": 0, "rank": "3"}, evidence=_evidence(),
        suggested_changes=(SuggestedChange(knob="scheduler.policy", value="dynamic-topo",
                                           expected_effect="fewer cross-node hops"),))
    fields.update(overrides)
    return Finding(**fields)  # type: ignore[arg-type]


def test_json_round_trip_is_exact() -> None:
    f = _finding(id="abc", opened_at_ns=10, closed_at_ns=None)
    text = f.to_json()
    assert json.loads(text)["resource"] == {"gpu": "0", "rank": "3"}
    assert Finding.from_json(text) == f


def test_non_finite_numbers_survive_strict_json() -> None:
    f = _finding(evidence=_evidence(math.inf))
    back = Finding.from_json(f.to_json())
    assert back.evidence.value("x/B") == math.inf


def test_render_is_one_paragraph_with_numbers_model_and_bounds() -> None:
    text = _finding().render()
    assert "\n" not in text
    for part in ("[warning]", "train-a", "gpu 0", "0.83", "1700 GB/s", "exp(-k x/B)",
                 "above the threshold 0.72", "scheduler.policy = 'dynamic-topo'"):
        assert part in text


@pytest.mark.parametrize(("overrides", "field"), [
    ({"severity": "fatal"}, "severity"), ({"job": ""}, "job"), ({"detector": ""}, "detector"),
])
def test_validation_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _finding(**overrides)


def test_threshold_must_refer_to_a_measurement() -> None:
    with pytest.raises(ValueError, match="not among the measurements"):
        Evidence(summary="s", model="m", thresholds=(
            Threshold(measurement="nope", comparison="<", value=1.0),))


def test_key_ignores_resource_order_and_severity_orders() -> None:
    a = _finding(resource={"gpu": "0", "rank": "3"})
    b = _finding(resource={"rank": "3", "gpu": "0"}, severity="critical")
    assert a.key == b.key
    assert more_severe("warning", "critical") == "critical"
    assert more_severe("info", "warning") == "warning"
