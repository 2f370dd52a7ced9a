"""An attempt's log records carry its lease, job and task as fields (``flashnode.logcontext``):
as JSON fields under ``--log-json``, once at the head of a human line (terminal and journal); on
the attempt's thread and on the threads and background jobs it starts; never on a record logged
outside an attempt, and never another attempt's."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from flashnode import logcontext
from flashnode.cli.logsetup import setup_logging
from flashnode.cli.wiring import _thread as start_thread  # the agent's start_thread
from flashnode.owner.status import TerminalLine
from flashnode.runners.background import Background

log = logging.getLogger("flashnode.attempt.test")
IDS = {"lease_id": "ls-7f3a", "job_id": "job-1", "task_id": "task-003"}


@pytest.fixture
def agent_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., io.StringIO]]:
    """``setup(log_json=..., journal=..., terminal=...)``: the agent's log set up as ``work``
    does, writing into the returned buffer; the test's own logging put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def setup(log_json: bool = False, journal: bool = False, terminal: bool = False) -> io.StringIO:
        out = io.StringIO()
        monkeypatch.setattr(sys, "stderr", out)
        if journal:
            monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
        else:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        setup_logging(log_json, TerminalLine(out) if terminal else None)
        return out

    yield setup
    root.handlers[:] = handlers
    root.setLevel(level)


def json_lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def by_msg(out: io.StringIO) -> dict[str, dict[str, Any]]:
    return {entry["msg"]: entry for entry in json_lines(out)}


def fields(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: entry[k] for k in logcontext.FIELDS if k in entry}


def run_thread(fn: Callable[[], None], name: str = "attempt-1") -> None:
    """``fn`` on a thread the agent starts (as ``Workers`` starts an attempt's), to its end."""
    done = threading.Event()

    def body() -> None:
        try:
            fn()
        finally:
            done.set()

    start_thread(body, name)
    assert done.wait(10)


def test_an_attempts_records_and_those_of_the_threads_it_starts_carry_its_ids_in_json(
    agent_log: Callable[..., io.StringIO],
) -> None:
    out = agent_log(log_json=True)

    def attempt() -> None:
        with logcontext.attempt(**IDS):
            log.info("on the attempt's thread")
            run_thread(lambda: log.warning("on the keeper's thread"), "keeper-ls-7f3a")
            background = Background("test-later")
            assert background.submit(lambda: log.info("in a background job")).wait(10)
        log.info("after the attempt")

    run_thread(attempt)
    log.info("outside any attempt")
    got = by_msg(out)
    for msg in ("on the attempt's thread", "on the keeper's thread", "in a background job"):
        assert fields(got[msg]) == IDS, msg
    assert fields(got["after the attempt"]) == {}
    assert fields(got["outside any attempt"]) == {}


def test_a_lease_not_yet_read_has_only_what_is_known(
    agent_log: Callable[..., io.StringIO],
) -> None:
    out = agent_log(log_json=True)
    with logcontext.attempt("ls-1"):
        log.error("malformed lease; failing it")
    log.warning("letting its lease lapse", extra=logcontext.fields("ls-2"))
    got = by_msg(out)
    assert fields(got["malformed lease; failing it"]) == {"lease_id": "ls-1"}
    assert fields(got["letting its lease lapse"]) == {"lease_id": "ls-2"}


def test_a_record_that_names_its_lease_keeps_it_inside_another_attempt(
    agent_log: Callable[..., io.StringIO],
) -> None:
    out = agent_log(log_json=True)
    with logcontext.attempt(**IDS):
        log.warning("about another lease", extra=logcontext.fields("ls-other"))
    assert fields(by_msg(out)["about another lease"]) == {"lease_id": "ls-other"}


@pytest.mark.parametrize("where", ["terminal", "journal"])
def test_the_human_line_shows_the_ids_once_before_the_message(
    agent_log: Callable[..., io.StringIO], where: str
) -> None:
    out = agent_log(**{where: True})
    with logcontext.attempt(**IDS):
        log.info("committed, accepted")
    log.info("claim answer: nothing for this node")
    attempt_line, other_line = out.getvalue().replace("\r\x1b[K", "").splitlines()
    assert attempt_line.endswith(" lease ls-7f3a (job-1/task-003): committed, accepted") or (
        attempt_line == "<6>lease ls-7f3a (job-1/task-003): committed, accepted"
    )
    assert attempt_line.count("ls-7f3a") == attempt_line.count("job-1") == 1
    assert "lease" not in other_line and other_line.endswith("claim answer: nothing for this node")


def test_a_traceback_of_an_attempt_is_led_like_its_record_without_repeating_the_ids(
    agent_log: Callable[..., io.StringIO],
) -> None:
    out = agent_log(journal=True)
    with logcontext.attempt(**IDS):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("unexpected error")
    first, *rest = out.getvalue().splitlines()
    assert first == "<3>lease ls-7f3a (job-1/task-003): unexpected error"
    assert rest and all(x.startswith("<3>  ") and "ls-7f3a" not in x for x in rest)


def test_an_id_cannot_break_the_line(agent_log: Callable[..., io.StringIO]) -> None:
    out = agent_log(journal=True)
    with logcontext.attempt("ls-1\n<0>forged", "j", "t"):
        log.info("committed")
    assert out.getvalue() == "<6>lease ls-1\\x0a<0>forged (j/t): committed\n"


def test_two_attempts_running_at_once_never_mix_their_fields(
    agent_log: Callable[..., io.StringIO],
) -> None:
    out = agent_log(log_json=True)
    both = threading.Barrier(2, timeout=10)

    def attempt(n: int) -> Callable[[], None]:
        def run() -> None:
            with logcontext.attempt(f"ls-{n}", f"job-{n}", f"task-{n}"):
                for step in range(20):
                    both.wait()  # each record logged while the other attempt logs its own
                    log.info("attempt %d step %d", n, step)
                    if step % 5 == 0:
                        run_thread(lambda: log.info("attempt %d keeper", n), f"keeper-{n}")

        return run

    threads = [threading.Thread(target=lambda n=n: run_thread(attempt(n))) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    entries = json_lines(out)
    assert len(entries) == 2 * (20 + 4)
    for entry in entries:
        n = entry["msg"].split()[1]
        assert fields(entry) == {
            "lease_id": f"ls-{n}",
            "job_id": f"job-{n}",
            "task_id": f"task-{n}",
        }
