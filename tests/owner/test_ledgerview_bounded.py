"""What the ledger's view keeps of the last day does not grow with the number of attempts
(issue 44: a daemon that never grows): a node that runs a thousand short tasks a minute keeps the
same sums in memory and in its checkpoint as one that runs a few."""

from __future__ import annotations

import gc
import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from flashnode.owner.ledgerview import CHECKPOINT_FILE, CHUNK, RECENT, LedgerView

NOW = time.mktime((2027, 1, 15, 12, 0, 0, 0, 0, -1))  # local noon: the last hour is today


def line(ended: float, outcome: str = "committed") -> str:
    record: dict[str, Any] = {"outcome": outcome, "ended_at": ended}
    record["evidence"] = {"wall_seconds": 36.0}
    record["task_usage"] = {"cpu_percent_mean": 100.0}  # 0.01 core-hours each
    return json.dumps(record) + "\n"


def append(ledger: Path, count: int, outcome: str = "committed") -> None:
    """``count`` attempts ended over the last ten minutes."""
    with ledger.open("a") as fh:
        fh.writelines(line(NOW - 600 + i * 600 / count, outcome) for i in range(count))


def test_a_day_of_many_attempts_keeps_a_checkpoint_of_the_same_size(tmp_path: Path) -> None:
    ledger, checkpoint = tmp_path / "ledger.jsonl", tmp_path / CHECKPOINT_FILE
    append(ledger, 20)
    view = LedgerView(ledger, clock=lambda: NOW, checkpoint=checkpoint)
    view.save()
    few = checkpoint.stat().st_size
    append(ledger, 5000)
    append(ledger, 10, "failed")
    view.save()
    # One entry per attempt would be about 40 bytes each: 200 kB more. Only counts grew.
    assert checkpoint.stat().st_size - few < 400
    totals = view.totals()
    assert totals["all_time"]["tasks"] == totals["today"]["tasks"] == 5020
    assert totals["today"]["outcomes"] == {"committed": 5020, "failed": 10}
    assert totals["today"]["cpu_hours"] == pytest.approx(50.3)
    assert sum(n for _, n in view.per_bin(NOW - 3600, 300)) == 5020
    # A start from the checkpoint sees the same day.
    again = LedgerView(ledger, clock=lambda: NOW, checkpoint=checkpoint)
    assert again.totals() == totals
    assert again.per_bin(NOW - 3600, 300) == view.per_bin(NOW - 3600, 300)


def test_a_day_of_many_attempts_holds_no_more_memory_than_a_few(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    append(ledger, 2 * RECENT)  # the latest attempts' list full already
    view = LedgerView(ledger, clock=lambda: NOW)
    tracemalloc.start()
    try:
        view.refresh()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        append(ledger, 20_000)
        view.refresh()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # An object per attempt of the day would be about 160 bytes each: 3 MB.
    assert grown < 256 * 1024, grown
    assert view.totals()["today"]["tasks"] == 2 * RECENT + 20_000


def test_an_older_agents_checkpoint_of_one_entry_per_attempt_still_counts(tmp_path: Path) -> None:
    ledger, checkpoint = tmp_path / "ledger.jsonl", tmp_path / CHECKPOINT_FILE
    append(ledger, 3)
    all_time = {"tasks": 3, "outcomes": {"committed": 3}, "cpu_hours": 0.03, "gpu_hours": 0.0}
    day = [[NOW - 600 + i * 200, "committed", 0.01, 0.0] for i in range(3)]
    st = ledger.stat()
    old = {"version": 1, "inode": st.st_ino, "offset": st.st_size, "all_time": all_time}
    checkpoint.write_text(json.dumps(old | {"day": day, "hours": []}))
    view = LedgerView(ledger, clock=lambda: NOW, checkpoint=checkpoint)
    today = view.totals()["today"]
    assert today["tasks"] == 3 and today["cpu_hours"] == pytest.approx(0.03)
    assert sum(n for _, n in view.per_bin(NOW - 3600, 300)) == 3


def test_a_refresh_asks_for_no_more_than_was_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status and the console refresh the view every few seconds: each read asks for what
    was appended, never for a whole ``CHUNK`` (a 1 MiB block taken from glibc and given back at
    every poll, which left the agent's heaps resident in steps of about 1 MB: issue 44)."""
    ledger = tmp_path / "ledger.jsonl"
    append(ledger, 2 * RECENT)
    view = LedgerView(ledger, clock=lambda: NOW)
    asked: list[int] = []
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        asked.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read)
    view.refresh()
    assert asked and max(asked) <= min(CHUNK, ledger.stat().st_size)
    asked.clear()
    view.refresh()
    assert asked == []  # nothing appended: nothing asked for
    size = ledger.stat().st_size
    append(ledger, 20)
    view.refresh()
    assert asked == [ledger.stat().st_size - size]
    assert view.totals()["today"]["tasks"] == 2 * RECENT + 20
