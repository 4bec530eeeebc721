"""The points journal's view: a journal of many flushes read as a few runs, each query giving
every series' points in arrival order, as one sort of the whole journal would."""

from __future__ import annotations

import math
import random
import sqlite3
from pathlib import Path

import numpy as np

from collectors._store_file import _JOURNAL_TABLES
from collectors._store_points_journal import PointsJournalView, append, sort_columns


def journal(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.execute(_JOURNAL_TABLES["points_journal"])
    return conn


def test_many_flushes_read_as_one_sort_would_in_few_runs(tmp_path: Path) -> None:
    rng = random.Random(5)
    conn = journal(tmp_path / "j.db")
    view = PointsJournalView()
    flushes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for flush in range(100):
        n = rng.randint(1, 400)
        series = np.array([rng.randrange(60) for _ in range(n)], np.int64)
        times = np.arange(flush * 1000, flush * 1000 + n, dtype=np.int64)
        values = np.array([rng.random() for _ in range(n)])
        append(conn, *sort_columns(series, times, values))
        flushes.append((series, times, values))
        if flush % 7 == 0 or flush == 99:  # queried between flushes, as a policy pass does
            sids = sorted(rng.sample(range(70), 20))
            got = view.of_series(conn, sids)
            everything = [np.concatenate([f[k] for f in flushes]) for k in range(3)]
            for sid in sids:
                mine = everything[0] == sid
                if not mine.any():
                    assert sid not in got
                    continue
                times, values = got[sid]
                assert np.array_equal(times, everything[1][mine])  # arrival order
                assert np.array_equal(values, everything[2][mine])
            assert len(view.runs(conn)) <= math.log2(flush + 1) + 1
    series, times, values = view.columns(conn)
    everything = [np.concatenate([f[k] for f in flushes]) for k in range(3)]
    order = np.lexsort((everything[1], everything[0]))  # times grow with arrival here
    assert np.array_equal(series, everything[0][order])
    assert np.array_equal(times, everything[1][order])
    assert np.array_equal(values, everything[2][order])


def test_a_fold_starts_the_runs_again(tmp_path: Path) -> None:
    conn = journal(tmp_path / "j.db")
    view = PointsJournalView()
    for flush in range(5):
        append(conn, np.array([1, 2], np.int64), np.array([flush, flush], np.int64),
               np.array([0.5, 1.5]))
    assert view.of_series(conn, [2])[2][0].tolist() == [0, 1, 2, 3, 4]
    conn.execute("DELETE FROM points_journal")  # the fold
    assert view.of_series(conn, [1, 2]) == {}
    append(conn, np.array([2], np.int64), np.array([9], np.int64), np.array([2.5]))
    times, values = view.of_series(conn, [2])[2]
    assert times.tolist() == [9] and values.tolist() == [2.5]
