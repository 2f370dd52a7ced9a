"""The owner's commands: pause / resume, logs [-f], and history's task-scoped figures."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flashnode.cli import common
from flashnode.cli.controls import Clean, tail
from flashnode.cli.main import main
from flashnode.node.controls import Controls
from flashnode.node.rules import Readers, Rules
from flashnode.owner import pausefile
from flashnode.owner.ledger import Ledger
from tests.harness import wait_for


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={"FLASHNODE_STATE_DIR": None})
    return result.exit_code, result.output


@pytest.fixture
def flashnode() -> Callable[..., Any]:
    """The flashnode program, run as a process (a test that uses it is an integration test)."""
    return _cli


# --- pause and resume ------------------------------------------------------------------------


def test_pause_for_a_duration_then_resume(flashnode: Callable[..., Any], tmp_path: Path) -> None:
    state = tmp_path / "state"
    before = time.time()
    code, out = flashnode("pause", "--for", "2h", "--state-dir", str(state))
    assert code == 0, out
    assert "paused until" in out and "running tasks finish" in out
    assert "no agent is running" in out
    pause = pausefile.read(state)
    assert pause is not None and pause.mode == "drain" and pause.until is not None
    assert before + 7200 <= pause.until <= time.time() + 7200
    assert (state / "pause.json").stat().st_mode & 0o777 == 0o640

    code, out = flashnode("resume", "--state-dir", str(state))
    assert (code, out.splitlines()[0]) == (0, "resumed")
    assert pausefile.read(state) is None
    assert flashnode("resume", "--state-dir", str(state)) == (0, "not paused\n")


def test_pause_for_says_when_it_ends_with_its_zone_and_how_far(
    flashnode: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        code, out = flashnode("pause", "--for", "2h", "--state-dir", str(tmp_path))
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert code == 0, out
    pause = pausefile.read(tmp_path)
    assert pause is not None and pause.until is not None
    minutes = time.strftime("%M", time.gmtime(pause.until))  # New York is whole hours off UTC
    first = out.splitlines()[0]
    assert (" EST " in first or " EDT " in first) and "(in 2h00m)" in first, first
    assert first.startswith("paused until ") and f":{minutes} " in first, first


def test_pause_now_is_seen_by_an_agent_started_later(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    """The pause lives in the state dir: a (re)started agent's controls read it from there."""
    code, out = flashnode("pause", "--now", "--state-dir", str(tmp_path))
    assert code == 0 and "stopped and their leases left to lapse" in out, out
    assert "given back" not in out  # status, history and the ledger call it lapsed
    restarted = Controls(Rules(), Readers(pause=pausefile.PauseReader(tmp_path)), _Clock())
    d = restarted.evaluate()
    assert not d.may_claim and d.stop_reason is not None and "flashnode resume" in d.stop_reason
    flashnode("resume", "--state-dir", str(tmp_path))
    assert restarted.evaluate().may_claim


def test_pause_names_a_running_agent(flashnode: Callable[..., Any], tmp_path: Path) -> None:
    # A stand-in for the agent: status checks that the pid is a live flashnode process.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "flashnode"])
    try:
        (tmp_path / "status.json").write_text(json.dumps({"pid": agent.pid}))
        code, out = flashnode("pause", "--state-dir", str(tmp_path))
        assert code == 0 and f"the running agent (pid {agent.pid}) applies it" in out
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.parametrize("duration", ["soon", "0m", "5", "2y"])
def test_pause_refuses_a_bad_duration_and_writes_nothing(
    flashnode: Callable[..., Any], tmp_path: Path, duration: str
) -> None:
    code, out = flashnode("pause", "--for", duration, "--state-dir", str(tmp_path))
    assert code == 2 and "--for" in out
    assert not (tmp_path / "pause.json").exists()


class _Clock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(timeout)


# --- logs ------------------------------------------------------------------------------------


def attempt_dir(state: Path, lease: str = "lease-1") -> Path:
    logs = state / "attempts" / lease / "logs"
    logs.mkdir(parents=True)
    (logs / "stdout.txt").write_bytes(b"")
    (logs / "stderr.txt").write_bytes(b"")
    return logs.parent


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as fh:
        fh.write(data)


def test_logs_follow_shows_a_printed_line_within_a_second_and_ends_with_the_attempt(
    tmp_path: Path,
) -> None:
    attempt = attempt_dir(tmp_path)
    out_file, err_file = attempt / "logs" / "stdout.txt", attempt / "logs" / "stderr.txt"
    append(out_file, b"first\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashnode", "logs", "lease-1", "-f", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    got: dict[str, bytes] = {"out": b"", "err": b""}

    def pump(name: str, stream: io.BufferedReader) -> None:
        while chunk := stream.read1(4096):
            got[name] += chunk

    threads = [
        threading.Thread(target=pump, args=("out", proc.stdout), daemon=True),
        threading.Thread(target=pump, args=("err", proc.stderr), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        wait_for("the existing output", lambda: b"first\n" in got["out"], timeout=20)
        printed = time.monotonic()
        append(out_file, b"step 2 of 10\n")
        wait_for("the new line", lambda: b"step 2 of 10\n" in got["out"], timeout=5, every=0.02)
        assert time.monotonic() - printed < 1.0
        append(err_file, b"warn \x1b]0;owned\x07 \xe2\x80\xae\n")
        wait_for("stderr", lambda: b"warn" in got["err"], timeout=5, every=0.02)
        append(out_file, b"last words\n")
        shutil.rmtree(attempt)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for t in threads:
        t.join(timeout=5)
    proc.stdout.close()
    proc.stderr.close()
    assert got["out"] == b"first\nstep 2 of 10\nlast words\n"
    assert got["err"] == b"warn \\x1b]0;owned\\x07 \\u202e\n"


def test_logs_without_follow_prints_what_there_is(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    attempt = attempt_dir(tmp_path, "L2")
    append(attempt / "logs" / "stdout.txt", "héllo\n".encode())
    code, out = flashnode("logs", "L2", "--state-dir", str(tmp_path))
    assert (code, out) == (0, "héllo\n")


@pytest.mark.parametrize("lease", ["../../etc", "..", "a/b", "-x", ".hidden", "x" * 200])
def test_logs_refuses_a_lease_id_that_is_not_one(
    flashnode: Callable[..., Any], tmp_path: Path, lease: str
) -> None:
    code, out = flashnode("logs", "--state-dir", str(tmp_path), "--", lease)
    assert code == 2 and "is not a lease id" in out


def test_logs_of_an_attempt_that_is_not_on_the_node(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    code, out = flashnode("logs", "gone", "--state-dir", str(tmp_path))
    assert code == 1 and "no output of attempt gone is on this node" in out


def test_history_names_each_attempts_lease_which_logs_takes(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    """`logs` of an ended attempt needs its lease; `history` is where an owner finds it."""
    line = {"lease_id": "ls-4c3324eda35e", "job_id": "j", "task_id": "t", "outcome": "failed"}
    (tmp_path / "ledger.jsonl").write_text(json.dumps(line) + "\n")
    code, out = flashnode("history", "--state-dir", str(tmp_path))
    header, row = out.splitlines()
    assert code == 0 and "lease" in header.split()
    assert row.split()[1:4] == ["ls-4c3324eda35e", "j/t", "failed"]


def test_a_reader_that_goes_away_ends_history_quietly(tmp_path: Path) -> None:
    """`flashnode history --json | head -c 100`: no traceback, no error line."""
    line = json.dumps({"lease_id": "ls-1", "job_id": "j", "task_id": "t", "outcome": "failed"})
    (tmp_path / "ledger.jsonl").write_text((line + "\n") * 5000)
    argv = ["history", "--json", "-n", "5000", "--state-dir", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashnode", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(30) == 141 and err == "", err


def test_tail_follows_a_replaced_file_and_copies_the_rest_after_the_directory_goes(
    tmp_path: Path,
) -> None:
    attempt = attempt_dir(tmp_path)
    out, err = io.BytesIO(), io.BytesIO()
    stdout = attempt / "logs" / "stdout.txt"
    steps = iter(
        [
            lambda: append(stdout, b"a\n"),
            lambda: (stdout.unlink(), stdout.write_bytes(b"b\n")),  # replaced: a new inode
            lambda: append(stdout, b"c\n"),
            lambda: shutil.rmtree(attempt),
        ]
    )
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        next(steps)()

    tail(attempt / "logs", out, err, follow=True, poll=0.2, sleep=sleep)
    assert out.getvalue() == b"a\nb\nc\n"
    assert sleeps == [0.2] * 4


def test_logs_merged_into_one_place_head_each_stretch_with_its_stream(tmp_path: Path) -> None:
    """`flashnode logs L 2>&1` (or a terminal): which lines are stderr is shown, not lost."""
    attempt = attempt_dir(tmp_path, "L3")
    append(attempt / "logs" / "stdout.txt", b"step 1\nstep 2\n")
    append(attempt / "logs" / "stderr.txt", b"warning: slow\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    argv = [sys.executable, "-m", "flashnode", "logs", "L3", "--state-dir", str(tmp_path)]
    merged = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=60
    )
    assert merged.returncode == 0
    assert merged.stdout == (b"==> stdout <==\nstep 1\nstep 2\n==> stderr <==\nwarning: slow\n"), (
        merged.stdout
    )
    # Apart (a pipe each, or one sent away): each stream as the task wrote it, no headers.
    apart = subprocess.run(argv, capture_output=True, env=env, timeout=60)
    assert (apart.stdout, apart.stderr) == (b"step 1\nstep 2\n", b"warning: slow\n")
    raw = subprocess.run(
        [*argv, "--raw"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, timeout=60
    )
    assert raw.stdout == b"step 1\nstep 2\n"  # one stream, its bytes unchanged


def test_tail_marked_heads_each_switch_and_ends_a_cut_line_first(tmp_path: Path) -> None:
    attempt = attempt_dir(tmp_path)
    out_file, err_file = attempt / "logs" / "stdout.txt", attempt / "logs" / "stderr.txt"
    one = io.BytesIO()
    append(out_file, b"10%")
    steps = iter(
        [
            lambda: append(err_file, b"oops\n"),
            lambda: append(out_file, b" 20%\n"),
            lambda: shutil.rmtree(attempt),
        ]
    )
    tail(
        attempt / "logs",
        one,
        one,
        follow=True,
        poll=0.1,
        sleep=lambda _: next(steps)(),
        marked=True,
    )
    assert one.getvalue() == (b"==> stdout <==\n10%\n==> stderr <==\noops\n==> stdout <==\n 20%\n")


def test_clean_keeps_text_and_escapes_terminal_control_across_chunks() -> None:
    s = io.StringIO()
    clean = Clean(s)
    for chunk in (b"ok \xe2\x82", b"\xac 10%\r20%\r", b"\n\x1b[2J\tdone\n", b"\xff\n"):
        clean.write(chunk)
    assert s.getvalue() == "ok € 10%\n20%\n\\x1b[2J\tdone\n\ufffd\n"


# --- history ---------------------------------------------------------------------------------


def test_history_shows_the_task_scoped_cpu_and_a_dash_for_what_was_not_measured(
    flashnode: Callable[..., Any],
    tmp_path: Path,
) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(
        {
            "ended_at": 1.7e9,
            "job_id": "j",
            "task_id": "t1",
            "outcome": "committed",
            "evidence": {
                "wall_seconds": 4.2,
                "cpu_percent_mean": 52.0,
                "gpu_util_percent_mean": None,
            },
            "task_usage": {"cpu_percent_mean": 0.15, "gpu_util_percent_mean": None},
        }
    )
    ledger.append({"ended_at": None, "job_id": "j", "task_id": "t2", "outcome": None})
    ledger.append(
        {
            "ended_at": 1.7e9,
            "job_id": "j",
            "task_id": "t3",
            "outcome": "failed",
            "evidence": {"wall_seconds": 1.0},
            "task_usage": {"cpu_percent_mean": 150.0, "gpu_util_percent_mean": 87.5},
            "reason": "exit code 1",
        }
    )
    code, out = flashnode("history", "--state-dir", str(tmp_path))
    assert code == 0, out
    header, first, second, third = out.splitlines()
    assert header.startswith(f"ended ({time.strftime('%Z')})") and "outcome" in header

    def figure(row: str, name: str) -> str:  # a figure's column ends where its header does
        return row[: header.index(f" {name}") + 1 + len(name)].split()[-1]

    assert (figure(first, "cpu"), figure(first, "gpu")) == ("0.15%", "-") and "52" not in first
    assert "j/t2" in second and (figure(second, "cpu"), figure(second, "gpu")) == ("-", "-")
    assert (figure(third, "cpu"), figure(third, "gpu")) == ("150%", "87.5%")
    assert third.endswith("exit code 1")
    assert "None" not in out


def test_history_rows_line_up_under_the_header_whatever_they_hold(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    """Columns as wide as their widest cell: a long lease, a short one, a missing end time, a
    figure of each width; each cell starts (figures: ends) where its header does."""
    records = [
        {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "outcome": "lost", "ended_at": None},
        {
            "ended_at": 1.7e9,
            "lease_id": "ls-4c3324eda35e0f1e",
            "job_id": "job-with-a-long-name",
            "task_id": "task-0042",
            "outcome": "committed",
            "evidence": {"wall_seconds": 1234.5},
            "task_usage": {"cpu_percent_mean": 97.25, "gpu_util_percent_mean": 100.0},
        },
        {
            "ended_at": 1.7e9,
            "lease_id": "ls-22",
            "job_id": "j2",
            "task_id": "t",
            "outcome": "failed",
            "evidence": {"wall_seconds": 0.5},
            "task_usage": {"cpu_percent_mean": 3.0},
            "reason": "exit code 1",
        },
    ]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out = flashnode("history", "--state-dir", str(tmp_path))
    assert code == 0, out
    header, *rows = out.splitlines()
    cells = [
        ("ls-1", "j/t", "lost", "-", "-", "-", ""),
        (
            "ls-4c3324eda35e0f1e",
            "job-with-a-long-name/task-0042",
            "committed",
            "20m34s",
            "97.2%",
            "100%",
            "",
        ),
        ("ls-22", "j2/t", "failed", "0.5s", "3%", "-", "exit code 1"),
    ]
    for row, (lease, job, outcome, took, cpu, gpu, reason) in zip(rows, cells):
        for name, cell in (("lease", lease), ("job/task", job), ("outcome", outcome)):
            at = header.index(name)
            assert row[at : at + len(cell)] == cell and row[at - 2 : at] == "  ", (name, out)
        for name, cell in (("took", took), ("cpu", cpu), ("gpu", gpu)):
            end = header.index(f" {name}") + 1 + len(name)
            assert row[end - len(cell) : end] == cell and row[end - len(cell) - 1] == " ", out
        if reason:
            assert row[header.index("[facts]") :] == reason, out


def test_history_cuts_a_long_reason_at_the_terminals_width(
    flashnode: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an 80-column terminal a long reason ends in "…" at the 80th column; --json keeps it."""
    reason = "a check failed: " + "out/metrics.json line " * 40
    line = {
        "lease_id": "ls-1",
        "job_id": "j",
        "task_id": "t",
        "outcome": "failed",
        "reason": reason,
    }
    (tmp_path / "ledger.jsonl").write_text(json.dumps(line) + "\n")
    argv = ["history", "--state-dir", str(tmp_path)]
    monkeypatch.setattr(common, "_terminal_width", lambda: 80)  # an 80-column terminal
    shown = CliRunner().invoke(main, argv, env={"FLASHNODE_STATE_DIR": None})
    header, row = shown.output.splitlines()
    assert shown.exit_code == 0 and len(row) == 80 and row.endswith("…"), shown.output
    assert row[header.index("[facts]") :].startswith("a check failed: out/")
    code, out = flashnode("history", "--json", "--state-dir", str(tmp_path))
    assert code == 0 and json.loads(out)["reason"] == reason


def test_history_fits_an_80_column_terminal_with_real_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leases and job ids as a coordinator makes them: no line passes the 80th column; the
    reason goes under its row when there is no room beside it."""
    line = {
        "lease_id": "ls-5d4ecf6f0bf7",
        "job_id": "9c973c707a54",
        "task_id": "task-000",
        "outcome": "committed",
        "reason": "accepted by the coordinator after a long and winding road",
        "ended_at": 1_800_000_000.0,
        "evidence": {"wall_seconds": 12.5},
        "task_usage": {"cpu_percent_mean": 42.0},
    }
    (tmp_path / "ledger.jsonl").write_text(json.dumps(line) + "\n")
    argv = ["history", "--state-dir", str(tmp_path)]
    monkeypatch.setattr(common, "_terminal_width", lambda: 80)  # an 80-column terminal
    shown = CliRunner().invoke(main, argv, env={"FLASHNODE_STATE_DIR": None})
    lines = shown.output.splitlines()
    assert shown.exit_code == 0 and all(len(x) <= 80 for x in lines), shown.output
    assert lines[1].strip() == "[facts] reason"  # the header says where the reason goes
    assert "ls-5d4ecf6f0bf7" in lines[2] and lines[3].strip().startswith("accepted by")


def test_a_task_cannot_forge_a_stream_header_in_merged_logs(tmp_path: Path) -> None:
    """The attack: stdout lines that look like the stderr header (even cut across two reads),
    so that the task's own words pass for its errors, or hide them."""
    attempt = attempt_dir(tmp_path)
    out_file = attempt / "logs" / "stdout.txt"
    one = io.BytesIO()
    append(out_file, b"fine\n==> stderr <==\nforged\n==")
    steps = iter([lambda: append(out_file, b"> stdout <==\n"), lambda: shutil.rmtree(attempt)])
    tail(
        attempt / "logs",
        one,
        one,
        follow=True,
        poll=0.1,
        sleep=lambda _: next(steps)(),
        marked=True,
    )
    assert one.getvalue() == (
        b"==> stdout <==\nfine\n\\==> stderr <==\nforged\n\\==> stdout <==\n"
    ), one.getvalue()


def test_history_to_a_pipe_is_whole_whatever_columns_says(tmp_path: Path) -> None:
    line = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "outcome": "failed"}
    line["reason"] = "a check failed: " + "out/metrics.json line " * 40
    (tmp_path / "ledger.jsonl").write_text(json.dumps(line) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    argv = [sys.executable, "-m", "flashnode", "history", "--state-dir", str(tmp_path)]
    shown = subprocess.run(
        argv, capture_output=True, text=True, env={**env, "COLUMNS": "80"}, timeout=60
    )
    assert shown.returncode == 0 and line["reason"].strip() in shown.stdout, shown.stdout


def test_history_never_shows_the_stderr_an_older_agents_ledger_line_quotes(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    """An earlier version kept a failure's stderr lines in the ledger, which group flashnode
    reads: `history` shows how it ended, not what the task printed."""
    line = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "outcome": "failed"}
    line["reason"] = "exit code 1: API_KEY=sk-42"
    (tmp_path / "ledger.jsonl").write_text(json.dumps(line) + "\n")
    for argv in (("history",), ("history", "--json")):
        code, out = flashnode(*argv, "--state-dir", str(tmp_path))
        assert code == 0 and "exit code 1" in out and "sk-42" not in out, out
