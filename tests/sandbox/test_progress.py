"""How far a task says it got: the newest step in its ``out/metrics.jsonl``, read beneath the
workspace without following anything the task put there."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flashnode.sandbox.progress import TAIL_BYTES, newest_metrics_step
from flashnode.sandbox.workspace import Workspace


def workspace(tmp_path: Path) -> Workspace:
    return Workspace.create(tmp_path / "attempts", "lease-1")


def log(ws: Workspace, *records: object, tail: str = "") -> None:
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (ws.out / "metrics.jsonl").write_text(text)


def test_the_newest_step_is_the_last_record_that_has_one(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    assert newest_metrics_step(ws) is None
    log(ws, {"step": 1, "loss": 2.0}, {"step": 7, "loss": 1.0}, {"final": True})
    assert newest_metrics_step(ws) == 7


def test_a_half_written_line_is_passed_over_for_the_one_before(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    log(ws, {"step": 3}, tail='{"step": 4, "lo')
    assert newest_metrics_step(ws) == 3


def test_steps_that_are_not_whole_numbers_say_nothing(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    log(ws, {"step": 2}, {"step": True}, {"step": -1}, {"step": "9"}, {"step": 1.5}, [1])
    assert newest_metrics_step(ws) == 2


def test_only_the_tail_of_a_long_log_is_read(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    records = [{"step": i, "pad": "x" * 100} for i in range(2000)]
    log(ws, *records)
    assert (ws.out / "metrics.jsonl").stat().st_size > 10 * TAIL_BYTES
    assert newest_metrics_step(ws) == 1999


def test_a_symlinked_log_or_out_dir_is_not_followed(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(json.dumps({"step": 99}) + "\n")
    (ws.out / "metrics.jsonl").symlink_to(elsewhere)
    assert newest_metrics_step(ws) is None

    other = tmp_path / "other-out"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 98}) + "\n")
    (ws.out / "metrics.jsonl").unlink()
    os.rename(ws.out, tmp_path / "moved-out")
    ws.out.symlink_to(other)
    assert newest_metrics_step(ws) is None


def test_a_fifo_in_its_place_neither_blocks_nor_counts(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    os.mkfifo(ws.out / "metrics.jsonl")
    assert newest_metrics_step(ws) is None


def test_a_log_the_tasks_user_does_not_own_is_not_read(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    log(ws, {"step": 5})
    ws.task_uid = os.getuid() + 1  # out/ is another user's: this file is not the task's
    assert newest_metrics_step(ws) is None
    ws.task_uid = os.getuid()
    assert newest_metrics_step(ws) == 5
