"""Every record an attempt logs, on its own thread and on its lease keeper's, carries its lease,
job and task as fields (``flashnode.logcontext``), none of them written into the message; two
attempts running at once never mix theirs."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode import logcontext
from flashnode.attempt import Attempt, Outcome
from flashnode.cli.wiring import _thread as agent_start_thread
from flashnode.errors import CoordinatorUnavailable, LeaseLost


# Modules whose messages still name their lease by hand: the execute phase drops its
# "lease %s: " prefixes in its rewrite; then this is emptied (and removed).
class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.addFilter(logcontext.AttemptFields())  # stamped as the agent's handler stamps

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """What the agent logs, each record stamped as its log handler stamps it."""
    logger, collect = logging.getLogger("flashnode"), Collect()
    level = logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    yield collect.records
    logger.removeHandler(collect)
    logger.setLevel(level)


def ids(n: int, job: str = "j1") -> dict[str, str]:
    return {"lease_id": f"ls-{n:012d}", "job_id": job, "task_id": f"task-{n:03d}"}


def start_threads(
    before_renewal: Callable[[], object] = lambda: None,
) -> Callable[[Callable[[], None], str], None]:
    """The agent's ``start_thread``, each thread waited for to its end (so the test is
    deterministic): the attempt's lease keeper runs for real on its own thread."""

    def start(fn: Callable[[], None], name: str) -> None:
        if name.startswith("keeper-"):
            before_renewal()
        done = threading.Event()

        def body() -> None:
            try:
                fn()
            finally:
                done.set()

        agent_start_thread(body, name)
        assert done.wait(30)

    return start


def unavailable_then_lost(coord: FakeCoordinator) -> None:
    """Renewals fail once (the keeper logs it, on its thread), then the lease is lost."""
    answers: list[Exception] = [CoordinatorUnavailable("down"), LeaseLost("gone", 410)]

    def attempt_heartbeat(lease_id: str) -> None:
        raise answers.pop(0) if answers else LeaseLost("gone", 410)

    coord.attempt_heartbeat = attempt_heartbeat  # type: ignore[method-assign]


def head(record: logging.LogRecord) -> dict[str, str]:
    return logcontext.of(record)


def test_every_record_of_a_committed_attempt_carries_its_ids_and_no_message_repeats_them(
    tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    attempt = Attempt(context(tmp_path, clock, coord, FakeRunner()), lease(4))
    assert attempt.run() is Outcome.COMMITTED
    logging.getLogger("flashnode").info("the next claim")
    *during, after = records
    assert during[0].getMessage() == "claimed (attempt 1)"
    assert "committed, accepted" in [r.getMessage() for r in during]
    for record in during:
        assert head(record) == ids(4), record.getMessage()
        assert "ls-000000000004" not in record.getMessage()
    assert head(after) == {}


def test_a_failed_attempt_says_why_under_its_ids(
    tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    outcome = Attempt(context(tmp_path, clock, coord, FakeRunner()), lease(2, argv=None)).run()
    assert outcome is Outcome.FAILED
    [failed] = [r for r in records if r.getMessage().startswith("failed: ")]
    assert head(failed) == ids(2)


def test_a_malformed_lease_is_logged_under_what_is_known_of_it(
    tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    data = lease(3)
    del data["job_id"]
    assert Attempt(context(tmp_path, clock, coord, FakeRunner()), data).run() is Outcome.FAILED
    [failing] = [r for r in records if r.getMessage().endswith("; failing it")]
    assert head(failing) == {"lease_id": "ls-000000000003"}
    dropped = Attempt(context(tmp_path, clock, coord, FakeRunner()), {"payload": 1}).run()
    assert dropped is Outcome.DROPPED
    assert head(records[-1]) == {}


def test_the_lease_keepers_records_carry_the_ids_of_its_attempt(
    tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    unavailable_then_lost(coord)
    ctx = dataclasses.replace(
        context(tmp_path, clock, coord, FakeRunner()), start_thread=start_threads()
    )
    attempt = Attempt(ctx, lease(5))
    ran: list[Outcome] = []
    start_threads()(lambda: ran.append(attempt.run()), "attempt-1")  # as Workers starts it
    assert ran == [Outcome.LOST]
    [renewal] = [r for r in records if r.getMessage().startswith("renewal failed")]
    assert renewal.threadName == "keeper-ls-000000000005"
    assert head(renewal) == ids(5)
    [lost] = [r for r in records if r.getMessage().startswith("lost, nothing more")]
    assert lost.threadName == "attempt-1" and head(lost) == ids(5)


def test_two_attempts_running_at_once_never_mix_their_ids(
    tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    both = threading.Barrier(2, timeout=30)  # each keeper starts while the other attempt runs
    starter = start_threads(before_renewal=both.wait)
    outcomes: dict[int, Outcome] = {}
    threads = []
    for n in (1, 2):
        clock = FakeClock()
        coord = FakeCoordinator(clock)
        unavailable_then_lost(coord)
        (tmp_path / str(n)).mkdir()
        ctx = context(tmp_path / str(n), clock, coord, FakeRunner())
        attempt = Attempt(dataclasses.replace(ctx, start_thread=starter), lease(n, job=f"j{n}"))

        def run(n: int = n, attempt: Attempt = attempt) -> None:
            starter(lambda: outcomes.__setitem__(n, attempt.run()), f"attempt-{n}")

        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes == {1: Outcome.LOST, 2: Outcome.LOST}
    seen = {r.threadName for r in records}
    assert {"attempt-1", "attempt-2", "keeper-ls-000000000001", "keeper-ls-000000000002"} <= seen
    for record in records:
        n = int(str(record.threadName).rsplit("-", 1)[-1])
        assert head(record) == ids(n, job=f"j{n}"), (record.threadName, record.getMessage())
