"""The findings table: save, reload after reopening, one active finding per key."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies import DuplicateFindingError, Evidence, Finding, FindingStore, sqlite_url


def _finding(fid: str, opened: int, *, gpu: str = "0", closed: int | None = None) -> Finding:
    return Finding(id=fid, detector="d", job="j", severity="warning", resource={"gpu": gpu},
                   evidence=Evidence(summary="s", model="m"), opened_at_ns=opened,
                   closed_at_ns=closed)


def test_save_update_and_reopen(state_db_url: str) -> None:
    url = state_db_url
    with FindingStore(url) as db:
        db.save(_finding("a", 1))
        db.save(_finding("b", 2, gpu="1"))
        db.save(_finding("a", 1, closed=5))  # update in place
    with FindingStore(url) as db:
        assert [f.id for f in db.active()] == ["b"]
        assert [f.id for f in db.history(job="j")] == ["a", "b"]
        assert db.history(since_ns=2) == [_finding("b", 2, gpu="1")]
        assert db.get("a") == _finding("a", 1, closed=5)
        assert db.get("zzz") is None


def test_one_active_finding_per_key(state_db_url: str) -> None:
    with FindingStore(state_db_url) as db:
        db.save(_finding("a", 1))
        with pytest.raises(DuplicateFindingError, match="already open"):
            db.save(_finding("b", 2))  # same detector, job and resource, both open
        db.save(_finding("a", 1, closed=3))
        db.save(_finding("b", 4))  # fine once the first is closed


def test_a_sqlite_files_folder_is_created(tmp_path: Path) -> None:
    with FindingStore(sqlite_url(tmp_path / "nested" / "state.db")) as db:
        db.save(_finding("a", 1))
    assert (tmp_path / "nested" / "state.db").is_file()


def test_unopened_findings_are_refused(tmp_path: Path) -> None:
    with FindingStore(sqlite_url(tmp_path / "state.db")) as db, \
            pytest.raises(ValueError, match="opened"):
        db.save(Finding(detector="d", job="j", severity="info",
                        evidence=Evidence(summary="s", model="m")))
