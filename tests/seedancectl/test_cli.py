"""The sidecar commands of `seedancectl` (Typer's CliRunner) against a real sidecar on
127.0.0.1 and a SIMULATED job holding a real lease."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from seedancectl.cli import app
from tests.seedancectl._live import Live, SimulatedJob, live_sidecar
from tests.servers import free_port
from tuner._token import TOKEN_ENV

pytestmark = pytest.mark.integration


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    monkeypatch.chdir(tmp_path)  # no seedance-data/token of the developer's is found
    monkeypatch.delenv("SEEDANCE_TOKEN", raising=False)
    monkeypatch.delenv("SEEDANCE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("SEEDANCE_SIDECAR", raising=False)
    with live_sidecar(tmp_path, jobs={"gpt": {"tune": True, "knobs": ["threads"]}}) as live:
        live.post("/v1/jobs/gpt/tuning", {"by": "setup", "action": "pause"})  # quiet search
        SimulatedJob(live)
        os.environ.pop(TOKEN_ENV)  # live_sidecar set it for jobs; the CLI must find none
        yield live


def run(live: Live, *args: str, token: bool = False) -> Any:
    extra = ["--sidecar", live.url] + (["--token-file", str(live.token_file)] if token else [])
    return CliRunner().invoke(app, [*args, *extra])


def ok_json(live: Live, *args: str, token: bool = False) -> Any:
    result = run(live, *args, "--json", token=token)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def one_line_error(result: Any, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_precision_set_approve_show_and_rollback(live: Live) -> None:
    result = run(live, "precision", "set", "--job", "gpt", "ffn=bf16", "--by", "alice",
                 token=True)
    assert result.exit_code == 0, result.output
    assert "proposed" in result.output and "precision.ffn: 'fp32' -> 'bf16'" in result.output
    change_id = result.output.split("change ", 1)[1].split()[0]
    assert f"seedancectl approve {change_id} --sidecar {live.url}" in result.output

    listed = ok_json(live, "changes", "list", "--job", "gpt", "--state", "proposed")
    assert [c["id"] for c in listed] == [change_id]
    table = run(live, "changes", "list")
    assert table.exit_code == 0 and change_id in table.output

    approved = ok_json(live, "approve", change_id, "--by", "alice", "--comment", "ok",
                       token=True)
    assert (approved["state"], approved["approved_by"]) == ("approved", "alice")
    live.wait_state(change_id, "applying")
    shown = ok_json(live, "changes", "show", change_id)
    assert [e["kind"] for e in shown["events"]][:2] == ["proposed", "approved"]
    text = run(live, "changes", "show", change_id)
    assert text.exit_code == 0 and "approved" in text.output and "alice" in text.output

    precision = ok_json(live, "precision", "show", "--job", "gpt")
    assert precision["desired"]["values"]["precision.ffn"] == "bf16"
    assert [k["name"] for k in precision["knobs"]] == ["precision.ffn"]

    rolled = run(live, "rollback", "--job", "gpt", "--by", "bob", "--reason", "pager",
                 token=True)
    assert rolled.exit_code == 0 and "rolled_back" in rolled.output, rolled.output
    assert ok_json(live, "precision", "show", "--job", "gpt")["desired"]["values"][
        "precision.ffn"] == "fp32"


def test_reject_scheduler_kv_tuning_status(live: Live) -> None:
    proposed = ok_json(live, "scheduler", "set", "--job", "gpt", "--policy", "dynamic-topo",
                       "--rdma-enable=true", "--numa-aware=false", "--by", "carol", token=True)
    assert (proposed["state"], proposed["scope"], proposed["risk"]) == (
        "proposed", "restart", "high")
    assert proposed["values"] == {"scheduler.policy": "dynamic-topo", "scheduler.rdma": True}
    rejected = ok_json(live, "reject", proposed["id"], "--by", "dave", "--reason", "not now",
                       token=True)
    assert rejected["state"] == "rejected"

    kv = ok_json(live, "kv", "set", "--job", "gpt", "key_bits=4", "value_bits=8", "--by", "e",
                 token=True)
    assert kv["values"] == {"kv.key_bits": 4, "kv.value_bits": 8}
    shown = run(live, "kv", "show", "--job", "gpt")
    assert shown.exit_code == 0 and "kv.key_bits" in shown.output

    resumed = run(live, "tuning", "resume", "--job", "gpt", "--by", "f", token=True)
    assert resumed.exit_code == 0 and "tuning running" in resumed.output
    assert ok_json(live, "tuning", "pause", "--job", "gpt", token=True)["tuning"] == "paused"

    status = ok_json(live, "status")
    job = {j["job"]: j for j in status["jobs"]}["gpt"]
    assert (job["state"], job["tuning"], job["mode"]) == ("attached", "paused", "suggest")
    assert kv["id"] in status["waiting"]
    table = run(live, "status")
    assert table.exit_code == 0 and "gpt" in table.output and kv["id"] in table.output


def test_token_from_the_environment(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEEDANCE_TOKEN", live.token_file.read_text().strip())
    result = run(live, "tuning", "resume", "--job", "gpt")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("args", "needles"), [
    (["approve", "abc", "--by", "x"], ["--token-file", "SEEDANCE_TOKEN"]),
    (["tuning", "pause", "--job", "gpt"], ["--token-file"]),
    (["changes", "show", "nope"], ["HTTP 404", "no change 'nope'"]),
    (["precision", "show", "--job", "ghost"], ["HTTP 404", "ghost"]),
])
def test_bad_input_is_one_line_and_exit_2(live: Live, args: list[str],
                                          needles: list[str]) -> None:
    one_line_error(run(live, *args), *needles)


@pytest.mark.parametrize(("args", "needles"), [
    (["approve", "nope", "--by", "x"], ["HTTP 404"]),
    (["precision", "set", "--job", "gpt", "ffn=fp64"], ["HTTP 422", "precision.ffn"]),
    (["precision", "set", "--job", "gpt", "ffn"], ["GROUP=PRECISION"]),
    (["kv", "set", "--job", "gpt", "bits=4"], ["HTTP 422", "unknown knob", "kv.bits"]),
    (["scheduler", "set", "--job", "gpt", "--rdma-enable=maybe"], ["--rdma-enable"]),
    (["scheduler", "set", "--job", "gpt", "--policy", "fast"], ["--policy"]),
    (["scheduler", "set", "--job", "gpt"], ["at least one"]),
    (["rollback", "--job", "gpt", "--by", "x", "--reason", "r"], ["HTTP 409", "no change"]),
    (["tuning", "pause", "--job", "other"], ["HTTP 409", "not enabled"]),
])
def test_bad_mutations_are_one_line_and_exit_2(live: Live, args: list[str],
                                               needles: list[str]) -> None:
    before = live.get("/v1/audit")
    one_line_error(run(live, *args, token=True), *needles)
    assert live.get("/v1/audit") == before


def test_wrong_token_is_refused_in_one_line(live: Live, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    result = CliRunner().invoke(app, ["approve", "abc", "--by", "x", "--sidecar", live.url,
                                      "--token-file", str(wrong)])
    one_line_error(result, "HTTP 403")
    missing = CliRunner().invoke(app, ["approve", "abc", "--by", "x", "--sidecar", live.url,
                                       "--token-file", str(tmp_path / "absent")])
    one_line_error(missing, "absent")


def test_unreachable_sidecar_is_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    one_line_error(CliRunner().invoke(app, ["status", "--sidecar", url]), "no sidecar answers",
                   url)
    one_line_error(CliRunner().invoke(app, ["changes", "list", "--sidecar", "nonsense"]))


def test_missing_required_option_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["reject", "abc", "--by", "x"])
    assert result.exit_code == 2 and "--reason" in result.output
    assert "Traceback" not in result.output


# ---- one configuration for every command, and the rough edges of #15 ----------------------


def _config_file(live: Live, tmp_path: Path, **extra: str) -> Path:
    """A config whose [sidecar] section says where the live sidecar listens."""
    lines = [f'listen = "{live.url.removeprefix("http://")}"',
             *(f'{k} = "{v}"' for k, v in extra.items())]
    path = tmp_path / "seedance.toml"
    path.write_text("[sidecar]\n" + "\n".join(lines) + "\n")
    return path


def _proposed(live: Live) -> str:
    change = ok_json(live, "precision", "set", "--job", "gpt", "ffn=bf16", token=True)
    return str(change["id"])


def test_approve_by_defaults_to_the_user_and_reads_the_config(
        live: Live, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config_file(live, tmp_path, token_file=str(live.token_file))
    monkeypatch.setenv("LOGNAME", "carol")  # what getpass reads first, then USER
    monkeypatch.setenv("USER", "carol")
    change_id = _proposed(live)
    result = CliRunner().invoke(app, ["approve", change_id, "-c", str(config), "--json"])
    assert result.exit_code == 0, result.output  # no --sidecar, --token-file, --by
    assert json.loads(result.stdout)["approved_by"] == "carol"


@pytest.mark.parametrize("how", ["SEEDANCE_CONFIG", "SEEDANCE_TOKEN_FILE"])
def test_token_and_sidecar_from_the_environment(live: Live, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                how: str) -> None:
    if how == "SEEDANCE_CONFIG":
        monkeypatch.setenv(how, str(_config_file(live, tmp_path,
                                                 token_file=str(live.token_file))))
    else:
        monkeypatch.setenv(how, str(live.token_file))
        monkeypatch.setenv("SEEDANCE_SIDECAR", live.url)
    change_id = _proposed(live)
    result = CliRunner().invoke(app, ["reject", change_id, "--reason", "not now", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state"] == "rejected"


def test_config_token_file_that_is_not_there_is_named(live: Live, tmp_path: Path) -> None:
    missing = tmp_path / "no-token"
    config = _config_file(live, tmp_path, token_file=str(missing))
    one_line_error(CliRunner().invoke(app, ["tuning", "pause", "--job", "gpt", "-c",
                                            str(config)]), "token_file", str(missing))


def test_a_flag_wins_over_the_config(live: Live, tmp_path: Path) -> None:
    config = tmp_path / "elsewhere.toml"
    config.write_text(f'[sidecar]\nlisten = "127.0.0.1:{free_port()}"\n')
    one_line_error(CliRunner().invoke(app, ["status", "-c", str(config)]), "no sidecar answers")
    result = CliRunner().invoke(app, ["status", "-c", str(config), "--sidecar", live.url])
    assert result.exit_code == 0, result.output


def test_unknown_job_names_the_near_matches(live: Live) -> None:
    one_line_error(run(live, "changes", "list", "--job", "gtp"), "unknown job 'gtp'",
                   "did you mean 'gpt'")
    assert ok_json(live, "changes", "list", "--job", "gpt") == []  # known, no changes yet


@pytest.mark.parametrize("url", ["127.0.0.1:4318", "localhost:4318"])
def test_sidecar_url_without_a_scheme_is_named(url: str) -> None:
    result = CliRunner().invoke(app, ["status", "--sidecar", url])
    one_line_error(result, "--sidecar", "expected http(s)://HOST:PORT", f"http://{url}")
    assert "running" not in result.output


def test_tables_stay_readable_at_80_columns(live: Live) -> None:
    """Regression: at 80 columns Rich cut every cell to a few letters and "…"."""
    change_id = _proposed(live)
    for args in (["status"], ["changes", "list"], ["changes", "show", change_id],
                 ["precision", "show", "--job", "gpt"]):
        result = CliRunner().invoke(app, [*args, "--sidecar", live.url],
                                    env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        table = [line for line in result.output.splitlines() if line[:1] in "┏┃┡│└"]
        assert table and max(map(len, table)) <= 80, result.output
        assert "…" not in result.output, result.output
    listed = CliRunner().invoke(app, ["changes", "list", "--sidecar", live.url],
                                env={"COLUMNS": "80"}).output
    assert change_id in listed and "operator" in listed and "live/high" in listed
