"""Series rows' counts and spans written lazily: what a reader relies on always holds (the
first time exact, the last within the slack, the count exact after a sync), while a busy
writer updates each row about once per sync instead of at every flush."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from collectors import TimeSeriesStore
from collectors._series_spans import SPAN_SLACK_NS, SYNC_EVERY_S, SeriesSpans, SpanUpdate

NS = 1_000_000_000
T0 = 1_700_000_000 * NS


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _apply(rows: dict[int, list[int]], update: SpanUpdate) -> None:
    """What the flush's UPDATE does to the series table."""
    for sid, n, first, last in update.rows:
        row = rows.setdefault(sid, [0, first, last])
        row[0] += n
        row[1], row[2] = min(row[1], first), max(row[2], last)


def test_rows_stay_readable_and_are_written_about_once_a_sync() -> None:
    rng = np.random.default_rng(7)
    clock = _Clock()
    spans = SeriesSpans(clock=clock)
    table: dict[int, list[int]] = {}
    truth: dict[int, list[int]] = {}
    written = flushed_series = late_points = 0
    for flush in range(400):  # ten flushes a second for 40 s, 64 series, a late point now and then
        clock.now = flush / 10
        sids = np.sort(rng.choice(64, size=rng.integers(1, 64), replace=False)).astype(np.int64)
        counts = rng.integers(1, 5, size=sids.shape[0])
        lasts = T0 + int(clock.now * NS) + rng.integers(0, NS // 10, size=sids.shape[0])
        firsts = lasts - rng.integers(0, NS // 5, size=sids.shape[0])
        late = rng.random(sids.shape[0]) < 0.01
        firsts[late] -= 30 * NS
        late_points += int(late.sum())
        update = spans.update(sids, counts, firsts, lasts)
        if flush % 7 == 3:  # a flush whose transaction rolled back: asked again, same answer
            assert spans.update(sids, counts, firsts, lasts).rows == update.rows
        spans.committed(update)
        _apply(table, update)
        written += len(update.rows)
        flushed_series += sids.shape[0]
        for sid, n, first, last in zip(sids.tolist(), counts.tolist(), firsts.tolist(),
                                       lasts.tolist(), strict=True):
            row = truth.setdefault(sid, [0, first, last])
            row[0] += n
            row[1], row[2] = min(row[1], first), max(row[2], last)
        for sid, (_, first, last) in truth.items():
            assert table[sid][1] == first  # a range's series filter never misses its start
            assert last - SPAN_SLACK_NS <= table[sid][2] <= last  # nor its end, widened
    final = spans.update(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64),
                         np.empty(0, np.int64), sync=True)
    spans.committed(final)
    _apply(table, final)
    assert table == truth  # after a sync every count and span is exact
    assert not spans.waiting
    # each row about once per sync interval (plus its first sight and late points), not at
    # every flush
    syncs = 40 / SYNC_EVERY_S
    assert written <= 64 * (syncs + 2) + late_points < flushed_series / 3


def test_a_window_after_a_deferred_flush_reads_the_newest_points(tmp_path: Path) -> None:
    """A background flush leaves the series row's last time behind its points; a window that
    starts after that time still reads them, and once the sync interval has passed the flush
    loop makes the counts exact even with nothing new to commit."""
    store = TimeSeriesStore(tmp_path / "s.db", flush_interval_s=3600)
    try:
        store.write_series("m", {"rank": "0"}, T0 + np.arange(2) * NS, np.zeros(2))
        store.flush()
        store.write_series("m", {"rank": "0"}, T0 + np.arange(2, 6) * NS, np.arange(2.0, 6.0))
        store._writer.flush(sync_spans=False)  # what the background flusher does
        assert store.metrics()["points"].tolist() == [2]  # the row's count waits
        frame = store.query("m", since_ns=T0 + 3 * NS, until_ns=T0 + 6 * NS, resolution="raw")
        assert frame["value"].tolist() == [3.0, 4.0, 5.0]
        store._writer._spans._clock = lambda: float("inf")  # the sync interval has passed
        store._writer.flush(sync_spans=False)  # the flush loop's call, with nothing buffered
        assert store.metrics()["points"].tolist() == [6]
        assert store.metrics()["last"].iloc[0].value == T0 + 5 * NS
    finally:
        store.close()


def test_rows_waiting_when_the_writes_stop_are_synced_by_the_next_empty_flush() -> None:
    clock = _Clock()
    spans = SeriesSpans(clock=clock)
    one = np.array([1], dtype=np.int64)
    spans.committed(spans.update(one, one, one * T0, one * T0))  # first sight: written
    spans.committed(spans.update(one, one, one * T0 + NS, one * T0 + NS))  # waits
    assert spans.waiting and not spans.due
    clock.now = SYNC_EVERY_S
    assert spans.due  # the writer's flush loop syncs now, with nothing else to commit
