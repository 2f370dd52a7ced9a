"""The console's usage history (``console/usage.py``): sampled every few seconds by the agent's
loop, kept in the state dir across restarts in a file of fixed size, an hour of samples, a day of
minutes, a week of ten minutes; whatever is found in its place (garbage, a short file, a symlink,
a hard link, a directory) is never written through nor a crash. Then what ``/api/charts`` makes
of it and of the ledger, and, against a real agent, that a restart keeps it."""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path

from consoleharness import ConsoleAgent, start_console_agent
from harness import AgentProcess, CoordinatorServer, free_port, wait_for

from flashnode.console import usage
from flashnode.console.app import App
from flashnode.console.auth import Gate
from flashnode.console.usage import FILE, STEP, UsageRing, file_size
from flashnode.console.wiring import Wiring
from flashnode.owner.ledgerview import LedgerView

T0 = 1_800_000_000.0  # a multiple of 600: spans start on the clock's round numbers
HOUR, DAY, WEEK = 3600, 86400, 7 * 86400


class Machine:
    """A fake clock and fake readings: the CPU busy ``cpu`` % of the time since the last read,
    memory ``memory`` %."""

    def __init__(self) -> None:
        self.now = T0
        self.cpu: float | None = 50.0
        self.memory: float | None = 40.0
        self.gpu: float | None = None
        self._busy, self._total, self._read_at = 0.0, 0.0, T0

    def counters(self) -> tuple[float, float]:
        if self.cpu is None:
            raise OSError("no /proc/stat")
        elapsed = self.now - self._read_at
        self._busy += elapsed * self.cpu / 100.0
        self._total += elapsed
        self._read_at = self.now
        return self._busy, self._total

    def ring(self, state_dir: Path | None) -> UsageRing:
        return UsageRing(
            cpu=self.counters,
            memory=lambda: self.memory,
            gpu=lambda: self.gpu,
            clock=lambda: self.now,
            state_dir=state_dir,
        )

    def run(self, ring: UsageRing, seconds: float, every: float = 1.0) -> None:
        """The loop's ticks for ``seconds``, one every ``every`` seconds."""
        end = self.now + seconds
        while self.now < end:
            ring.tick()
            self.now += every


def test_a_sample_every_ten_seconds_an_hour_of_them_and_what_was_not_measured() -> None:
    m = Machine()
    ring = m.ring(None)
    m.run(ring, 2 * HOUR)
    hour = ring.series(m.now - HOUR)
    assert len(hour) == 360
    assert [b[0] - a[0] for a, b in zip(hour, hour[1:], strict=False)] == [STEP] * 359
    assert all(p[1:] == (50, 40, None) for p in hour)
    m.memory, m.cpu = None, 80.0
    m.run(ring, 60)
    assert ring.series(m.now - 60)[-1][1:] == (80, None, None)


def test_the_history_survives_a_restart_on_the_same_state_dir(tmp_path: Path) -> None:
    m = Machine()
    first = m.ring(tmp_path)
    m.run(first, 30 * 60 + 25)  # stopped 25 s into a minute
    before = first.series(m.now - HOUR)
    first.close()
    path = tmp_path / FILE
    assert path.stat().st_size == file_size() and stat.S_IMODE(path.stat().st_mode) == 0o640
    m.now += 5 * 60  # five minutes down
    m.memory = 70.0
    again = m.ring(tmp_path)
    assert again.series(m.now - HOUR) == before  # before its first sample: all the earlier ones
    m.run(again, 120)
    hour = again.series(m.now - HOUR)
    assert hour[: len(before)] == before and len(hour) == len(before) + 12
    minutes = again.series(m.now - DAY, 60)
    assert [p[0] for p in minutes[:31]] == [int(T0) + 60 * i for i in range(31)]
    assert minutes[30][1:] == (50, 40, None)  # the minute the agent stopped in: its mean, later
    assert [p[2] for p in minutes[31:]] == [70, 70, 70]  # after the restart, the last under way
    again.close()


def test_the_day_and_the_week_are_means_and_the_file_keeps_its_size(tmp_path: Path) -> None:
    m = Machine()
    ring = m.ring(tmp_path)
    end = m.now + 8 * DAY
    n = 0
    while m.now < end:  # every sample, alternating 20 % and 40 % busy; memory by ten minutes
        m.cpu = 20.0 if n % 2 else 40.0
        m.memory = float(int(m.now // 600) % 90)
        m.gpu = None if int(m.now // 600) % 3 == 0 else 10.0
        ring.sample(m.now)
        m.now += STEP
        n += 1
    assert (tmp_path / FILE).stat().st_size == file_size() < 32 * 1024
    week = ring.series(m.now - WEEK, 600)
    assert len(week) == 1008
    assert week[-1][0] == int((m.now - STEP) // 600) * 600  # the last under way
    assert all(t % 600 == 0 and cpu == 30 for t, cpu, _, _ in week)
    assert all(mem == t // 600 % 90 for t, _, mem, _ in week)
    assert all(gpu == (None if t // 600 % 3 == 0 else 10) for t, _, _, gpu in week)
    day = ring.series(m.now - DAY, 60)
    assert len(day) == 1440 and all(t % 60 == 0 for t, *_ in day)
    assert all(mem == t // 600 % 90 for t, _, mem, _ in day)
    ring.close()
    again = m.ring(tmp_path)  # all of it read back from the file
    assert again.series(m.now - WEEK, 600) == week
    assert again.series(m.now - DAY, 60) == day
    again.close()


def test_a_damaged_record_is_left_out_and_a_damaged_file_replaced(tmp_path: Path) -> None:
    m = Machine()
    ring = m.ring(tmp_path)
    m.run(ring, 600, STEP)
    ring.close()
    path = tmp_path / FILE
    data = bytearray(path.read_bytes())
    assert len(m.ring(tmp_path).series(0)) == 59
    record = usage.HEADER_SIZE + ((int(T0) + STEP) // STEP % 360) * usage.RECORD.size
    data[record + 4] ^= 0x01  # the first sample's CPU figure, torn
    path.write_bytes(bytes(data))
    points = m.ring(tmp_path).series(0)
    assert len(points) == 58 and points[0][0] == int(T0) + 2 * STEP
    for damage in (
        b"\0" * file_size(),  # never written
        os.urandom(file_size()),  # garbage
        bytes(data[: file_size() // 2]),  # truncated
        b"FNUSAGE\x02" + bytes(data[8:]),  # another version
        bytes(data) + b"\0",  # another size
    ):
        path.write_bytes(damage)
        ring = m.ring(tmp_path)
        assert ring.series(0) == []
        assert path.stat().st_size == file_size()
        ring.sample(m.now)
        ring.close()
        assert len(m.ring(tmp_path).series(0)) == 1


def test_a_symlink_hard_link_or_directory_in_its_place_is_never_written_through(
    tmp_path: Path,
) -> None:
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir()
    elsewhere.mkdir()
    m = Machine()
    m.run(good := m.ring(state), 60, STEP)
    good.close()
    valid = (state / FILE).read_bytes()
    for make in ("symlink", "hardlink"):
        target = elsewhere / f"{make}-target"
        target.write_bytes(valid)  # even a valid history is not read through a link
        (state / FILE).unlink()
        if make == "symlink":
            (state / FILE).symlink_to(target)
        else:
            os.link(target, state / FILE)
        ring = m.ring(state)
        assert ring.series(0) == []
        ring.sample(m.now)
        ring.close()
        assert target.read_bytes() == valid
        assert not (state / FILE).is_symlink() and (state / FILE).stat().st_nlink == 1
    (state / FILE).unlink()
    (state / FILE).mkdir()
    ring = m.ring(state)  # kept in memory only
    ring.sample(m.now)
    assert len(ring.series(0)) == 1 and (state / FILE).is_dir()
    (state / FILE).rmdir()
    os.mkfifo(state / FILE)  # opened without blocking, then replaced
    ring = m.ring(state)
    assert stat.S_ISREG((state / FILE).lstat().st_mode)
    ring.close()


def test_a_reading_that_fails_is_not_measured_and_the_loop_goes_on(tmp_path: Path) -> None:
    m = Machine()
    m.cpu = None
    m.gpu = 12.4

    def broken() -> float | None:
        raise RuntimeError("NVML gone")

    ring = UsageRing(
        cpu=m.counters, memory=lambda: m.memory, gpu=broken, clock=lambda: m.now, state_dir=tmp_path
    )
    m.run(ring, 31)
    assert [p[1:] for p in ring.series(0)] == [(None, 40, None)] * 3
    ring.close()


# --- /api/charts --------------------------------------------------------------------------------


def _app(tmp_path: Path, ring: UsageRing, ledger: LedgerView, clock: Callable[[], float]) -> App:
    wiring = Wiring(
        state_dir=tmp_path,
        settings=lambda: None,  # type: ignore[arg-type,return-value]
        config_file=None,
        validate=lambda path: None,
        overridden=lambda key: None,
        reload=lambda: None,
        node_view=lambda node: None,
        ring=ring,
        clock=clock,
        ledger=ledger,
    )
    return App(wiring, Gate(), frozenset(), "c")


def test_charts_answer_the_hour_day_and_week_and_tasks_per_bin(tmp_path: Path) -> None:
    m = Machine()
    ring = m.ring(tmp_path)
    ledger_path = tmp_path / "ledger.jsonl"
    ledger_path.write_text("")
    ledger = LedgerView(ledger_path, clock=lambda: m.now)
    app = _app(tmp_path, ring, ledger, lambda: m.now)
    fresh = app.charts("hour")
    assert fresh["usage"] == [[int(m.now), None, None, None]]  # before the first sample
    m.run(ring, 2 * DAY, STEP)
    ends = (m.now - 3 * DAY, m.now - 2 * HOUR, m.now - 120, m.now - 60)
    ledger_path.write_text(
        "".join(json.dumps({"outcome": "committed", "ended_at": e}) + "\n" for e in ends)
        + json.dumps({"outcome": "failed", "ended_at": m.now - 30})
        + "\n"
    )
    expected = {"hour": (HOUR, 10, 300), "day": (DAY, 60, HOUR), "week": (WEEK, 600, 6 * HOUR)}
    for span, (seconds, step, bins) in expected.items():
        c = app.charts(span)
        assert c["span"] == span and c["now"] == m.now and c["since"] == m.now - seconds
        assert c["step_seconds"] == step and c["bin_seconds"] == bins
        assert all(isinstance(p, list) and len(p) == 4 for p in c["usage"])
        assert c["usage"][-1][1:] == [50, 40, None]
        assert all(b[0] - a[0] == step for a, b in zip(c["usage"], c["usage"][1:], strict=False))
        assert all(b[0] - a[0] == bins for a, b in zip(c["tasks"], c["tasks"][1:], strict=False))
        json.dumps(c)
    assert len(app.charts("hour")["usage"]) == 360
    assert len(app.charts("day")["usage"]) == 1440
    assert len(app.charts("week")["usage"]) == 2 * 144  # two days sampled of the week
    assert sum(n for _, n in app.charts("hour")["tasks"]) == 2
    assert sum(n for _, n in app.charts("day")["tasks"]) == 3
    assert sum(n for _, n in app.charts("week")["tasks"]) == 4
    assert app.charts("year")["span"] == "hour" and app.charts("")["step_seconds"] == 10
    ring.close()


def test_the_weeks_tasks_per_hour_last_in_the_ledgers_checkpoint(tmp_path: Path) -> None:
    now = [T0]
    ledger, checkpoint = tmp_path / "ledger.jsonl", tmp_path / "ledger-totals.json"
    ends = [T0 - 6 * DAY, T0 - 3 * DAY, T0 - 3 * DAY + 10, T0 - 8 * DAY, T0 - 100]
    ledger.write_text(
        "".join(json.dumps({"outcome": "committed", "ended_at": e}) + "\n" for e in ends)
    )
    first = LedgerView(ledger, clock=lambda: now[0], checkpoint=checkpoint)
    assert sum(n for _, n in first.per_bin(now[0] - WEEK, 6 * HOUR)) == 4  # not 8 days ago
    first.save()
    saved = json.loads(checkpoint.read_text())
    assert sum(n for _, n in saved["hours"]) == 4
    again = LedgerView(ledger, clock=lambda: now[0], checkpoint=checkpoint)
    bins = again.per_bin(now[0] - WEEK, 6 * HOUR)
    assert sum(n for _, n in bins) == 4 and len(bins) == 29
    assert dict(bins)[int(T0 - 3 * DAY) // (6 * HOUR) * 6 * HOUR] == 2
    now[0] += 4 * DAY  # what is older than a week is forgotten
    assert sum(n for _, n in again.per_bin(now[0] - WEEK, 6 * HOUR)) == 3
    del saved["hours"]  # a checkpoint from before the week was kept: the last day's are counted
    checkpoint.write_text(json.dumps(saved))
    now[0] = T0
    older = LedgerView(ledger, clock=lambda: now[0], checkpoint=checkpoint)
    assert sum(n for _, n in older.per_bin(now[0] - WEEK, 6 * HOUR)) == 1


# --- a real agent ----------------------------------------------------------------------------


def test_after_an_agent_restart_the_charts_still_show_the_earlier_use(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    console = start_console_agent(start_agent, coordinator.url, tmp_path)
    state = console.agent.state_dir

    def earlier(c: ConsoleAgent) -> list[list[float | None]]:
        client, _ = c.session()
        with client:
            points: list[list[float | None]] = client.get("/api/charts?span=hour").json()["usage"]
            week = client.get("/api/charts?span=week").json()
            assert week["span"] == "week" and week["step_seconds"] == 600 and week["usage"]
        return [p for p in points if p[2] is not None]  # memory is always measured

    first = wait_for("a sample", lambda: earlier(console))
    assert stat.S_IMODE((state / FILE).stat().st_mode) == 0o640
    console.agent.proc.send_signal(signal.SIGTERM)  # not stop(): that removes the state dir
    assert console.agent.proc.wait(60) == 0
    port = free_port()
    again = start_agent(
        coordinator.url,
        "--runner",
        "trusted",
        "--config",
        str(console.config),
        env={"FLASHNODE_UI_LISTEN": f"127.0.0.1:{port}"},
        state_dir=state,
        name="again",
    )
    restarted = ConsoleAgent(again, port, console.config)
    restarted.wait_console()
    try:
        assert first[0] in earlier(restarted)
    finally:
        again.stop()
