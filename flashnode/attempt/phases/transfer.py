"""Every transfer of an attempt (inputs and checkpoint parts downloaded, the latest checkpoint
asked for, outputs and logs uploaded, checkpoints shipped, the commit and the failure report) goes
through ``transfer``: the shared retry policy, waits that end when the attempt stops (raising
``Cancelled``), and one ladder from how the call ended to how the attempt ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from flashnode.coordinator import retry
from flashnode.errors import CoordinatorError, LeaseLost, NotFound

if TYPE_CHECKING:
    from flashnode.attempt.hooks import AttemptView

T = TypeVar("T")


@dataclass(frozen=True)
class Ladder:
    """What each ending of a transfer becomes: ``missing`` (the store has no such key; None: as
    ``refused``), ``gave_up`` (the coordinator kept failing, the policy's tries spent) and
    ``refused`` (any other answer of the coordinator). A lost lease (``LeaseLost``) and a stop
    (``Cancelled``) are never translated: the attempt ends the way they say."""

    gave_up: Callable[[retry.GaveUp], Exception]
    refused: Callable[[CoordinatorError], Exception]
    missing: Callable[[NotFound], Exception] | None = None


def transfer(
    a: AttemptView,
    what: str,
    call: Callable[[], T],
    *,
    ladder: Ladder | None = None,
    policy: retry.Policy = retry.TRANSFER,
    stop: threading.Event | None = None,
) -> T:
    """Run ``call``, retried on the coordinator's transient errors under ``policy`` until
    ``stop`` (the attempt's own by default) is set. Without a ``ladder`` its errors reach the
    caller as they are (``retry.GaveUp`` once the tries are spent)."""
    done = stop if stop is not None else a.stop
    if ladder is None:
        return _retry(a, what, call, policy, done)
    try:
        return _retry(a, what, call, policy, done)
    except LeaseLost:
        raise
    except NotFound as exc:
        raise (ladder.missing or ladder.refused)(exc) from None
    except retry.GaveUp as exc:
        raise ladder.gave_up(exc) from None
    except CoordinatorError as exc:
        raise ladder.refused(exc) from None


def _retry(
    a: AttemptView, what: str, call: Callable[[], T], policy: retry.Policy, stop: threading.Event
) -> T:
    return retry.retry(
        call,
        policy=policy,
        rng=a.ctx.rng,
        clock=a.ctx.clock,
        stop=stop,
        what=what,
    )
