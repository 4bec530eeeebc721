"""Every results file names its targets and whether they were met (issue #16 item 5), and the
judgement can fail: a figure that misses its target is not met."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import overhead
from bench._targets import at_least, at_most, block, holds, no_target
from bench.refresh_targets import BENCHES, INPUTS, bench_of

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_results_to_check() -> None:
    assert len(FILES) > 30


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_each_results_file_names_its_targets_and_whether_they_were_met(path: Path) -> None:
    result = json.loads(path.read_text(encoding="utf-8"))
    if "no_target_because" in result:
        assert path.name in INPUTS, "only a bench's input data may go without a target"
        assert result["targets"] == {}
        assert isinstance(result["no_target_because"], str) and result["no_target_because"]
        return
    targets = result["targets"]
    assert isinstance(targets, dict) and targets
    for name, entry in targets.items():
        assert "target" in entry, name
        assert isinstance(entry["met"], bool), name
        assert isinstance(entry["source"], str) and entry["source"], name
    assert result["met"] is all(entry["met"] for entry in targets.values())


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_each_results_file_is_mapped_to_the_bench_that_writes_it(path: Path) -> None:
    assert path.name in INPUTS or bench_of(path.name) in BENCHES.values()


def test_variants_of_a_results_file_map_to_their_bench() -> None:
    assert bench_of("fleet_priors_run_a.json") == "fleet_priors"
    assert bench_of("fleet.json") == "fleet"
    assert bench_of("soak_ab30_fix.json") == "soak"
    assert bench_of("stability_serving.json") == "stability"
    assert bench_of("unknown.json") is None


def _overhead(median: float, ci_high: float) -> dict:
    return block(overhead.targets({"median_ratio": median, "ratio_ci95": [0.99, ci_high]}))


def test_a_figure_that_misses_its_target_is_not_met() -> None:
    missed = _overhead(1.0138, 1.0228)  # bench/results/overhead.json at 150 pairs
    assert missed["met"] is False
    assert [e["met"] for e in missed["targets"].values()] == [False, False]
    assert _overhead(1.002, 1.0228)["met"] is False  # the CI bound alone can fail it


def test_a_figure_that_meets_its_target_is_met() -> None:
    met = _overhead(1.002, 1.005)
    assert met["met"] is True
    assert all(e["met"] and e["op"] == "<=" for e in met["targets"].values())


def test_an_unmeasured_figure_never_meets_a_numeric_target() -> None:
    assert at_most("x", 1.0, None, "test").met is False
    assert at_least("x", 1.0, None, "test").met is False
    assert at_least("x", 1.0, 1.0, "test").met is True


def test_a_block_needs_a_target_and_an_input_says_why_it_has_none() -> None:
    with pytest.raises(ValueError):
        block([])
    assert no_target("input") == {"targets": {}, "no_target_because": "input"}
    entry = block([holds("findings", "none", 0, True, "issue #3")])["targets"]["findings"]
    assert entry == {"target": "none", "measured": 0, "met": True, "source": "issue #3"}
