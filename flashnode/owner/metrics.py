"""Prometheus metrics: opt-in (``metrics_listen``), loopback or a unix socket unless allowed.

``create`` returns a ``Metrics`` serving its own ``CollectorRegistry`` (never the process-global
one), or, with metrics off, a ``NullMetrics`` whose methods do nothing, so that callers never test
for None. ``prometheus_client`` is imported only when metrics are on: an agent without them does
not pay its memory. The address it listens on is
``config/listen.py``'s ``Listen``.

The series (all prefixed ``flashnode_``):

=================================  =========  ===================================================
``attempts_total{outcome}``        counter    finished attempts, by ledger outcome
``attempt_duration_seconds``       histogram  claim to final outcome, per attempt
``claim_duration_seconds{result}`` histogram  one claim request (result: work, empty, error)
``coordinator_errors_total{conversation}``  counter  failed coordinator conversations
``coordinator_failing{conversation}``      gauge    1 while that conversation fails
``uploaded_bytes_total``           counter    output bytes uploaded
``downloaded_bytes_total``         counter    input bytes downloaded
``running_attempts``               gauge      attempts running now
``suspended_attempts``             gauge      of those, suspended by an owner control
``paused``                         gauge      1 while ``flashnode pause`` is in force
``claiming_held{rule}``            gauge      1 while that owner control or node hold holds claiming
``task_cpu_percent``               histogram  per attempt, the task's mean CPU (% of one core)
``task_gpu_percent``               histogram  per attempt, the task's mean GPU use (%)
``info{version}``                  gauge      always 1
``start_time_seconds``             gauge      when this agent started (Unix time)
``status_published_timestamp_seconds``  gauge  when the loop last published its status
``last_attempt_finished_timestamp_seconds``  gauge  when an attempt last ended here (0: none yet)
=================================  =========  ===================================================

The three timestamps are the wall clock's (Prometheus's convention): an alert compares them with
``time()``. ``PublishedSink`` is the status sink (``owner/status.py``'s ``StatusSink``) that feeds
``status_published_timestamp_seconds``: the agent's sinks include it, so a loop that stops
turning shows in the metrics as the stale status it leaves.

The metrics and their no-op twin take the same calls (``MetricsSink``), and ``HELD_RULES`` names
every hold a ``Decision`` can carry: tests/owner/test_metrics.py holds both. The HTTP server is
``metricsserver.py``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable
from typing import Protocol

from flashnode import __version__
from flashnode.config.listen import Listen, parse_listen

log = logging.getLogger(__name__)

HELD_RULES = (
    "pause",
    "window",
    "battery",
    "active",
    "load",
    "disk",
    "quarantine",
    "revoked",
    "courtesy",
    "credentials",
)
# The conversations ``node/session.py`` names (as labels): their series exist from the start, so
# that a rate sees the first error and a dashboard shows each before it ever failed.
CONVERSATIONS = ("registration", "node_heartbeat", "claim")
_LABEL = re.compile(r"[^a-z0-9_]+")


class MetricsSink(Protocol):
    """What the agent records; ``Metrics`` exports it, ``NullMetrics`` drops it."""

    def attempt_finished(
        self,
        outcome: str,
        seconds: float | None,
        cpu_percent: float | None = None,
        gpu_percent: float | None = None,
    ) -> None: ...
    def claim_finished(self, seconds: float, result: str) -> None: ...
    def coordinator_error(self, conversation: str) -> None: ...
    def coordinator_working(self, conversation: str) -> None: ...
    def status_published(self) -> None: ...
    def uploaded(self, nbytes: int) -> None: ...
    def downloaded(self, nbytes: int) -> None: ...
    def set_running(self, running: int, suspended: int = 0) -> None: ...
    def set_controls(self, paused: bool, held: Iterable[str]) -> None: ...
    def close(self) -> None: ...


class NullMetrics:
    """Metrics off: every call does nothing."""

    address: str | None = None

    def attempt_finished(
        self,
        outcome: str,
        seconds: float | None,
        cpu_percent: float | None = None,
        gpu_percent: float | None = None,
    ) -> None:
        pass

    def claim_finished(self, seconds: float, result: str) -> None:
        pass

    def coordinator_error(self, conversation: str) -> None:
        pass

    def coordinator_working(self, conversation: str) -> None:
        pass

    def status_published(self) -> None:
        pass

    def uploaded(self, nbytes: int) -> None:
        pass

    def downloaded(self, nbytes: int) -> None:
        pass

    def set_running(self, running: int, suspended: int = 0) -> None:
        pass

    def set_controls(self, paused: bool, held: Iterable[str]) -> None:
        pass

    def close(self) -> None:
        pass


class PublishedSink:
    """A status sink (``owner/status.py``'s ``StatusSink``) that tells the metrics each time the
    loop publishes its status; what it says goes to the other sinks."""

    def __init__(self, metrics: MetricsSink) -> None:
        self._metrics = metrics

    def status(self, text: str) -> None:
        self._metrics.status_published()

    def send(self, **fields: str | int) -> None:
        pass

    def tick(self) -> None:
        pass


def _label(value: str) -> str:
    """A bounded, tidy label value: 'node heartbeat' → 'node_heartbeat'."""
    return _LABEL.sub("_", value.lower()).strip("_")[:40] or "unknown"


def _usable(value: float | None) -> bool:
    return value is not None and value == value and value not in (float("inf"), float("-inf"))


class Metrics:
    """The agent's series in a private registry; ``serve`` exposes them."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.address: str | None = None
        self._close: list[Callable[[], None]] = []
        self._attempts = Counter(
            "flashnode_attempts", "Finished attempts, by outcome.", ["outcome"], registry=r
        )
        self._duration = Histogram(
            "flashnode_attempt_duration_seconds",
            "Attempt duration, claim to final outcome.",
            buckets=(1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, float("inf")),
            registry=r,
        )
        self._claim = Histogram(
            "flashnode_claim_duration_seconds",
            "Latency of one claim request, by result (work, empty, error).",
            ["result"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, float("inf")),
            registry=r,
        )
        self._errors = Counter(
            "flashnode_coordinator_errors",
            "Failed coordinator conversations.",
            ["conversation"],
            registry=r,
        )
        self._failing = Gauge(
            "flashnode_coordinator_failing",
            "1 while this conversation with the coordinator fails (0 once it works again).",
            ["conversation"],
            registry=r,
        )
        self._up = Counter("flashnode_uploaded_bytes", "Output bytes uploaded.", registry=r)
        self._down = Counter("flashnode_downloaded_bytes", "Input bytes downloaded.", registry=r)
        self._running = Gauge("flashnode_running_attempts", "Attempts running now.", registry=r)
        self._suspended = Gauge(
            "flashnode_suspended_attempts",
            "Running attempts suspended by an owner control.",
            registry=r,
        )
        self._paused = Gauge(
            "flashnode_paused", "1 while the owner's pause is in force.", registry=r
        )
        self._held = Gauge(
            "flashnode_claiming_held",
            "1 while this owner control (or the node's own hold) holds claiming.",
            ["rule"],
            registry=r,
        )
        self._cpu = Histogram(
            "flashnode_task_cpu_percent",
            "Per attempt, the task's own mean CPU use in percent of one core.",
            buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, float("inf")),
            registry=r,
        )
        self._gpu = Histogram(
            "flashnode_task_gpu_percent",
            "Per attempt, the task's own mean GPU utilisation in percent.",
            buckets=(1, 5, 10, 25, 50, 75, 90, 100, float("inf")),
            registry=r,
        )
        info = Gauge("flashnode_info", "This agent's version.", ["version"], registry=r)
        info.labels(version=__version__).set(1)
        started = Gauge(
            "flashnode_start_time_seconds", "When this agent started, in Unix time.", registry=r
        )
        started.set_to_current_time()
        self._published = Gauge(
            "flashnode_status_published_timestamp_seconds",
            "When the agent's loop last published its status, in Unix time (0: not yet).",
            registry=r,
        )
        self._finished = Gauge(
            "flashnode_last_attempt_finished_timestamp_seconds",
            "When an attempt last reached its final outcome here, in Unix time (0: none yet).",
            registry=r,
        )
        for rule in HELD_RULES:
            self._held.labels(rule=rule).set(0)
        for conversation in CONVERSATIONS:
            self._errors.labels(conversation=conversation)
            self._failing.labels(conversation=conversation).set(0)

    # --- recording -----------------------------------------------------------------------------

    def attempt_finished(
        self,
        outcome: str,
        seconds: float | None,
        cpu_percent: float | None = None,
        gpu_percent: float | None = None,
    ) -> None:
        """One attempt reached its final outcome (call it where the ledger record is written).
        A figure that was not measured (None) is left out, never counted as zero."""
        if _usable(seconds):
            self._duration.observe(max(float(seconds), 0.0))  # type: ignore[arg-type]
        if _usable(cpu_percent):
            self._cpu.observe(max(float(cpu_percent), 0.0))  # type: ignore[arg-type]
        if _usable(gpu_percent):
            self._gpu.observe(max(float(gpu_percent), 0.0))  # type: ignore[arg-type]
        self._finished.set_to_current_time()
        # Counted last: a scrape that sees the attempt counted sees its figures too.
        self._attempts.labels(outcome=_label(outcome)).inc()

    def claim_finished(self, seconds: float, result: str) -> None:
        self._claim.labels(result=_label(result)).observe(max(seconds, 0.0))

    def coordinator_error(self, conversation: str) -> None:
        """A conversation failed: counted, and marked failing until it works again."""
        label = _label(conversation)
        self._errors.labels(conversation=label).inc()
        self._failing.labels(conversation=label).set(1)

    def coordinator_working(self, conversation: str) -> None:
        """A conversation worked (call it at each success: it is one assignment)."""
        self._failing.labels(conversation=_label(conversation)).set(0)

    def status_published(self) -> None:
        self._published.set_to_current_time()

    def uploaded(self, nbytes: int) -> None:
        if nbytes > 0:
            self._up.inc(nbytes)

    def downloaded(self, nbytes: int) -> None:
        if nbytes > 0:
            self._down.inc(nbytes)

    def set_running(self, running: int, suspended: int = 0) -> None:
        self._running.set(running)
        self._suspended.set(suspended)

    def set_controls(self, paused: bool, held: Iterable[str]) -> None:
        self._paused.set(1 if paused else 0)
        holding = set(held)
        for rule in HELD_RULES:
            self._held.labels(rule=rule).set(1 if rule in holding else 0)

    def exposition(self) -> bytes:
        """The text format, as a scrape sees it."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    # --- serving -------------------------------------------------------------------------------

    def serve(self, listen: Listen, refused_uids: frozenset[int] = frozenset()) -> str:
        """Start serving on a daemon thread; return the address actually bound."""
        # here, not at the top: an agent without metrics never loads http.server
        from flashnode.owner import metricsserver

        if listen.path is not None:
            path = listen.path
            unix = metricsserver.serve_unix(path, self.registry, refused_uids)
            self.address = f"unix:{path}"
            self._close.append(lambda: metricsserver.close_unix(unix, path))
        else:
            tcp = metricsserver.serve_tcp(listen.host, listen.port, self.registry, refused_uids)
            self.address = str(Listen(host=listen.host, port=tcp.server_address[1]))
            self._close.append(lambda: metricsserver.close_tcp(tcp))
        log.info("metrics served at %s", self.address)
        return self.address

    def close(self) -> None:
        while self._close:
            with contextlib.suppress(Exception):
                self._close.pop()()


def create(
    listen: str | None, allow_remote: bool = False, refused_uids: frozenset[int] = frozenset()
) -> Metrics | NullMetrics:
    """Metrics served at ``listen``, or the no-op twin when it is None; connections of
    ``refused_uids`` (the task users) are closed unanswered.

    Raises ValueError for an address settings validation would refuse, and OSError when the
    address cannot be bound.
    """
    if listen is None:
        return NullMetrics()
    parsed = parse_listen(listen)
    if not parsed.loopback and not allow_remote:
        raise ValueError(
            f"metrics_listen {listen!r} is not loopback and metrics_allow_remote is off"
        )
    metrics = Metrics()
    try:
        metrics.serve(parsed, refused_uids)
    except BaseException:
        metrics.close()
        raise
    return metrics
