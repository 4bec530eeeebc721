"""The evidence plot's series: which metric, which points, how they are thinned; the router."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from collectors._points import CONFIG_VERSION_ATTR, Point
from collectors._store import TimeSeriesStore
from dashboards.web import web_router
from dashboards.web._series import change_series, triggering_metric
from policies._state_db import sqlite_url
from tuner._change import Change
from tuner._knobs import Knob
from tuner._lease import JobRegistry
from tuner._measure import JOB_ATTR, RANK_ATTR, TOKENS_PER_SECOND
from tuner._rollout import RolloutController
from tuner._windows import Window

T0_S = float(int(time.time()) - 3600)
"""An hour ago: recent enough for the store's raw retention."""


def change(**fields: object) -> Change:
    base: dict[str, object] = dict(
        id="c1", job="train", state="proposed", source="finding", reason="slow", risk="low",
        scope="live", values={"micro_batch": 4}, baseline={"micro_batch": 2},
        created_at_s=T0_S, expires_at_s=T0_S + 3600)
    base.update(fields)
    return Change(**base)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TimeSeriesStore]:
    with TimeSeriesStore(tmp_path / "metrics.db") as s:
        yield s


def write(store: TimeSeriesStore, name: str, job: str, times_s: Sequence[float] | np.ndarray,
          values: Sequence[float] | np.ndarray, **attrs: str) -> None:
    store.write(Point(name=name, value=float(v), time_ns=int(t * 1e9),
                      attributes={JOB_ATTR: job, **attrs}) for t, v in zip(times_s, values, strict=True))


def test_default_metric_is_throughput_and_a_named_one_wins() -> None:
    assert triggering_metric(change()) == (TOKENS_PER_SECOND, "default")
    named = change(meta={"metric": "seedance.train.loss"})
    assert triggering_metric(named) == ("seedance.train.loss", "change")


def test_points_of_the_job_around_the_proposal_one_line_per_rank(
        store: TimeSeriesStore) -> None:
    rng = np.random.default_rng(1)
    times = T0_S - 300 + np.arange(120) * 5.0  # 300 s before to 300 s after the proposal
    for rank in ("0", "1"):
        for version, part in (("3", times[:60]), ("4", times[60:])):
            write(store, TOKENS_PER_SECOND, "train", part, rng.uniform(900, 1100, part.size),
                  **{RANK_ATTR: rank, CONFIG_VERSION_ATTR: version})
    write(store, TOKENS_PER_SECOND, "other-job", times, np.full(times.size, 1.0))
    write(store, TOKENS_PER_SECOND, "train", [T0_S - 10_000], [5.0], **{RANK_ATTR: "0"})

    body = change_series(change(), store, now_s=T0_S + 300, lookback_s=600)

    assert body["metric"] == TOKENS_PER_SECOND and body["unit"] == "{token}/s"
    assert [line["label"] for line in body["series"]] == [f"{RANK_ATTR}=0", f"{RANK_ATTR}=1"]
    for line in body["series"]:
        # versions do not split a line; the other job and the point before the range are out
        assert len(line["points"]) == times.size
        assert all(900 <= v <= 1100 for _, v in line["points"])
        assert [t for t, _ in line["points"]] == pytest.approx(list(times))
    assert body["marks"] == [{"t_s": T0_S, "label": "proposed"}]


def test_thinning_keeps_the_mean_and_at_most_max_points(store: TimeSeriesStore) -> None:
    times = T0_S - 500 + np.arange(1000) * 0.5
    values = np.sin(np.arange(1000) / 50.0) * 100 + 500
    write(store, TOKENS_PER_SECOND, "train", times, values)

    body = change_series(change(), store, now_s=T0_S + 100, lookback_s=600, max_points=50)

    (line,) = body["series"]
    assert 2 <= len(line["points"]) <= 50
    got_t = np.array([t for t, _ in line["points"]])
    got_v = np.array([v for _, v in line["points"]])
    assert np.all(np.diff(got_t) > 0)
    assert got_v.min() >= values.min() and got_v.max() <= values.max()
    # equal-count buckets here, so the mean of bucket means is the mean of the points
    assert got_v.mean() == pytest.approx(values.mean(), rel=0.02)


def test_non_finite_values_become_gaps(store: TimeSeriesStore) -> None:
    times = T0_S - 60 + np.arange(6) * 10.0
    write(store, "seedance.train.loss", "train", times, np.array([2.0, 1.9, math.nan,
                                                                  math.inf, 1.7, 1.6]))
    body = change_series(change(meta={"metric": "seedance.train.loss"}), store,
                         now_s=T0_S + 60)
    values = [v for _, v in body["series"][0]["points"]]
    assert values == [2.0, 1.9, None, None, 1.7, 1.6]


def test_a_finished_change_ends_after_its_last_window(store: TimeSeriesStore) -> None:
    window = Window(version=5, arm="candidate", steps=10, step_s=0.1, tokens_per_s=1000.0,
                    loss=2.0, nonfinite_loss=False, start_ns=int((T0_S + 10) * 1e9),
                    end_ns=int((T0_S + 40) * 1e9))
    body = change_series(change(state="kept", windows=(window,)), store,
                         now_s=T0_S + 86_400)
    assert body["until_s"] == pytest.approx(T0_S + 40 + 60)
    assert body["windows"] == [{"arm": "candidate", "version": 5,
                                "start_s": pytest.approx(T0_S + 10),
                                "end_s": pytest.approx(T0_S + 40), "running": False}]


def test_an_observed_change_shows_its_running_window_up_to_now(store: TimeSeriesStore) -> None:
    plan = {"arms": ["candidate", "baseline", "candidate"], "index": 1, "version": 7,
            "acked": True, "acked_at_s": T0_S + 50, "applied_at_s": T0_S + 20}
    body = change_series(change(state="observing", plan=plan), store, now_s=T0_S + 80)
    assert body["windows"] == [{"arm": "baseline", "version": 7, "start_s": T0_S + 50,
                                "end_s": T0_S + 80, "running": True}]
    assert body["marks"] == [{"t_s": T0_S, "label": "proposed"},
                             {"t_s": T0_S + 20, "label": "applied"}]
    # Sent but not acked yet: no window is running, nothing is drawn for it.
    waiting = change_series(change(state="observing", plan={**plan, "acked": False}), store,
                            now_s=T0_S + 80)
    assert waiting["windows"] == []


class Parts:
    def __init__(self, reader: TimeSeriesStore | None,
                 controller: RolloutController | None) -> None:
        self.reader, self.controller = reader, controller


def test_router_serves_the_page_and_the_series(store: TimeSeriesStore, tmp_path: Path) -> None:
    registry = JobRegistry()
    registry.attach("train", knobs=[Knob(name="micro_batch", default=2, choices=(1, 2, 4))],
                    baseline={"micro_batch": 2})
    controller = RolloutController(registry, store, db_url=sqlite_url(tmp_path / "s.db"))
    proposed = controller.propose("train", {"micro_batch": 4}, reason="r", source="operator")
    write(store, TOKENS_PER_SECOND, "train", np.array([proposed.created_at_s - 1]),
          np.array([42.0]))
    app = FastAPI()
    app.include_router(web_router(Parts(store, controller)))
    client = TestClient(app)

    page = client.get("/ui/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/secret.py").status_code == 404
    assert client.get("/", follow_redirects=False).headers["location"] == "/ui/"

    body = client.get(f"/v1/changes/{proposed.id}/series").json()
    assert body["series"][0]["points"][0][1] == 42.0
    assert client.get("/v1/changes/nope/series").status_code == 404
    controller.close()

    down = FastAPI()
    down.include_router(web_router(Parts(None, None)))
    assert TestClient(down).get("/v1/changes/x/series").status_code == 503
