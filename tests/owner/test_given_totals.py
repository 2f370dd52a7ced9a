"""What the node gave reads well for short work: a task's fraction of a second of CPU is kept in
the totals (status.json, the console) and said in seconds, never rounded away to "0 min"."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flashnode.owner.ledger import Ledger
from flashnode.owner.ledgerview import LedgerView
from flashnode.owner.status import given_time

NOW = time.mktime((2027, 1, 15, 12, 0, 0, 0, 0, -1))
# 0.42 s of running at half a core: 0.21 s of CPU (0.00006 core-hours).
SHORT = {
    "task_id": "t",
    "ended_at": NOW,
    "outcome": "committed",
    "evidence": {"wall_seconds": 0.42},
    "task_usage": {"cpu_percent_mean": 50.0},
}


def cpu_hours_today(path: Path) -> float:
    hours: float = LedgerView(path, clock=lambda: NOW, persist=False).totals()["today"]["cpu_hours"]
    return hours


def test_a_fraction_of_a_second_of_cpu_stays_in_the_totals_and_reads_as_seconds(
    tmp_path: Path,
) -> None:
    one = tmp_path / "one.jsonl"
    Ledger(one).append(SHORT)
    assert given_time(cpu_hours_today(one)) == "1 s"  # not "0 min"
    two = tmp_path / "two.jsonl"
    Ledger(two).append(SHORT)
    Ledger(two).append({**SHORT, "evidence": {"wall_seconds": 9.06}})  # 4.53 s more
    assert cpu_hours_today(two) * 3600 == pytest.approx(4.74, abs=0.01)
    assert given_time(cpu_hours_today(two)) == "5 s"
