"""``bench/fleet_priors_replays.py``: two revisions' searches on one recorded run. Against
its own revision the two arms must meet the same measurements the same way."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fleet_priors_replays import main

RUN_E = Path(__file__).resolve().parents[1] / "data" / "fleet_priors_cnn_bn_run_e.json"


def test_the_same_code_on_both_arms_replays_the_same_searches(tmp_path: Path) -> None:
    out = tmp_path / "replays.json"
    main(["--base", "HEAD", "--runs", str(RUN_E), "--out", str(out)])
    result = json.loads(out.read_text(encoding="utf-8"))
    (run,) = result["runs"].values()
    cnn = run["cnn_bn"]
    assert cnn["base"] == cnn["new"]
    assert cnn["new"]["cold"] == 5 and cnn["new"]["applies"]  # run e's cold search, replayed
    assert result["met_where_applies"]["base"] == result["met_where_applies"]["new"]
    assert "nothing measured by this run" in result["measurement"]
    assert set(result["targets"]) == {"base: family-runs meeting warm <= cold / 2",
                                      "new: family-runs meeting warm <= cold / 2"}
