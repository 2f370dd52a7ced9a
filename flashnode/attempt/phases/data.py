"""Data: the owner's lent directories a task asked for (``local_inputs``), and its dataset slices
(``datasets``), made ready before it starts.

* Lent data: exactly the labels asked for, each a read-only view of the owner's directory at
  ``/work/inputs/<label>`` (the runner mounts it: a read-only bind mount in the task's own mount
  namespace, or in its container). Here the mount point is made, an empty directory of the agent's
  in ``inputs/``; the owner's files are never copied, changed or uploaded. A label this node does
  not lend fails the attempt, naming it.
* Dataset slices: every entry fetched through the agent's dataset cache (verified, shared, at most
  once however many tasks need it), pinned until the attempt has ended, and laid out read-only at
  ``/work/data/<name>/<path>`` (hard links into the cache: ``data/`` is never handed to the task's
  user). The lease is renewed meanwhile by the keeper. Wrong bytes fail the attempt
  (DataIntegrityError); an origin that cannot be reached, or a cache too small now, lets the
  lease lapse (DataUnavailable).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from flashnode.caches import localdata
from flashnode.errors import AttemptLapsed, DataUnavailable
from flashnode.runners.plan import WORK, Contribution
from flashnode.runners.registry import capabilities

if TYPE_CHECKING:
    from flashnode.attempt.context import ShardLease
    from flashnode.attempt.hooks import AttemptView
    from flashnode.attempt.record import Staged
    from flashnode.config.settings import Settings


def run(a: AttemptView, staged: Staged) -> Contribution:
    """What the task's start gets for its data: the views of the lent directories it asked for,
    and its dataset slices laid out in its workspace; its release unpins the slices."""
    views = _lend(a, staged)
    handles = _fetch(a, staged)
    if not handles:
        return Contribution(views=views)

    def release() -> None:
        for handle in handles:
            handle.release()

    return Contribution(views=views, datasets=True, release=release)


def _lend(a: AttemptView, staged: Staged) -> tuple[tuple[str, str], ...]:
    task, ws = staged.task, staged.workspace
    if not task.local_inputs:
        return ()
    inputs = {i.dest for i in task.inputs}
    lent = localdata.mounts(list(task.local_inputs), a.ctx.settings.local_data, WORK, inputs)
    views = tuple((str(m.source), str(m.target)) for m in lent)
    still_lent(a, views)
    for mount in lent:
        (ws.inputs / mount.label).mkdir(mode=0o700)
    a.report("local_inputs", [m.label for m in lent])
    return views


def still_lent(a: AttemptView, views: Sequence[tuple[str, str]]) -> None:
    """Raise AttemptLapsed when the owner stopped lending a directory of ``views`` (host path,
    ``/work/inputs/<label>``) since the claim (a reload): such a directory is mounted by no
    task from then on. Checked when the views are made and again just before the task starts
    (a dataset fetch between the two can take as long as its timeout)."""
    if a.ctx.lent_now is None or not views:
        return
    now = a.ctx.lent_now()
    for source, target in views:
        label = PurePosixPath(target).name
        if str(now.get(label, "")) != source:
            raise AttemptLapsed(
                f"local input {label!r} is no longer lent by this node (the owner reloaded)"
            )


def _fetch(a: AttemptView, staged: Staged) -> list[ShardLease]:
    """The slices fetched, pinned and laid out; unpinned again here if anything of it fails."""
    entries, cache = staged.task.datasets, a.ctx.data
    if not entries:
        return []
    needed = sum(e.size for e in entries)
    if cache is None or needed > cache.budget_bytes:
        # The coordinator placed it by the budget this node advertised: smaller now (reloaded).
        budget = cache.budget_bytes if cache is not None else 0
        raise AttemptLapsed(
            f"dataset slices need {needed} bytes; this node's dataset cache holds {budget}"
        )
    started = a.ctx.clock.monotonic()
    try:
        handles = cache.acquire_all(entries, stop=a.stop)
    except DataUnavailable:
        a.check()  # a fetch cut short by a lost lease or a cancel ends the way they say
        raise
    try:
        a.check()
        cache.layout(handles, staged.workspace.data, task_uid=_task_uid(a.ctx.settings))
    except BaseException:
        for handle in handles:
            handle.release()
        raise
    fetched = [h for h in handles if h.fetched]
    a.report(
        "data",
        {
            "entries": len(handles),
            "cache_hits": len(handles) - len(fetched),
            "bytes_fetched": sum(h.size for h in fetched),
            "bytes": needed,
            "seconds": round(a.ctx.clock.monotonic() - started, 3),
        },
    )
    return list(handles)


def _task_uid(s: Settings) -> int:
    """The uid the task will run as, as far as laying out shards cares: whether it is the
    agent's own (a shard is then copied, never linked, since the owner of a link could make it
    writable). A root agent's tasks never run as root (task users, a container user that is not
    root): -1 stands for "someone else"."""
    identity = capabilities(s).task_identity
    if identity is None or identity[0] == 0:  # each slot's task user; never root
        return -1
    return identity[0]
