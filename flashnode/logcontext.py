"""Which attempt a log record belongs to: its ``lease_id``, ``job_id`` and ``task_id`` as fields of
the record, never written by hand into its message.

An attempt's code runs inside ``attempt(...)`` (the orchestrator enters it once the lease is read)
and logs as usual, ``log.info("committed")``; ``AttemptFields``, the filter on the agent's log
handler (``cli/logsetup.py``), stamps every record logged inside with the fields, and the
formatters show them: once at the head of a human line (``lease L (J/T): committed``), as JSON
fields under ``--log-json``. A record logged outside any attempt carries none.

The fields live in a ``contextvars.ContextVar``: each thread has its own, so two attempts running
at once never mix theirs. A thread starts with an empty context; one an attempt starts (its lease
keeper, checkpoint relay, sampler) inherits its starter's through ``carried``, which the agent's
``start_thread`` (``cli/wiring.py``) and its background jobs (``runners/background.py``) apply to
whatever they run. A record about a lease logged outside its attempt (recovery, a claim answer)
names it with ``extra=fields(lease_id)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

R = TypeVar("R")

FIELDS = ("lease_id", "job_id", "task_id")

# (lease_id, job_id, task_id) of the attempt this context runs; "" where not known (yet).
_ATTEMPT: contextvars.ContextVar[tuple[str, str, str] | None] = contextvars.ContextVar(
    "flashnode_attempt", default=None
)


def fields(lease_id: str = "", job_id: str = "", task_id: str = "") -> dict[str, str]:
    """The known ones of the three, by name: for ``extra=`` of one record about a lease."""
    return {k: v for k, v in zip(FIELDS, (lease_id, job_id, task_id), strict=True) if v}


@contextlib.contextmanager
def attempt(lease_id: str = "", job_id: str = "", task_id: str = "") -> Iterator[None]:
    """Every record logged inside, on this thread and on the threads started inside through
    ``carried``, carries the known ones of these fields (those of an outer ``attempt`` are
    replaced, never mixed in)."""
    token = _ATTEMPT.set((lease_id, job_id, task_id))
    try:
        yield
    finally:
        _ATTEMPT.reset(token)


def current() -> dict[str, str]:
    """The fields of the attempt this code runs for; empty outside any."""
    now = _ATTEMPT.get()
    return fields(*now) if now is not None else {}


def carried(fn: Callable[[], R]) -> Callable[[], R]:
    """``fn``, to be run on another thread (or later) in the context of its caller now: what it
    logs carries the caller's attempt's fields."""
    context = contextvars.copy_context()
    return lambda: context.run(fn)


class AttemptFields(logging.Filter):
    """Stamps a record with the fields of the attempt it was logged in (a handler's filter runs
    on the logging thread). A record that names a lease itself (``extra=fields(...)``) keeps its
    own."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(hasattr(record, name) for name in FIELDS):
            for name, value in current().items():
                setattr(record, name, value)
        return True


def of(record: logging.LogRecord) -> dict[str, str]:
    """The fields a record carries (none outside an attempt)."""
    found = {name: getattr(record, name, None) for name in FIELDS}
    return {k: v for k, v in found.items() if isinstance(v, str) and v}


def head(record: logging.LogRecord) -> str:
    """How a human line names the record's attempt, once, before its message:
    ``lease L (J/T): ``, ``lease L: `` where job and task are not known; "" outside any."""
    found = of(record)
    if not found:
        return ""
    lease = found.get("lease_id", "?")
    job_task = "/".join(found[k] for k in ("job_id", "task_id") if k in found)
    return f"lease {lease} ({job_task}): " if job_task else f"lease {lease}: "
