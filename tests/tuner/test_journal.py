"""The change journal: one owner of changes and their audit trail, free of side effects."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import create_engine, inspect

from tuner import Change, ChangeCursor, ChangeJournal, IllegalTransition, RolloutError


def a_change(change_id: str = "c1", *, at_s: float = 100.0) -> Change:
    return Change(id=change_id, job="train", state="proposed", source="operator", reason="r",
                  risk="low", scope="live", values={"micro_batch": 4},
                  baseline={"micro_batch": 8}, created_at_s=at_s, expires_at_s=at_s + 60)


def test_a_reader_of_a_missing_journal_sees_nothing_and_creates_nothing(state_db_url: str) -> None:
    url = state_db_url
    journal = ChangeJournal(url, create=False)
    assert journal.changes() == [] and journal.events() == []
    assert journal.mode("train") is None
    with pytest.raises(RolloutError, match="no change 'c1'"):
        journal.get("c1")
    journal.close()
    engine = create_engine(url)
    assert inspect(engine).get_table_names() == []  # the reader left the database as it was
    engine.dispose()


def test_a_reader_sees_what_a_writer_journaled_later(state_db_url: str) -> None:
    url = state_db_url
    reader = ChangeJournal(url, create=False)
    assert reader.changes() == []
    writer = ChangeJournal(url, clock=lambda: 100.0)
    writer.add(a_change(), actor="alice", reason="try mb4", version_before=3,
               detail={"values": {"micro_batch": 4}})
    (change,) = reader.changes()
    assert change.id == "c1"
    (event,) = reader.events(change_id="c1")
    assert (event["kind"], event["actor"], event["version_before"]) == ("proposed", "alice", 3)
    assert event["detail"] == {"values": {"micro_batch": 4}}


def test_changes_are_oldest_first_even_when_the_clock_stands_still(state_db_url: str) -> None:
    journal = ChangeJournal(state_db_url, clock=lambda: 100.0)
    for change_id in ("b", "a", "c"):  # ids out of order, one timestamp
        journal.add(a_change(change_id), actor="t", reason="r", version_before=None, detail={})
    assert [c.id for c in journal.changes()] == ["b", "a", "c"]


def test_pages_of_changes_follow_each_other_in_order_under_any_filter(state_db_url: str) -> None:
    journal = ChangeJournal(state_db_url, clock=lambda: 100.0)  # one timestamp, ids out of order
    for i, change_id in enumerate("gfedcba"):
        change = replace(a_change(change_id), job=("train", "serve")[i % 2])
        journal.add(change, actor="t", reason="r", version_before=None, detail={})
        if i % 3 == 0:
            journal.move(change, replace(change, state="approved"), actor="t", reason="r")
    for job, states in ((None, None), ("train", None), (None, ["proposed"]),
                        ("serve", ["approved", "proposed"]), ("nobody", None)):
        whole = [c.id for c in journal.changes(job=job, states=states)]
        for limit in (1, 2, 3, len(whole) or 1, 50):
            paged: list[str] = []
            cursor = None
            while True:
                page, cursor = journal.changes_page(job=job, states=states, after=cursor,
                                                    limit=limit)
                assert 0 < len(page) <= limit or not whole
                paged += [c.id for c in page]
                if cursor is None:
                    break
                assert ChangeCursor.parse(cursor.to_text()) == cursor
            assert paged == whole, (job, states, limit)
    assert journal.changes_page(limit=7)[1] is None  # a page that holds the rest is the last


@pytest.mark.parametrize("text", ["", "12", "abc-c1", "-c1", "12-"])
def test_a_cursor_that_is_not_one_says_so(text: str) -> None:
    with pytest.raises(RolloutError, match="is not a cursor"):
        ChangeCursor.parse(text)
def test_state_counts_are_the_states_of_every_change(state_db_url: str) -> None:
    assert ChangeJournal(state_db_url, create=False).state_counts() == {}
    journal = ChangeJournal(state_db_url)
    for change_id, state in (("a", None), ("b", "approved"), ("c", "rejected"),
                             ("d", "approved"), ("e", None)):
        change = a_change(change_id)
        journal.add(change, actor="t", reason="r", version_before=None, detail={})
        if state is not None:
            journal.move(change, replace(change, state=state), actor="t", reason="r")
    assert journal.state_counts() == {"approved": 2, "proposed": 2, "rejected": 1}

def test_a_move_is_refused_when_someone_moved_the_change_first(state_db_url: str) -> None:
    journal = ChangeJournal(state_db_url)
    change = a_change()
    journal.add(change, actor="t", reason="r", version_before=None, detail={})
    approved = replace(change, state="approved")
    journal.move(change, approved, actor="alice", reason="ok")
    with pytest.raises(IllegalTransition, match="moved under us"):
        journal.move(change, replace(change, state="rejected"), actor="bob", reason="no")
    assert journal.get("c1").state == "approved"
    assert [e["kind"] for e in journal.events()] == ["proposed", "approved"]  # no stray event


def test_a_save_is_refused_when_someone_moved_the_change_first(state_db_url: str) -> None:
    """A controller saving a change's plan must not write back a state it no longer has."""
    journal = ChangeJournal(state_db_url)
    change = a_change()
    journal.add(change, actor="t", reason="r", version_before=None, detail={})
    journal.move(change, replace(change, state="rejected"), actor="bob", reason="no")
    with pytest.raises(IllegalTransition, match="moved under us"):
        journal.save(replace(change, plan={"index": 1}), event=("ack", "late", 2))
    assert journal.get("c1").state == "rejected" and journal.get("c1").plan == {}
    assert [e["kind"] for e in journal.events()] == ["proposed", "rejected"]


def test_modes_and_free_events_are_in_the_audit_log(state_db_url: str) -> None:
    journal = ChangeJournal(state_db_url)
    journal.set_mode("train", "suggest", actor="ops", reason="", old="auto")
    journal.set_mode("train", "auto", actor="ops", reason="", old="suggest")  # an upsert
    journal.record("train", "notified", "webhook", "delivered", change_id="c9",
                   detail={"delivered": True, "score": float("nan")})
    assert journal.mode("train") == "auto"
    _, mode, notified = journal.events(job="train")
    assert (mode["kind"], mode["reason"], mode["detail"]) == (
        "mode", "suggest -> auto", {"from": "suggest", "to": "auto"})
    assert notified["change_id"] == "c9" and notified["detail"]["score"] == "nan"
