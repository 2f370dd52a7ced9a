"""The trusted runner's slots between their tasks.

A ``SlotPool`` owns, for each slot, what lies between one task of the slot and the next:

* the **turnover** after a task (``turn_over``), on the slot's worker thread, off the attempt's
  way (and off the other slots': one slot's task that is slow to go holds up no other): the
  task's cgroup removed, the keyrings of the slot's user cleared, then the slot's next chain
  started. In this order: no process of the slot's user may live beside a chain waiting for
  the next task (same user: it could trace it, or write a script of its own into its pipe). Then,
  with the slot's next start no longer waiting, the task's supervisor (root's) is let go of;
* the **chain kept ahead** for the slot's next task (``procs.launch.Launch``: its cgroup, namespaces
  and private directories, and an empty directory of the agent's bound at ``/work``, into which
  the next task's workspace is moved), so that a task starts with one exec. ``take`` waits for
  the slot's turnover, then gives the chain to a task that can use it, or ends it;
* the **cgroups of chains kept ahead**, named for the state dir, so that the next start of this
  agent removes the ones a crash left (``reconcile``), and no other agent's;
* their end: ``close`` ends every chain still kept.

What it does not own: which user a slot runs as, the sandbox a task gets (the runner builds it;
the pool compares it with its chain's), the CPU cap, and the task's own start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flashnode.runners.background import Background
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.keyrings import clear_user_keyrings
from flashnode.sandbox.procs.launch import Launch
from flashnode.sandbox.procs.mounts import Sandbox

log = logging.getLogger(__name__)

# Starts a chain: (its working directory, bound at /work; its cgroup; its user; its sandbox).
Launcher = Callable[
    [Path, cgroups.AttemptCgroup | None, procs.TaskUser | None, Sandbox | None],
    Launch,
]


@dataclass(frozen=True)
class ChainAhead:
    """A slot's chain kept ahead, waiting for its script, and the directory it has bound at
    /work (the next task's workspace is moved into it: ``Workspace.move_into``)."""

    launch: Launch
    work: Path

    def discard(self) -> None:
        """End the chain (no task took it), and remove the directory it had bound at /work
        (gone already when a workspace was moved into it)."""
        self.launch.discard()
        with contextlib.suppress(OSError):
            self.work.rmdir()


class SlotPool:
    """The slots of one trusted runner (see the module docstring).

    ``state_dir``: the agent's (its chains' directories lie in ``attempts/``; their cgroups are
    named for it). ``hierarchy``: where their cgroups are made (None: no chain is kept ahead).
    ``blank``: the sandbox of a chain kept ahead (a task with nothing of its own: no read-only
    views, no hidden GPUs, the lent directories covered as they are now), asked at each start.
    ``ahead``: whether chains are kept ahead at all (every task of a slot gets the same chain:
    its own user, a cgroup, the sandbox). ``launcher`` and ``clear_keyrings``: the edges
    (``procs.launch.Launch``, ``procs.keyrings.clear_user_keyrings``), replaceable for tests.
    """

    def __init__(
        self,
        state_dir: Path,
        hierarchy: cgroups.Hierarchy | None,
        blank: Callable[[], Sandbox],
        *,
        ahead: bool,
        launcher: Launcher = Launch,
        clear_keyrings: Callable[[procs.TaskUser], str | None] = clear_user_keyrings,
    ) -> None:
        self._attempts = state_dir / "attempts"
        self._hierarchy = hierarchy
        self._blank = blank
        self._ahead_ok = ahead and hierarchy is not None
        self._launcher = launcher
        self._clear_keyrings = clear_keyrings
        digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()
        self.prefix = f"ahead-{digest[:12]}-"  # the cgroups of its chains (``reconcile``)
        self._lock = threading.Lock()
        self._ahead: dict[int, ChainAhead] = {}  # slot -> its chain kept ahead
        self._turnovers: dict[int, threading.Event] = {}  # slot -> its turnover done
        self._workers: dict[int, Background] = {}  # slot -> its turnovers' thread
        self._closed = False

    def take(self, slot: int, sandbox: Sandbox | None) -> ChainAhead | None:
        """Once the slot's turnover is done: its chain kept ahead, if a task with ``sandbox``
        can use it (the same sandbox, and still waiting); else None, the chain ended first
        (nothing of the slot's user runs beside a task of another chain). The chain is the
        caller's from here on: to start the task in, or to ``discard``."""
        with self._lock:
            done = self._turnovers.pop(slot, None)
        if done is not None:
            done.wait()
        with self._lock:
            ahead = self._ahead.pop(slot, None)
        if ahead is None:
            return None
        if ahead.launch.sandbox == sandbox and ahead.launch.alive():
            return ahead
        ahead.discard()
        return None

    def turn_over(
        self,
        slot: int,
        user: procs.TaskUser | None,
        cgroup: cgroups.AttemptCgroup | None,
        let_go: Callable[[], None] = lambda: None,
    ) -> None:
        """The slot's task has ended and its processes are gone: the slot's turnover (the
        module docstring), queued on the slot's worker thread; the slot's next ``take`` waits
        for it. ``user``: the slot's (None: the agent's own, the same-user mode); ``cgroup``:
        the task's; ``let_go``: lets go of the task's supervisor (root's, never in the task's
        cgroup), queued after the turnover: the slot's next start does not wait for it."""
        with self._lock:
            worker = self._workers.setdefault(slot, Background(f"turnovers-{slot}"))
            self._turnovers[slot] = worker.submit(lambda: self._turn_over(slot, user, cgroup))
        worker.submit(lambda: self._let_go(slot, let_go))

    def prime(self, slot: int, user: procs.TaskUser) -> None:
        """The slot has no task (the agent has just started, and no task of an earlier run
        runs in it): a turnover without a task, queued as ``turn_over``'s, so that its first task
        starts as every later one does, in a chain kept ahead (and its user's keyrings are
        cleared of what an earlier run's task left)."""
        with self._lock:
            worker = self._workers.setdefault(slot, Background(f"turnovers-{slot}"))
            self._turnovers[slot] = worker.submit(lambda: self._turn_over(slot, user, None))

    @staticmethod
    def _let_go(slot: int, let_go: Callable[[], None]) -> None:
        try:
            let_go()
        except Exception:
            log.exception("slot %d: cannot let go of its task's supervisor", slot)

    def _turn_over(
        self, slot: int, user: procs.TaskUser | None, cgroup: cgroups.AttemptCgroup | None
    ) -> None:
        try:
            gone = cgroup.remove() if cgroup is not None else True
            if user is not None:
                why = self._clear_keyrings(user)
                if why:  # a task may lock its user's keyrings open: only a reboot resets them
                    log.error(
                        "cannot reset the keyrings of %s (%s): keys may pass between tasks;"
                        " run under the packaged unit, which denies keyring calls, or reboot",
                        user.name,
                        why,
                    )
            # A cgroup that kept a process (one that would not die) keeps the slot's user
            # alive: no chain waits beside it.
            if gone and user is not None and self._ahead_ok and not self._closed:
                self._launch_ahead(slot, user)
        except Exception:  # the next start takes the plain way
            log.exception("slot %d: its turnover failed", slot)

    def _launch_ahead(self, slot: int, user: procs.TaskUser) -> None:
        assert self._hierarchy is not None
        token = procs.new_token()[:8]
        sandbox = self._blank()
        try:
            cgroup = self._hierarchy.create(f"{self.prefix}{slot}-{token}", Limits())
        except OSError as exc:
            log.debug("slot %d: no cgroup ahead: %s", slot, exc)
            return
        work = self._attempts / f".ahead-{slot}-{token}"
        try:
            work.mkdir(mode=0o700)
            launch = self._launcher(work, cgroup, user, sandbox)
        except OSError as exc:
            log.debug("slot %d: no chain ahead: %s", slot, exc)
            cgroup.remove()
            with contextlib.suppress(OSError):
                work.rmdir()
            return
        with self._lock:
            old, self._ahead[slot] = self._ahead.get(slot), ChainAhead(launch, work)
        if old is not None:
            old.discard()

    def reconcile(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Remove the cgroups of the chains an earlier run of this agent kept ahead (a crash
        left them; the chains themselves end with their supervisor), but those in ``keep``
        (tasks started in them that this run rejoined)."""
        if self._hierarchy is not None:
            swept = self._hierarchy.sweep(self.prefix, keep)
            if swept:
                log.info("removed %d cgroup(s) an earlier run made ahead", swept)

    def close(self) -> None:
        """Wait for the turnovers queued so far (none starts a chain from here on), then end
        every chain still kept."""
        self._closed = True
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.drain()
        with self._lock:
            left, self._ahead = list(self._ahead.values()), {}
        for ahead in left:
            ahead.discard()
