"""A directory the owner stops lending is mounted by no task from then on, not even one whose
dataset slices were still being fetched when the owner reloaded."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease


class SlowOrigin:
    """The dataset cache, fetching a slice from an origin the job named (the attacker's: it
    drips its bytes for as long as the fetch timeout allows); ``during`` runs meanwhile."""

    budget_bytes = 1 << 30

    def __init__(self, during: Callable[[], object]) -> None:
        self.during = during
        self.released = 0

    def acquire_all(self, entries: Any, *, stop: threading.Event) -> list[Any]:
        self.during()  # the hour the fetch takes: the owner reloads meanwhile
        cache = self

        class Pinned:
            fetched, seconds = True, 1.0

            def __init__(self, entry: Any) -> None:
                self.entry, self.size = entry, entry.size

            def release(self) -> None:
                cache.released += 1

        return [Pinned(e) for e in entries]

    def layout(self, handles: Any, dest: Path, *, task_uid: int) -> None:
        dest.mkdir(exist_ok=True)


def test_a_directory_the_owner_stops_lending_during_the_dataset_fetch_is_not_mounted(
    tmp_path: Path,
) -> None:
    """A task asks for the owner's lent directory "photos" and for a dataset slice from its own
    slow origin. The owner stops lending "photos" (it holds private files after all) and
    reloads while the slice is being fetched. The check that the label is still lent ran before
    the fetch, and the plan is resolved after it without checking again: the task is started
    with "photos" mounted, the owner's withdrawal ignored for as long as the fetch took."""
    from flashnode.attempt import Attempt, Outcome

    photos = tmp_path / "owner" / "photos"
    photos.mkdir(parents=True)
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = FakeRunner()
    ctx = context(tmp_path / "state", clock, coord, runner, local_data={"photos": photos})
    lent_now: dict[str, Path] = {"photos": photos}
    origin = SlowOrigin(lambda: lent_now.pop("photos"))  # the owner's reload, mid-fetch
    ctx = dataclasses.replace(ctx, data=origin, lent_now=lambda: dict(lent_now))
    entries = [
        {
            "path": "part-0.bin",
            "url": "https://slow.attacker.example/0",
            "size": 10,
            "integrity": {"kind": "sha256", "value": "ab" * 32},
        }
    ]
    a = Attempt(
        ctx, lease(local_inputs=["photos"], datasets=[{"name": "bait", "entries": entries}])
    )
    outcome = a.run()
    mounted = [src for plan in runner.started for src, _ in plan.views]
    assert str(photos) not in mounted, "the task was started with the withdrawn directory"
    assert outcome is Outcome.LAPSED and origin.released == 1
