"""``bench/fleet_priors.py --truth-from``: this code's searches judged on an earlier run's
recorded truth tables (the cnn_bn family of run e, measured on a CPU with fast bf16), so a
change to the search or its priors meets the measurements the code before it met."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.fleet_priors import main

RUN_E = Path(__file__).resolve().parents[1] / "data" / "fleet_priors_cnn_bn_run_e.json"


def replay(tmp_path: Path, source: Path) -> dict:
    out = tmp_path / "replay.json"
    main(["--truth-from", str(source), "--families", "cnn_bn", "--out", str(out)])
    return json.loads(out.read_text(encoding="utf-8"))


def configs(search: dict) -> list[tuple[str, str]]:
    return [(t["config"], t["state"]) for t in search["trials"]]


def test_the_recorded_run_replays_and_the_bigger_job_tries_half_the_micro_batch_second(
        tmp_path: Path) -> None:
    recorded = json.loads(RUN_E.read_text(encoding="utf-8"))["families"]["cnn_bn"]
    result = replay(tmp_path, RUN_E)
    assert "not measured by this run" in result["measurement"]
    cnn = result["families"]["cnn_bn"]
    # nothing the priors change: the small job's and the cold search's trials as recorded
    for search in ("A", "B_cold"):
        assert configs(cnn[search]) == configs(recorded[search]), search
    assert cnn["cold_kept"] == recorded["cold_kept"] == "t2/mb16/bf16"
    # the base CNN (3.5x the parameters) tries the small one's kept config, then that config
    # at half its micro-batch (32 -> 16), the base size's faster micro-batch there
    warm = cnn["B_warm"]["trials"]
    assert [t["config"] for t in warm[:2]] == ["t2/mb32/head=fp32,other=bf16",
                                               "t2/mb16/head=fp32,other=bf16"]
    assert warm[1]["origin"].startswith("fleet: half the micro-batch kept by job cnn_bn-small")
    assert warm[1]["state"] == "kept"
    assert cnn["warm_trials_to_kept"] < recorded["warm_trials_to_kept"]


def test_a_replay_starts_from_the_recorded_launch_threads_whatever_the_process_runs_at(
        tmp_path: Path) -> None:
    """The threads knob's default is the process's torch threads: a pytest worker whose
    earlier test set 1 replayed run e's searches from t1, where run e launched at t2."""
    recorded = json.loads(RUN_E.read_text(encoding="utf-8"))["families"]["cnn_bn"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cnn = replay(tmp_path, RUN_E)["families"]["cnn_bn"]
        assert torch.get_num_threads() == 1  # put back as it was
    finally:
        torch.set_num_threads(before)
    assert recorded["launch_config"].startswith("t2/")
    for search in ("A", "B_cold", "B_warm"):
        assert configs(cnn[search])[0][0].startswith("t2/"), search
    assert configs(cnn["A"]) == configs(recorded["A"])


def test_a_config_the_recorded_table_lacks_ends_the_search_as_unmeasured(
        tmp_path: Path) -> None:
    run = json.loads(RUN_E.read_text(encoding="utf-8"))
    del run["families"]["cnn_bn"]["truth"]["B"]["t2/mb16/head=fp32,other=bf16"]
    lacking = tmp_path / "lacking.json"
    lacking.write_text(json.dumps(run), encoding="utf-8")
    warm = replay(tmp_path, lacking)["families"]["cnn_bn"]["B_warm"]
    assert warm["unmeasured"] == "t2/mb16/head=fp32,other=bf16"
    assert not warm["converged"]


def test_a_file_that_is_not_a_results_file_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        main(["--truth-from", str(bad), "--out", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "not a fleet_priors results file ('families')")
