"""Every guardrail the sidecar installs keeps the ``tuner.Guardrail`` contract: no evidence is
no trip (an empty store never rolls a change back), and a check neither raises nor writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors._store import TimeSeriesStore
from tests.conformance._product import product_subclasses
from tuner._change import Change
from tuner._guardrails import GradientCollapseFindings, Guardrail, NonFiniteValues
from tuner.serving_guardrails import ServingGuardrailConfig, ServingSLOGuardrail

GUARDRAILS: dict[str, Guardrail] = {
    "non_finite_values": NonFiniteValues(),
    "gradient_findings": GradientCollapseFindings(list),
    "serving_slo": ServingSLOGuardrail(ServingGuardrailConfig(p99_slo_s=1.0)),
}


def test_every_guardrail_is_covered() -> None:
    """A new Guardrail subclass must be added to GUARDRAILS (and so to this suite)."""
    assert product_subclasses(Guardrail) == {type(g) for g in GUARDRAILS.values()}


@pytest.mark.parametrize("guardrail", GUARDRAILS.values(), ids=GUARDRAILS.keys())
@pytest.mark.parametrize("arm", ["candidate", "baseline"])
def test_no_evidence_is_no_trip(guardrail: Guardrail, arm: str, tmp_path: Path) -> None:
    change = Change(id="c1", job="job", state="observing", source="trial", reason="test",
                    risk="low", scope="config", values={"k": 2}, baseline={"k": 1},
                    created_at_s=0.0, expires_at_s=1e9,
                    plan={"arms": [arm], "index": 0, "version": 3, "applied_at_s": 0.0})
    with TimeSeriesStore(tmp_path / "metrics.db") as store:
        assert guardrail.check(change, 3, store) is None
        assert store.query("seedance.train.loss", resolution="raw").empty  # nothing written
