"""The one transfer helper every download, upload and checkpoint call of an attempt goes through:
transient errors are retried under the policy, a stop while waiting is ``Cancelled`` (the same
exception a stopped environment build raises), and the ladder turns each other ending into the
attempt's ending, a lost lease excepted."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from fakes import FakeClock

from flashnode.attempt.phases.transfer import Ladder, transfer
from flashnode.coordinator import retry
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    Cancelled,
    CoordinatorError,
    CoordinatorUnavailable,
    LeaseLost,
    NotFound,
)

LADDER = Ladder(
    missing=lambda e: AttemptFailed(f"missing: {e}"),
    gave_up=lambda e: AttemptLapsed(f"gave up: {e.__cause__}"),
    refused=lambda e: AttemptFailed(f"refused: {e}"),
)


def attempt(stop: threading.Event | None = None, clock: Any = None) -> Any:
    ctx = SimpleNamespace(rng=random.Random(1), clock=clock or FakeClock())
    return SimpleNamespace(ctx=ctx, stop=stop or threading.Event(), lease_id="lease-1")


def failing(*errors: Exception, then: object = "done") -> Callable[[], object]:
    queue = list(errors)

    def call() -> object:
        if queue:
            raise queue.pop(0)
        return then

    return call


def test_transient_errors_are_retried_until_the_call_succeeds() -> None:
    call = failing(CoordinatorUnavailable("503"), CoordinatorUnavailable("reset"))
    assert transfer(attempt(), "download of x", call, ladder=LADDER) == "done"


class StopWhileWaiting(FakeClock):
    def wait(self, event: threading.Event, timeout: float) -> bool:
        event.set()  # the attempt is stopped (a drain, a lost lease) during the backoff
        return True


@pytest.mark.parametrize("ladder", [None, LADDER])
def test_a_stop_while_waiting_to_retry_is_cancelled_whatever_the_ladder(ladder: Ladder) -> None:
    a = attempt(clock=StopWhileWaiting())
    with pytest.raises(Cancelled):
        transfer(a, "upload of y", failing(CoordinatorUnavailable("503")), ladder=ladder)


def test_a_stop_before_the_first_try_is_cancelled_without_calling() -> None:
    stop = threading.Event()
    stop.set()
    calls: list[int] = []
    with pytest.raises(Cancelled):
        transfer(attempt(stop), "fail", lambda: calls.append(1))
    assert calls == []


@pytest.mark.parametrize(
    ("error", "ending", "says"),
    [
        (NotFound("no such key"), AttemptFailed, "missing: no such key"),
        (CoordinatorError("409 conflict"), AttemptFailed, "refused: 409 conflict"),
    ],
)
def test_the_ladder_turns_each_answer_into_the_attempts_ending(
    error: Exception, ending: type[Exception], says: str
) -> None:
    with pytest.raises(ending) as raised:
        transfer(attempt(), "download of x", failing(error), ladder=LADDER)
    assert str(raised.value) == says


def test_spent_tries_end_as_the_ladders_gave_up_with_the_last_error() -> None:
    errors = [CoordinatorUnavailable(f"503 #{n}") for n in range(retry.TRANSFER.attempts or 1)]
    with pytest.raises(AttemptLapsed) as raised:
        transfer(attempt(), "download of x", failing(*errors), ladder=LADDER)
    assert str(raised.value) == f"gave up: 503 #{len(errors) - 1}"


def test_a_missing_key_is_refused_when_the_ladder_has_no_missing_rung() -> None:
    ladder = Ladder(gave_up=LADDER.gave_up, refused=lambda e: AttemptLapsed(f"refused: {e}"))
    with pytest.raises(AttemptLapsed, match="refused: gone"):
        transfer(attempt(), "latest checkpoint", failing(NotFound("gone")), ladder=ladder)


def test_a_lost_lease_is_never_translated() -> None:
    with pytest.raises(LeaseLost):
        transfer(attempt(), "download of x", failing(LeaseLost("410")), ladder=LADDER)


def test_without_a_ladder_the_callers_see_the_errors_as_they_are() -> None:
    with pytest.raises(NotFound):
        transfer(attempt(), "upload of y", failing(NotFound("x")))
    errors = [CoordinatorUnavailable("503")] * (retry.TRANSFER.attempts or 1)
    with pytest.raises(retry.GaveUp):
        transfer(attempt(), "fail", cast(Callable[[], object], failing(*errors)))
