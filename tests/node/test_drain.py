"""The node's stop: a drain, then the attempts left stopped; a second request stops at once."""

from __future__ import annotations

from flashnode.config.settings import Settings
from flashnode.errors import Stopped
from flashnode.node.drain import SHUTDOWN_MARGIN_S, Drain

SETTINGS = Settings(coordinator="http://127.0.0.1:1", drain_seconds=60.0, kill_grace_seconds=10.0)


class Sink:
    def __init__(self) -> None:
        self.sent: list[dict[str, str | int]] = []

    def status(self, text: str) -> None:
        pass

    def send(self, **fields: str | int) -> None:
        self.sent.append(fields)

    def tick(self) -> None:
        pass


def test_nothing_happens_until_a_stop_is_requested() -> None:
    drain, sink = Drain(), Sink()
    assert not drain.tick(100.0, SETTINGS, sink, running=1)
    assert drain.stopping(100.0, SETTINGS) is None and drain.deadline is None
    assert sink.sent == []


def test_a_drain_lets_attempts_run_until_its_deadline_then_stops_them_with_the_grace() -> None:
    drain, sink = Drain(), Sink()
    drain.request_drain()
    assert drain.tick(100.0, SETTINGS, sink, running=1) is True
    assert drain.tick(101.0, SETTINGS, sink, running=1) is False  # started once
    assert drain.deadline == 160.0
    assert drain.stopping(159.0, SETTINGS) is None
    ending = drain.stopping(160.0, SETTINGS)
    assert ending is not None
    assert isinstance(ending[0], Stopped) and str(ending[0]) == "node draining"
    assert ending[1] == 10.0
    assert sink.sent[0] == {"STOPPING": 1}


def test_systemd_is_told_every_five_seconds_how_long_the_stop_may_still_take() -> None:
    drain, sink = Drain(), Sink()
    drain.request_drain()
    for t in range(100, 111):
        drain.tick(float(t), SETTINGS, sink, running=1)
    extends = [f["EXTEND_TIMEOUT_USEC"] for f in sink.sent if "EXTEND_TIMEOUT_USEC" in f]
    assert len(extends) == 3  # at 100, 105, 110
    assert extends[0] == int((60.0 + 10.0 + SHUTDOWN_MARGIN_S) * 1e6)
    assert extends[-1] == int((50.0 + 10.0 + SHUTDOWN_MARGIN_S) * 1e6)


def test_a_second_stop_request_stops_the_attempts_at_once_without_grace() -> None:
    drain, sink = Drain(), Sink()
    drain.request_drain()
    drain.tick(100.0, SETTINGS, sink, running=1)
    drain.request_drain()
    ending = drain.stopping(100.0, SETTINGS)
    assert ending is not None
    assert str(ending[0]) == "agent stopping" and ending[1] == 0.0
