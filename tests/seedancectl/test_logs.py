"""The sidecar's log lines: a repeated failure is shown once a minute with the count held
back, distinct failures and info lines always; a database that refuses is one line, a bug a
whole traceback; every line carries its time and source. Real ``logging`` records through
the real filter and formatter, on a stepped clock."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from seedancectl._logs import REPEAT_PERIOD_S, RepeatedRecords, SidecarFormatter


class SteppedClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO, SteppedClock]]:
    clock, out = SteppedClock(), io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(SidecarFormatter())
    handler.addFilter(RepeatedRecords(clock=clock))
    logger = logging.getLogger("tests.logs.sidecar")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(handler)
    try:
        yield logger, out, clock
    finally:
        logger.removeHandler(handler)


def refused() -> ConnectionRefusedError:
    try:
        raise ConnectionRefusedError("connection to server at 127.0.0.1 failed: refused")
    except ConnectionRefusedError as e:
        return e


def test_a_database_out_of_reach_is_one_line_and_a_bug_keeps_its_traceback(
        logged: tuple[logging.Logger, io.StringIO, SteppedClock], tmp_path: Path) -> None:
    logger, out, _ = logged
    (tmp_path / "dir").mkdir()
    engine = create_engine(f"sqlite:///{tmp_path / 'dir'}")  # a folder: SQLite cannot open it
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:
        logger.error("tuning loop failed; going on", exc_info=e)
    finally:
        engine.dispose()
    try:
        {}["missing"]
    except KeyError as e:
        logger.error("detector x failed", exc_info=e)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("ERROR tests.logs.sidecar: tuning loop failed; going on")
    assert lines[1].startswith("sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) "
                               "unable to open database file"), lines
    assert lines[1].endswith("(no traceback: a fault outside the sidecar)")
    assert "detector x failed" in lines[2] and lines[3] == "Traceback (most recent call last):"
    assert lines[-1] == "KeyError: 'missing'"


def test_a_failure_repeated_every_second_is_shown_once_a_minute_with_its_count(
        logged: tuple[logging.Logger, io.StringIO, SteppedClock]) -> None:
    logger, out, clock = logged
    for _ in range(45):  # a tuning round a second through a 45 s outage
        logger.error("tuning loop failed; going on", exc_info=refused())
        clock.now += 1.0
    assert out.getvalue().count("tuning loop failed") == 1
    assert out.getvalue().count("ConnectionRefusedError") == 1
    clock.now += REPEAT_PERIOD_S
    logger.error("tuning loop failed; going on", exc_info=refused())
    lines = [ln for ln in out.getvalue().splitlines() if "tuning loop failed" in ln]
    assert len(lines) == 2 and "[44 more like this in the last 105 s not shown]" in lines[1]
    assert out.getvalue().count("ConnectionRefusedError") == 2
    assert "Traceback" not in out.getvalue()  # a refused connection: one line each


def test_other_failures_and_info_lines_are_never_held_back(
        logged: tuple[logging.Logger, io.StringIO, SteppedClock]) -> None:
    logger, out, _ = logged
    for k in range(3):
        logger.warning("state DB write failed: %s", "refused")
        logger.warning("store not writable: %s", "disk full")
        logger.info("job train: trial %d released", k)
        logger.info("job train: trial %d released", k)
    text = out.getvalue()
    assert text.count("state DB write failed: refused") == 1
    assert text.count("store not writable: disk full") == 1
    assert all(text.count(f"trial {k} released") == 2 for k in range(3))


def test_the_same_message_with_another_error_is_shown(
        logged: tuple[logging.Logger, io.StringIO, SteppedClock]) -> None:
    logger, out, _ = logged
    logger.error("tuning loop failed; going on", exc_info=refused())
    try:
        raise OSError("No space left on device")
    except OSError as e:
        logger.error("tuning loop failed; going on", exc_info=e)
    assert out.getvalue().count("tuning loop failed") == 2
    assert out.getvalue().splitlines()[-1] == "OSError: No space left on device"


def test_the_sidecar_process_logs_timestamped_lines_from_its_packages_at_info() -> None:
    """``configure_sidecar_logging`` in a process of its own (it sets the root logger)."""
    code = ("import logging\n"
            "from seedancectl._logs import configure_sidecar_logging\n"
            "configure_sidecar_logging()\n"
            "configure_sidecar_logging()\n"  # a second call replaces the handler
            "logging.getLogger('tuner._search').info('trial 3 released')\n"
            "logging.getLogger('urllib3').info('a library chatting')\n"
            "logging.getLogger('urllib3').warning('a library warning')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stderr
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    assert re.match(stamp + r"INFO tuner\._search: trial 3 released$", lines[0]), lines
    assert re.match(stamp + r"WARNING urllib3: a library warning$", lines[1]), lines


def test_threads_logging_at_once_each_show_a_kind_once(
        logged: tuple[logging.Logger, io.StringIO, SteppedClock]) -> None:
    """The API, tuning, policy and heartbeat threads log the same outage at once (a handler
    runs its filters outside its lock, so the filter holds its own)."""
    logger, out, _ = logged

    def log_many(k: int) -> None:
        for i in range(300):
            logger.warning("state DB write failed: refused")
            logger.warning("thread %d failure %d", k, i % 100)

    threads = [threading.Thread(target=log_many, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    assert sum("state DB write failed" in ln for ln in lines) == 1
    assert len(lines) == 1 + 8 * 100
