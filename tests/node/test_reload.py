"""The reloader: a reload swaps one immutable Config, or is refused and keeps the running one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import FakeClock
from pydantic import ValidationError

from flashnode.config.settings import Settings
from flashnode.errors import ConfigError
from flashnode.node.reload import Config, Reloader
from flashnode.sandbox.limits import Limits


def settings(tmp_path: Path, **more: object) -> Settings:
    fields: dict[str, object] = {"pools": ("team-a",), **more}
    return Settings(
        coordinator="http://127.0.0.1:1",
        runner="trusted",
        state_dir=tmp_path,
        **fields,  # type: ignore[arg-type]
    )


class Threads:
    """Threads the test runs when it chooses."""

    def __init__(self) -> None:
        self.waiting: list[Callable[[], None]] = []

    def start(self, fn: Callable[[], None], name: str) -> None:
        assert name == "reload"
        self.waiting.append(fn)

    def run(self) -> None:
        while self.waiting:
            self.waiting.pop(0)()


def test_a_reload_swaps_the_settings_and_the_limits_derived_from_them_as_one(
    tmp_path: Path,
) -> None:
    old = settings(tmp_path)
    new = settings(tmp_path, pools=("team-b",), task_memory_bytes=1 << 30)
    threads, applied = Threads(), []
    reloader = Reloader(
        Config(old, Limits()),
        FakeClock(),
        threads.start,
        read=lambda: new,
        limits=lambda s: Limits(memory_bytes=s.task_memory_bytes),
        applied=applied.append,
    )
    reloader.request()
    assert reloader.requested and reloader.current.settings is old
    reloader.tick()
    # Until the slow part is done the running Config stays whole, and claims wait.
    assert reloader.busy and not reloader.requested
    assert reloader.current == Config(old, Limits())
    threads.run()
    assert reloader.current == Config(new, Limits(memory_bytes=1 << 30))
    assert applied == [reloader.current]
    assert not reloader.busy and reloader.refused is None


def test_a_reload_that_changes_what_needs_a_restart_is_refused_and_keeps_the_config(
    tmp_path: Path,
) -> None:
    old = settings(tmp_path)
    moved = settings(tmp_path / "elsewhere")
    clock, threads = FakeClock(), Threads()
    reloader = Reloader(Config(old, Limits()), clock, threads.start, read=lambda: moved)
    reloader.request()
    reloader.tick()
    assert threads.waiting == [] and not reloader.busy
    assert reloader.current.settings is old
    assert reloader.refused == {"at": clock.wall(), "reason": "changing state_dir needs a restart"}


def test_a_bad_configuration_file_is_refused_with_its_error(tmp_path: Path) -> None:
    def read() -> Settings:
        raise ConfigError("slots: must be a positive integer or 'auto'")

    old = settings(tmp_path)
    reloader = Reloader(Config(old, Limits()), FakeClock(), Threads().start, read=read)
    reloader.request()
    reloader.tick()
    assert reloader.current.settings is old
    assert reloader.refused is not None
    assert reloader.refused["reason"] == "slots: must be a positive integer or 'auto'"


def test_a_reload_the_runner_refuses_keeps_the_config_and_a_later_one_clears_the_refusal(
    tmp_path: Path,
) -> None:
    old = settings(tmp_path)
    new = settings(tmp_path, pools=("team-b",))
    threads, refuse = Threads(), [True]

    def prepare(s: Settings) -> None:
        if refuse.pop(0):
            raise RuntimeError("pool team-b: interpreter missing")

    reloader = Reloader(
        Config(old, Limits()), FakeClock(), threads.start, read=lambda: new, prepare=prepare
    )
    reloader.request()
    reloader.tick()
    threads.run()
    assert reloader.current.settings is old and not reloader.busy
    assert reloader.refused is not None
    assert reloader.refused["reason"] == "pool team-b: interpreter missing"
    refuse.append(False)
    reloader.request()
    reloader.tick()
    threads.run()
    assert reloader.current.settings is new and reloader.refused is None


def test_a_reload_asked_for_while_one_is_applied_waits_for_it(tmp_path: Path) -> None:
    old = settings(tmp_path)
    new = settings(tmp_path, pools=("team-b",))
    threads, reads = Threads(), []

    def read() -> Settings:
        reads.append(1)
        return new

    reloader = Reloader(Config(old, Limits()), FakeClock(), threads.start, read=read)
    reloader.request()
    reloader.tick()
    reloader.request()  # a second SIGHUP while the first is being applied
    reloader.tick()
    assert len(reads) == 1 and reloader.requested
    threads.run()
    reloader.tick()
    assert len(reads) == 2


def test_a_change_of_slots_needs_a_restart(tmp_path: Path) -> None:
    """The runner made its slots' users and sandboxes at the start: a reload cannot add one."""
    old = settings(tmp_path, slots=1)
    clock, threads = FakeClock(), Threads()
    more = settings(tmp_path, slots=4)
    reloader = Reloader(Config(old, Limits()), clock, threads.start, read=lambda: more)
    reloader.request()
    reloader.tick()
    assert threads.waiting == [] and reloader.current.settings is old
    assert reloader.refused == {"at": clock.wall(), "reason": "changing slots needs a restart"}


def test_a_reload_that_fails_half_applied_holds_claims_until_one_succeeds(tmp_path: Path) -> None:
    old = settings(tmp_path)
    new = settings(tmp_path, pools=("team-b",))
    threads, fail = Threads(), [True]

    def applied(config: Config) -> None:
        if fail.pop(0):
            raise OSError("no space left on device")

    reloader = Reloader(
        Config(old, Limits()), FakeClock(), threads.start, read=lambda: new, applied=applied
    )
    reloader.request()
    reloader.tick()
    threads.run()
    assert reloader.busy  # the loop claims nothing
    assert reloader.refused is not None
    assert "no space left on device" in reloader.refused["reason"]
    assert "no claims until a reload succeeds" in reloader.refused["reason"]
    fail.append(False)
    reloader.request()
    reloader.tick()  # a held node still takes the owner's next reload
    threads.run()
    assert not reloader.busy and reloader.refused is None


# --- what an attempt holds: a frozen snapshot ----------------------------------------------


def test_an_attempts_snapshot_cannot_be_changed_and_a_reload_leaves_it_as_claimed(
    tmp_path: Path,
) -> None:
    """Nothing an attempt holds changes under it: not the context, not its settings (nor the
    table of lent directories in them), not its limits; a reload changes what the next
    snapshot gets. Only ``lent_now`` follows the running configuration."""
    from fakes import FakeCoordinator, FakeRunner, context

    clock = FakeClock()
    (tmp_path / "scans").mkdir()
    (tmp_path / "notes").mkdir()
    lent = {"scans": tmp_path / "scans", "notes": tmp_path / "notes"}
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner(), local_data=lent)
    before, after = Limits(pids=100), Limits(pids=50)
    new = ctx.settings.model_copy(update={"task_pids": 50, "local_data": {"notes": lent["notes"]}})
    threads = Threads()
    reloader = Reloader(
        Config(ctx.settings, before),
        clock,
        threads.start,
        read=lambda: new,
        limits=lambda s: after if s is new else before,
    )
    claimed = reloader.snapshot(ctx)
    with pytest.raises(dataclasses.FrozenInstanceError):
        claimed.settings = new  # type: ignore[misc]
    with pytest.raises(ValidationError):
        claimed.settings.task_pids = 50  # type: ignore[misc]
    with pytest.raises(TypeError):
        claimed.settings.local_data["etc"] = Path("/etc")  # type: ignore[index]
    reloader.request()
    reloader.tick()
    threads.run()
    assert reloader.current.settings is new
    assert (claimed.settings.task_pids, claimed.limits) == (4096, before)
    assert set(claimed.settings.local_data) == {"scans", "notes"}
    assert claimed.lent_now is not None and set(claimed.lent_now()) == {"notes"}
    following = reloader.snapshot(ctx)
    assert (following.settings.task_pids, following.limits) == (50, after)


def test_a_snapshot_taken_while_reloads_are_applied_pairs_settings_with_their_own_limits(
    tmp_path: Path,
) -> None:
    """The reload's thread swaps the configuration while the loop takes snapshots for its
    claims: each snapshot holds one whole configuration, never the new settings with the old
    limits."""
    import threading

    from fakes import FakeCoordinator, FakeRunner, context

    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner())
    versions = iter(range(100, 400))

    def read() -> Settings:
        return ctx.settings.model_copy(update={"task_pids": next(versions)})

    def start(fn: Callable[[], None], name: str) -> None:
        threading.Thread(target=fn, name=name).start()

    reloader = Reloader(
        Config(ctx.settings, Limits(pids=ctx.settings.task_pids)),
        clock,
        start,
        read=read,
        limits=lambda s: Limits(pids=s.task_pids),
    )
    done = threading.Event()
    mismatched: list[tuple[int | None, int | None]] = []

    def claims() -> None:
        while not done.is_set():
            snap = reloader.snapshot(ctx)
            if snap.settings.task_pids != snap.limits.pids:
                mismatched.append((snap.settings.task_pids, snap.limits.pids))

    claimer = threading.Thread(target=claims)
    claimer.start()
    for _ in range(200):
        reloader.request()
        reloader.tick()
        while reloader.busy:
            threading.Event().wait(0.0005)
    done.set()
    claimer.join()
    assert reloader.current.settings.task_pids == 299
    assert mismatched == []
