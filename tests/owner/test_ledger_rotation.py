"""The ledger is bounded (a daemon that never grows): past its size it is rotated, one generation
kept; `history` reads across the two, and the view's all-time sums go on across a rotation, live
and from a checkpoint saved before it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from flashnode.owner import ledger as ledger_module
from flashnode.owner.ledger import Ledger, rotated
from flashnode.owner.ledgerview import CHECKPOINT_FILE, LedgerView

NOW = time.mktime((2027, 1, 15, 12, 0, 0, 0, 0, -1))
LINE = len(json.dumps({"task_id": "00", "ended_at": NOW, "outcome": "committed"}) + "\n")


def write(ledger: Ledger, first: int, count: int) -> None:
    for n in range(first, first + count):
        ledger.append({"task_id": f"{n:02}", "ended_at": NOW, "outcome": "committed"})


def ids(records: list[dict[str, object]]) -> list[int]:
    return [int(str(r["task_id"])) for r in records]


def test_the_ledger_is_rotated_past_its_size_and_keeps_one_generation(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    write(ledger, 0, 35)
    # Rotated at the first line written once it holds 10 lines' worth.
    assert path.stat().st_size <= 10 * LINE
    assert rotated(path).stat().st_size == 10 * LINE
    assert not (tmp_path / "ledger.jsonl.2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.jsonl", "ledger.jsonl.1"]
    # The newest lines are all there, in order, across the two files.
    assert ids(ledger.records(last=12)) == list(range(23, 35))
    assert ids(ledger.records()) == list(range(20, 35))


def test_the_views_sums_go_on_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    view = LedgerView(path, clock=lambda: NOW)
    write(ledger, 0, 7)
    assert view.totals()["all_time"]["tasks"] == 7
    write(ledger, 7, 8)  # rotated after its tenth: three lines it had not read yet went with it
    assert view.totals()["all_time"]["tasks"] == 15
    assert ids(view.latest(limit=3)) == [14, 13, 12]


def test_a_view_started_from_a_checkpoint_of_the_rotated_ledger_reads_its_rest(
    tmp_path: Path,
) -> None:
    path, checkpoint = tmp_path / "ledger.jsonl", tmp_path / CHECKPOINT_FILE
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    write(ledger, 0, 6)
    first = LedgerView(path, clock=lambda: NOW, checkpoint=checkpoint)
    first.save()  # the agent stops, its sums saved at line 6
    write(ledger, 6, 9)  # an agent that crashed before it saved: rotated meanwhile
    again = LedgerView(path, clock=lambda: NOW, checkpoint=checkpoint)
    assert again.totals()["all_time"]["tasks"] == 15


def test_a_ledger_replaced_by_another_file_is_read_from_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    write(ledger, 0, 5)
    view = LedgerView(path, clock=lambda: NOW)
    assert view.totals()["all_time"]["tasks"] == 5
    path.unlink()  # not a rotation: the owner removed it
    write(ledger, 5, 2)
    assert view.totals()["all_time"]["tasks"] == 2


def test_a_view_without_a_checkpoint_counts_the_rotated_ledger_too(tmp_path: Path) -> None:
    """`flashnode status` of a stopped agent, run by a member of group flashnode: the ledgers
    are theirs to read, the checkpoint (root's alone) is not. The sums are of both files."""
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    write(ledger, 0, 15)
    unreadable = tmp_path / "none" / CHECKPOINT_FILE
    view = LedgerView(path, clock=lambda: NOW, checkpoint=unreadable, persist=False)
    assert view.totals()["all_time"]["tasks"] == 15
    assert ids(view.latest(limit=20)) == list(range(14, -1, -1))
    assert LedgerView(path, clock=lambda: NOW).totals()["all_time"]["tasks"] == 15


def test_a_view_started_just_after_a_rotation_shows_the_latest_attempts_of_both(
    tmp_path: Path,
) -> None:
    path, checkpoint = tmp_path / "ledger.jsonl", tmp_path / CHECKPOINT_FILE
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    write(ledger, 0, 12)  # rotated at the eleventh: two lines in the new ledger
    LedgerView(path, clock=lambda: NOW, checkpoint=checkpoint).save()
    again = LedgerView(path, clock=lambda: NOW, checkpoint=checkpoint)
    assert again.totals()["all_time"]["tasks"] == 12
    assert ids(again.latest(limit=5)) == [11, 10, 9, 8, 7]


def test_a_ledger_that_cannot_be_rotated_is_still_written(tmp_path: Path) -> None:
    """A rotation refused (here: ``ledger.jsonl.1`` is a directory) must not stop the ledger:
    its lines are written past the bound, not kept in memory until they are dropped."""
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    rotated(path).mkdir()
    (rotated(path) / "kept").write_bytes(b"")
    write(ledger, 0, 15)
    assert ledger.pending == 0
    assert ids(ledger.records()) == list(range(15))
    view = LedgerView(path, clock=lambda: NOW)
    assert view.totals()["all_time"]["tasks"] == 15


def test_history_read_while_the_ledger_rotates_has_each_line_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flashnode history` beside the agent: the agent rotates the ledger between the history's
    read of the ledger and of the rotated one."""
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, rotate_bytes=10 * LINE)
    write(ledger, 0, 10)
    reader = Ledger(path)
    real_open = ledger_module.os.open
    opened: list[str] = []

    def open_then_rotate(name: object, *args: Any, **kwargs: Any) -> int:
        fd = real_open(name, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(str(name))
        if str(name) == str(path) and len(opened) == 1:
            write(ledger, 10, 1)  # the agent, meanwhile: rotated, and a line in the new one
        return fd

    monkeypatch.setattr(ledger_module.os, "open", open_then_rotate)
    got = ids(reader.records())
    monkeypatch.undo()
    assert sorted(got) == got and len(set(got)) == len(got), got
