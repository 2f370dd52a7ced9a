"""The owner's rules (controls.py) with a fake clock and fake readers; their settings; sensors."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from flashnode.config.loading import load
from flashnode.config.schedule import Pause, parse_duration, parse_window
from flashnode.errors import ConfigError
from flashnode.evidence import sensors
from flashnode.node.controls import Controls
from flashnode.node.rules import Readers, Rules
from flashnode.owner import pausefile

UTC = timezone.utc
MONDAY = datetime(2024, 1, 1, tzinfo=UTC)  # 2024-01-01 was a Monday


@dataclass
class Clock:
    mono: float = 100.0
    wall_at: float = MONDAY.timestamp()

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.wall_at

    def wait(self, event: object, timeout: float) -> bool:
        raise AssertionError("controls never wait")

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall_at += seconds

    def at(self, when: datetime) -> None:
        self.wall_at = when.timestamp()


@dataclass
class Fake:
    """Readers whose values the test sets; counts how often each was read."""

    pause: Pause | None = None
    battery: bool | None = None
    idle: float | None = None
    host: tuple[float, float] | None = (0.0, 0.0)
    tasks: dict[str, float] = field(default_factory=dict)
    reads: dict[str, int] = field(default_factory=dict)

    def _count(self, what: str) -> None:
        self.reads[what] = self.reads.get(what, 0) + 1

    def readers(self) -> Readers:
        def battery() -> bool | None:
            self._count("battery")
            return self.battery

        def idle() -> float | None:
            self._count("idle")
            return self.idle

        def tasks() -> Mapping[str, float]:
            return dict(self.tasks)

        return Readers(
            pause=lambda: self.pause,
            on_battery=battery,
            idle_seconds=idle,
            host_cpu=lambda: self.host,
            task_cpu=tasks,
        )


def controls(rules: Rules, fake: Fake | None = None, clock: Clock | None = None) -> Controls:
    return Controls(rules, (fake or Fake()).readers(), clock or Clock())


def windows(*texts: str, tz: object = UTC) -> Rules:
    return Rules(windows=tuple(parse_window(t) for t in texts), tz=tz)  # type: ignore[arg-type]


# --- time windows ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "inside"),
    [
        (MONDAY + timedelta(hours=18, minutes=59), False),
        (MONDAY + timedelta(hours=19), True),
        (MONDAY + timedelta(days=1, hours=6, minutes=59), True),  # Tue morning: Mon's window
        (MONDAY + timedelta(days=1, hours=7), False),
        (MONDAY + timedelta(days=5, hours=6), True),  # Sat 06:00: Fri's window crosses midnight
        (MONDAY + timedelta(days=5, hours=12), True),  # Sat: the whole day
        (MONDAY + timedelta(days=6, hours=23, minutes=59), True),  # Sun night
        (MONDAY + timedelta(hours=6, minutes=59), False),  # Mon morning: Sun has no night window
        (MONDAY + timedelta(days=2, hours=12), False),  # Wed noon
    ],
)
def test_a_window_rule_holds_claiming_outside_its_windows(when: datetime, inside: bool) -> None:
    clock = Clock()
    clock.at(when)
    c = controls(windows("Mon-Fri 19:00-07:00", "Sat-Sun"), clock=clock)
    decision = c.evaluate()
    assert decision.may_claim is inside
    if not inside:
        assert decision.hold_reason is not None and "outside run_windows" in decision.hold_reason
        assert decision.suspend_reason is None  # window is not in suspend_when


def test_a_window_says_when_it_opens_and_follows_the_fake_clock_across_the_boundary() -> None:
    clock = Clock()
    clock.at(MONDAY + timedelta(hours=18, minutes=59, seconds=30))
    c = controls(windows("Mon-Fri 19:00-07:00"), clock=clock)
    first = c.evaluate()
    assert not first.may_claim and "next opens Mon 19:00" in (first.hold_reason or "")
    clock.advance(30)
    assert c.evaluate().may_claim
    clock.at(MONDAY + timedelta(days=5, hours=7))  # Sat 07:00: next is Mon 19:00
    assert "next opens Mon 19:00" in (c.evaluate().hold_reason or "")


def test_windows_are_in_the_configured_time_zone() -> None:
    clock = Clock()
    clock.at(MONDAY + timedelta(hours=8, minutes=30))  # 08:30 UTC = 09:30 in Berlin (winter)
    assert not controls(windows("09:00-17:00"), clock=clock).evaluate().may_claim
    berlin = windows("09:00-17:00", tz=ZoneInfo("Europe/Berlin"))
    assert controls(berlin, clock=clock).evaluate().may_claim


def test_a_window_on_sunday_night_wraps_into_monday() -> None:
    clock = Clock()
    clock.at(MONDAY + timedelta(hours=1))
    assert controls(windows("Sun 22:00-02:00"), clock=clock).evaluate().may_claim
    clock.at(MONDAY + timedelta(hours=2))
    assert not controls(windows("Sun 22:00-02:00"), clock=clock).evaluate().may_claim


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Mon-Fry 19:00-07:00", "unknown day 'Fry'"),
        ("Mon-Fri 19:00", "not a time range"),
        ("Mon-Fri 7pm-7am", "not a time range"),
        ("Mon-Fri 25:00-07:00", "not a time range"),
        ("Mon-Fri 19:60-07:00", "not a time range"),
        ("19:00-07:00 Mon-Fri", "not a list of days"),
        ("Mon-Fri 09:00-09:00", "empty or a whole day"),
        ("Mon-Fri 00:00-24:00", "empty or a whole day"),
        ("Mon 24:00-02:00", "cannot start at 24:00"),
        ("Mon,Mon", "named twice"),
        ("", "is not a run window"),
        ("Mon-Fri 09:00-12:00 extra", "is not a run window"),
    ],
)
def test_bad_windows_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_window(text)


def test_window_syntax_accepts_lists_wrapping_ranges_full_names_and_24_00() -> None:
    w = parse_window("fri-Mon 20:00-24:00")
    assert len(w.intervals) == 4
    assert parse_window("Monday,Wednesday 09:00-17:00").intervals == (
        (9 * 60, 17 * 60),
        (2 * 1440 + 9 * 60, 2 * 1440 + 17 * 60),
    )
    assert parse_window("09:00-17:00").intervals[6] == (6 * 1440 + 540, 6 * 1440 + 1020)


# --- the explicit pause ----------------------------------------------------------------------


def test_a_pause_holds_claiming_until_it_expires_and_now_also_stops_tasks() -> None:
    clock = Clock()
    fake = Fake(pause=Pause("drain", until=clock.wall() + 60, since=clock.wall()))
    c = controls(Rules(), fake, clock)
    d = c.evaluate()
    assert not d.may_claim and d.paused is not None and d.stop_reason is None
    assert "paused by the owner until" in (d.hold_reason or "")
    clock.advance(60)
    d = c.evaluate()
    assert d.may_claim and d.paused is None
    fake.pause = Pause("now", until=None, since=clock.wall())
    d = c.evaluate()
    assert not d.may_claim and d.stop_reason is not None and "flashnode resume" in d.stop_reason
    assert d.snapshot()["paused"]["mode"] == "now"
    assert d.snapshot()["held_by"][0]["rule"] == "pause"


def test_an_unreadable_pause_file_fails_closed(tmp_path: Path) -> None:
    (tmp_path / "pause.json").write_text("{not json")
    c = Controls(Rules(), Readers(pause=pausefile.PauseReader(tmp_path)), Clock())
    d = c.evaluate()
    assert not d.may_claim and "unreadable" in (d.hold_reason or "") and d.stop_reason is None
    (tmp_path / "pause.json").unlink()
    assert c.evaluate().may_claim


def test_the_pause_reader_sees_a_new_pause_and_its_removal(tmp_path: Path) -> None:
    reader = pausefile.PauseReader(tmp_path)
    assert reader() is None
    pausefile.write(tmp_path, Pause("drain", None, 5.0))
    assert reader() == Pause("drain", None, 5.0)
    assert (tmp_path / "pause.json").stat().st_mode & 0o777 == 0o640
    pausefile.write(tmp_path, Pause("now", 99.0, 6.0))
    assert reader() == Pause("now", 99.0, 6.0)
    assert pausefile.clear(tmp_path) and not pausefile.clear(tmp_path)
    assert reader() is None


@pytest.mark.parametrize(
    "text",
    [
        '{"version": 1, "mode": "later", "until": null, "since": 0}',
        '{"version": 2, "mode": "now", "until": null, "since": 0}',
        '{"version": 1, "mode": "now", "until": "tomorrow", "since": 0}',
        '{"version": 1, "mode": "now", "until": NaN, "since": 0}',
        '{"version": 1, "mode": "now", "until": null, "since": 0, "x": 1}',
        "[]",
    ],
)
def test_pause_records_are_read_strictly(tmp_path: Path, text: str) -> None:
    (tmp_path / "pause.json").write_text(text)
    with pytest.raises(ValueError):
        pausefile.read(tmp_path)


def test_a_symlinked_pause_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text('{"version": 1, "mode": "drain", "until": null, "since": 0}')
    (tmp_path / "pause.json").symlink_to(target)
    with pytest.raises(ValueError):
        pausefile.read(tmp_path)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30m", 1800), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("90s", 90)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "m", "1.5h", "-1h", "0m", "2y", "400d", "1 h"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


# --- battery, activity, load -----------------------------------------------------------------


def test_battery_holds_at_once_and_releases_only_after_the_clear_period() -> None:
    clock, fake = Clock(), Fake(battery=True)
    c = controls(
        Rules(on_battery=True, clear_seconds=60, suspend=frozenset({"battery"})), fake, clock
    )
    d = c.evaluate()
    assert not d.may_claim and d.suspend_reason == "on battery"
    fake.battery = False
    clock.advance(5)
    d = c.evaluate()
    assert not d.may_claim and "until recently" in (d.hold_reason or "")
    assert d.suspend_reason is not None  # still suspending: no flapping
    clock.advance(30)
    assert not c.evaluate().may_claim
    fake.battery = True  # unplugged again: the clear period starts over
    clock.advance(5)
    assert not c.evaluate().may_claim
    fake.battery = False
    clock.advance(5)
    assert not c.evaluate().may_claim
    clock.advance(59)
    assert not c.evaluate().may_claim
    clock.advance(5)
    d = c.evaluate()
    assert d.may_claim and d.suspend_reason is None


def test_no_battery_never_holds_and_the_battery_is_read_at_most_every_few_seconds() -> None:
    clock, fake = Clock(), Fake(battery=None)
    c = controls(Rules(on_battery=True), fake, clock)
    for _ in range(11):
        assert c.evaluate().may_claim
        clock.advance(0.5)
    assert fake.reads["battery"] == 2  # at 0 s and at 5 s


def test_an_active_owner_holds_claiming_and_suspends_when_asked() -> None:
    clock, fake = Clock(), Fake(idle=12.0)
    rules = Rules(when_active=True, active_idle_seconds=300, suspend=frozenset({"active"}))
    c = controls(rules, fake, clock)
    d = c.evaluate()
    assert not d.may_claim and "last input 12 s ago" in (d.suspend_reason or "")
    fake.idle = 301.0
    clock.advance(5)
    assert c.evaluate().may_claim


def test_activity_unavailable_on_a_headless_machine_never_holds_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    c = controls(Rules(when_active=True), Fake(idle=None), clock)
    with caplog.at_level(logging.WARNING, logger="flashnode.node.controls"):
        for _ in range(4):
            assert c.evaluate().may_claim
            clock.advance(5)
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        "owner control active: the seat's idle time is unavailable"
        " (no logind seat: a headless machine?): the rule is off until it can be"
    ]


def test_load_counts_other_programs_only_and_has_hysteresis() -> None:
    clock, fake = Clock(), Fake(host=(0.0, 0.0))
    rules = Rules(load_percent=50, clear_seconds=20)
    c = controls(rules, fake, clock)
    assert c.evaluate().may_claim  # the first reading only starts the window

    # 10 s on a 4-core machine = 40 CPU-seconds; 36 busy, 32 of them our task's: others 10%.
    clock.advance(10)
    fake.host, fake.tasks = (36.0, 40.0), {"lease-a": 32.0}
    assert c.evaluate().may_claim

    # Others now busy: 30 of 40 seconds, our task idle.
    clock.advance(10)
    fake.host = (66.0, 80.0)
    d = c.evaluate()
    assert not d.may_claim and "75%" in (d.hold_reason or "") and d.suspend_reason is None

    # Quiet again: held for 20 s more, then released.
    clock.advance(10)
    fake.host = (68.0, 120.0)
    assert not c.evaluate().may_claim
    clock.advance(10)
    fake.host = (70.0, 160.0)
    assert not c.evaluate().may_claim
    clock.advance(10)
    fake.host = (72.0, 200.0)
    assert c.evaluate().may_claim


def test_load_of_a_task_that_started_between_readings_counts_as_ours() -> None:
    clock, fake = Clock(), Fake(host=(0.0, 0.0))
    c = controls(Rules(load_percent=50), fake, clock)
    c.evaluate()
    clock.advance(10)
    fake.host, fake.tasks = (38.0, 40.0), {"new": 36.0}  # busy, but nearly all of it is ours
    assert c.evaluate().may_claim


def test_unreadable_task_cpu_makes_load_unmeasured_not_high() -> None:
    clock = Clock()
    fake = Fake(host=(0.0, 0.0))
    readers = fake.readers()
    readers.task_cpu = lambda: None
    c = Controls(Rules(load_percent=10), readers, clock)
    c.evaluate()
    clock.advance(10)
    fake.host = (40.0, 40.0)
    assert c.evaluate().may_claim


def test_several_rules_hold_together_and_only_named_ones_suspend() -> None:
    clock = Clock()
    clock.at(MONDAY + timedelta(hours=12))
    fake = Fake(battery=True, idle=1.0)
    rules = Rules(
        windows=(parse_window("Sat-Sun"),),
        tz=UTC,
        on_battery=True,
        when_active=True,
        suspend=frozenset({"battery"}),
    )
    d = controls(rules, fake, clock).evaluate()
    assert [h.rule for h in d.holds] == ["window", "battery", "active"]
    assert d.suspend_reason == "on battery"


def test_reconfigure_turns_a_rule_off_at_once() -> None:
    clock, fake = Clock(), Fake(battery=True)
    c = controls(Rules(on_battery=True), fake, clock)
    assert not c.evaluate().may_claim
    c.reconfigure(Rules())
    assert c.evaluate().may_claim


def test_changes_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock, fake = Clock(), Fake(battery=True)
    c = controls(Rules(on_battery=True, clear_seconds=0), fake, clock)
    with caplog.at_level(logging.INFO, logger="flashnode.node.controls"):
        for _ in range(3):
            c.evaluate()
            clock.advance(5)
        fake.battery = False
        for _ in range(3):
            c.evaluate()
            clock.advance(5)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "owner control battery holds claiming: on battery",
        "owner control battery released",
        "claiming resumes: no owner control holds",
    ]


# --- settings --------------------------------------------------------------------------------

URL = "http://127.0.0.1:8100"


def settings_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "f.toml"
    path.write_text(f'coordinator = "{URL}"\n' + text)
    return path


def test_owner_control_settings_load_and_build_rules(tmp_path: Path) -> None:
    s = load(
        {},
        {},
        settings_file(
            tmp_path,
            'run_windows = ["Mon-Fri 19:00-07:00", "Sat-Sun"]\n'
            'run_windows_timezone = "Europe/Berlin"\n'
            "hold_on_battery = true\nhold_above_load_percent = 40\n"
            'suspend_when = ["battery", "window", "battery"]\n'
            'metrics_listen = "unix:/run/flashnode/metrics.sock"\n',
        ),
    )
    rules = Rules.from_settings(s)
    assert len(rules.windows) == 2 and rules.tz == ZoneInfo("Europe/Berlin")
    assert rules.suspend == {"battery", "window"} and rules.load_percent == 40
    env = load(
        {},
        {
            "FLASHNODE_COORDINATOR": URL,
            "FLASHNODE_RUN_WINDOWS": "Mon,Wed 09:00-17:00; Sat-Sun",
            "FLASHNODE_HOLD_WHEN_ACTIVE": "true",
            "FLASHNODE_SUSPEND_WHEN": "active,window",
        },
    )
    assert env.run_windows == ("Mon,Wed 09:00-17:00", "Sat-Sun")
    assert env.suspend_when == ("active", "window")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('run_windows = ["Mon-Fry"]', "unknown day 'Fry'"),
        ('run_windows_timezone = "Mars/Olympus"', "not a known time zone"),
        ('suspend_when = ["battery"]', "suspend_when names 'battery' but hold_on_battery"),
        ('suspend_when = ["sleepy"]', "suspend_when"),
        ("hold_above_load_percent = 100", "hold_above_load_percent"),
        ("active_idle_seconds = 0", "active_idle_seconds"),
        ('metrics_listen = "0.0.0.0:9464"', "metrics_allow_remote"),
        ('metrics_listen = "metrics.example.org:9464"', "metrics_allow_remote"),
        ('metrics_listen = "9464"', "is not HOST:PORT"),
        ('metrics_listen = "unix:relative.sock"', "absolute path"),
        ('metrics_listen = "::1:9464"', "in brackets"),
    ],
)
def test_owner_control_settings_are_strict(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load({}, {}, settings_file(tmp_path, text + "\n"))


def test_remote_metrics_need_the_opt_in(tmp_path: Path) -> None:
    s = load(
        {},
        {},
        settings_file(tmp_path, 'metrics_listen = "0.0.0.0:9464"\nmetrics_allow_remote = true\n'),
    )
    assert s.metrics_listen == "0.0.0.0:9464"
    assert load({}, {}, settings_file(tmp_path, 'metrics_listen = "[::1]:9464"\n'))


# --- sensors (the edge) ----------------------------------------------------------------------


def test_seat_idle_time_from_loginctl_output() -> None:
    now = 50_000_000_000
    assert sensors.parse_seat("IdleHint=no\nIdleSinceHintMonotonic=0\n", now) == 0.0
    idle = "IdleHint=yes\nIdleSinceHintMonotonic=49880000000\n"
    assert sensors.parse_seat(idle, now) == 120.0
    assert sensors.parse_seat("", now) is None
    assert sensors.parse_seat("IdleHint=yes\nIdleSinceHintMonotonic=n/a\n", now) is None


def test_seat_idle_time_through_a_real_loginctl_process(tmp_path: Path) -> None:
    fake = tmp_path / "loginctl"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$3" = seat0 ] || exit 1\n'
        "echo IdleHint=yes\n"
        f"echo IdleSinceHintMonotonic={1}\n"
    )
    fake.chmod(0o755)
    idle = sensors.seat_idle_seconds(str(fake))
    assert idle is not None and idle > 0
    missing = tmp_path / "nologind"
    missing.write_text("#!/bin/sh\necho 'No seat seat0 known' >&2\nexit 1\n")
    missing.chmod(0o755)
    assert sensors.seat_idle_seconds(str(missing)) is None
    assert sensors.seat_idle_seconds(str(tmp_path / "absent")) is None


def test_on_this_machine_the_sensors_answer_without_raising() -> None:
    assert sensors.on_battery() in (None, True, False)
    # This CI container has no logind: the rule is unavailable, not an error.
    if not os.path.exists("/run/systemd/seats/seat0"):
        assert sensors.seat_idle_seconds() is None
    busy, total = sensors.host_cpu_times()
    assert 0 <= busy <= total


def test_battery_states(monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import namedtuple

    import psutil

    Battery = namedtuple("Battery", "percent secsleft power_plugged")
    for value, expected in [
        (None, None),
        (Battery(50, 100, False), True),
        (Battery(50, 100, True), False),
        (Battery(50, 100, None), None),
    ]:
        monkeypatch.setattr(psutil, "sensors_battery", lambda v=value: v)
        assert sensors.on_battery() is expected


def test_every_rule_that_holds_says_what_the_owner_can_do_about_it() -> None:
    """Each hold carries a fix: the owner is never left guessing (status and the console show
    it under the hold)."""
    clock = Clock()
    fake = Fake(pause=Pause("drain", None, 0.0), battery=True, idle=3.0, host=(0.0, 100.0))
    rules = Rules(
        windows=(parse_window("Tue 10:00-11:00"),),
        tz=UTC,
        on_battery=True,
        when_active=True,
        load_percent=10.0,
    )
    c = controls(rules, fake, clock)
    c.evaluate()
    clock.advance(6)
    fake.host = (95.0, 200.0)
    d = c.evaluate()
    assert {h.rule for h in d.holds} == {"pause", "window", "battery", "active", "load"}
    assert all(h.fix for h in d.holds), d.holds
    assert {h["rule"]: h["fix"] for h in d.snapshot()["held_by"]} == {
        h.rule: h.fix for h in d.holds
    }
    # The window's next opening: a weekday, the zone, and how far (never "Tue 10:00" alone).
    window = next(h for h in d.holds if h.rule == "window")
    assert "next opens Tue 10:00 UTC (in 1d09h" in window.reason, window.reason


def test_a_window_that_opened_earlier_today_says_it_opens_next_week() -> None:
    clock = Clock()
    clock.at(MONDAY + timedelta(hours=14, minutes=12))
    d = controls(windows("Mon 13:00-14:00"), clock=clock).evaluate()
    assert "next opens Mon 13:00 UTC (in 6d22h)" in (d.hold_reason or ""), d.hold_reason
