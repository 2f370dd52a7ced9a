"""The cache of job environments (``EnvCache``): each built at most once however many threads
ask for it at the same time, pinned while tasks use it, evicted within the budget, failed builds
remembered for a while. The package's docstring describes the layout and the locking; the parts
are its modules."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from flashnode.caches.envbox import POLL_S
from flashnode.caches.envbuild import Builder, EnvSpec, UvBuilder, platform_tag
from flashnode.caches.envcache.entries import Entries
from flashnode.caches.envcache.evict import Evictor
from flashnode.caches.envcache.handle import EnvHandle
from flashnode.caches.envcache.layout import Layout, is_key
from flashnode.caches.envcache.locks import KeyLocks
from flashnode.caches.envcache.pins import Build, Pins
from flashnode.caches.envcache.publish import Publisher
from flashnode.caches.envcache.sweep import Sweeper
from flashnode.caches.envcache.trash import Trash
from flashnode.caches.envfailed import FailedBuilds
from flashnode.caches.envrecords import EnvInfo
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.errors import Cancelled, EnvBuildFailed, EnvUnavailable
from flashnode.sandbox import cgroups
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs import TaskUser

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.1  # how often to look again while another process builds or evicts a key


class EnvCache:
    """Environments by key under ``root``, at most ``budget_bytes`` of them (see the package
    docstring for the layout and locking; flashnode.caches.envbuild for the privileges). A build
    may write at most min(``budget_bytes``, the free space above ``min_free_bytes``) while it
    runs. ``build_user``, ``hierarchy`` and ``build_limits`` go to the UvBuilder made when no
    ``builder`` is given."""

    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        *,
        allow_python_downloads: bool = False,
        allow_source_builds: bool = False,
        negative_ttl_s: float = 600.0,
        min_free_bytes: int = 0,
        builder: Builder | None = None,
        clock: Clock | None = None,
        build_user: TaskUser | None = None,
        hierarchy: cgroups.Hierarchy | None = None,
        build_limits: Limits | None = None,
        index_policy: OriginPolicy | None = None,
    ) -> None:
        self.root = root
        self.budget = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.negative_ttl_s = negative_ttl_s
        self.allow_source_builds = allow_source_builds
        self._clock = clock or SystemClock()
        layout = Layout(root)
        self._builder = builder or UvBuilder(
            layout.python,
            allow_python_downloads=allow_python_downloads,
            allow_source_builds=allow_source_builds,
            index_policy=index_policy,
            build_user=build_user,
            hierarchy=hierarchy,
            limits=build_limits,
            clock=self._clock,
        )
        self._platform = platform_tag()
        self._pins = Pins()
        self._locks = KeyLocks(layout.locks, self._clock)
        self._entries = Entries(root, self._clock)
        trash = Trash(layout.tmp)
        self._publisher = Publisher(layout, self._builder, trash, self._clock)
        self._evictor = Evictor(self._entries, self._locks, self._pins, trash)
        self._sweeper = Sweeper(layout, self._entries, self._locks, self._pins, trash)
        self._failures = FailedBuilds(layout.failed, self._clock, self._pins.lock)
        layout.setup()
        self._failures.load(self.negative_ttl_s)
        self._sweeper.sweep()

    # --- public ------------------------------------------------------------------------------

    def acquire(
        self,
        python: str,
        lines: Sequence[str],
        *,
        stop: threading.Event,
        timeout_s: float,
    ) -> EnvHandle:
        """The environment for ``python`` and ``lines``, pinned; built first if absent.

        Blocks: builds it at most once however many threads ask at the same time (the others
        wait and reuse it). Raises EnvBuildFailed (the job's lines; remembered for
        ``negative_ttl_s`` and raised again at once within that window), EnvUnavailable (the
        node), or Cancelled when ``stop`` is set (a build under way is killed). ``timeout_s``
        bounds the whole call, build included.
        """
        spec = EnvSpec.make(python, lines, self._platform)
        key = spec.key
        deadline = self._clock.monotonic() + timeout_s
        while True:
            if stop.is_set():
                raise Cancelled("stopped while waiting for the job environment")
            if self._clock.monotonic() >= deadline:
                raise EnvUnavailable("the environment was not ready in time (another build)")
            with self._pins.lock:
                self._failures.raise_if_failed(key, self.allow_source_builds)
                build = self._pins.builds.get(key)
                busy = False
                if build is None:
                    handle, busy = self._try_pin(key)
                    if handle is not None:
                        log.debug("env %s: reused", key[:12])
                        return handle
                    if not busy:
                        build = Build()
                        self._pins.builds[key] = build
                        mine = True
                else:
                    mine = False
            if busy:
                self._clock.wait(stop, BUSY_RETRY_S)  # another process builds or evicts it
                continue
            assert build is not None
            if mine:
                return self._build_and_pin(spec, build, stop, deadline)
            while not self._clock.wait(build.done, POLL_S):
                if stop.is_set() or self._clock.monotonic() >= deadline:
                    break
            if build.done.is_set() and isinstance(build.error, (EnvBuildFailed, EnvUnavailable)):
                raise type(build.error)(str(build.error), *_tail_args(build.error))

    def pin(self, key: str) -> EnvHandle | None:
        """The finished environment ``key`` pinned (a task rejoined after a restart uses it);
        None when it is not there, or being built or evicted."""
        if not is_key(key):
            return None
        with self._pins.lock:
            handle, _ = self._try_pin(key)
        return handle

    def entries(self) -> list[EnvInfo]:
        """Every finished environment, least recently used first."""
        return self._evictor.infos()

    def prune(self, everything: bool = False) -> list[EnvInfo]:
        """Evict environments no task uses, least recently used first, until the cache is within
        its budget (``everything``: all of them). Returns what was evicted."""
        evicted = self._evictor.enforce(0 if everything else self.budget, self.budget)
        self._sweeper.sweep()
        self._failures.expire(self.allow_source_builds)
        return evicted

    def reconfigure(
        self,
        budget_bytes: int,
        min_free_bytes: int,
        build_limits: Limits,
        index_policy: OriginPolicy | None = None,
    ) -> None:
        """New settings (a reload): from the next build on; the budget is enforced at once."""
        self.budget, self.min_free_bytes = budget_bytes, min_free_bytes
        if isinstance(self._builder, UvBuilder):
            self._builder.limits = build_limits
            if index_policy is not None:
                self._builder.index_policy = index_policy
        self.prune()

    def usage(self) -> tuple[int, int]:
        """(bytes the finished environments hold, the budget)."""
        return sum(i.bytes for i in self.entries()), self.budget

    # --- building ----------------------------------------------------------------------------

    def _build_and_pin(
        self, spec: EnvSpec, build: Build, stop: threading.Event, deadline: float
    ) -> EnvHandle:
        key = spec.key
        try:
            handle = self._build_locked(spec, stop, deadline)
        except BaseException as exc:
            build.error = exc
            raise
        finally:
            with self._pins.lock:
                self._pins.builds.pop(key, None)
            build.done.set()
        self._keep_budget()
        return handle

    def _build_locked(self, spec: EnvSpec, stop: threading.Event, deadline: float) -> EnvHandle:
        key = spec.key
        fd = self._locks.exclusive(key, stop, deadline)
        try:
            if self._entries.complete(key):
                return self._pinned_from_exclusive(key, fd, built=False, seconds=0.0)
            try:
                seconds = self._publisher.publish(
                    spec,
                    budget=self.budget,
                    min_free_bytes=self.min_free_bytes,
                    stop=stop,
                    deadline=deadline,
                )
            except EnvBuildFailed as exc:
                log.warning("env %s: build failed: %s", key[:12], exc)
                self._failures.remember(key, exc, self.negative_ttl_s, self.allow_source_builds)
                raise
            return self._pinned_from_exclusive(key, fd, built=True, seconds=seconds)
        except BaseException:
            os.close(fd)
            raise

    def _pinned_from_exclusive(self, key: str, fd: int, built: bool, seconds: float) -> EnvHandle:
        # The downgrade is not atomic (flock(2)); an eviction that slips in between is caught
        # by checking the entry again.
        self._locks.downgrade(fd)
        if not self._entries.complete(key):
            raise EnvUnavailable("the environment was removed while it was being pinned")
        with self._pins.lock:
            self._pins.add(key)
            self._entries.touch(key)
        return EnvHandle(key, self._entries.env(key), fd, built, seconds, self._release)

    # --- pins --------------------------------------------------------------------------------

    def _try_pin(self, key: str) -> tuple[EnvHandle | None, bool]:
        """(a pinned handle, False) for a finished entry; (None, True) when another holder has
        it exclusively (building or evicting); (None, False) when there is nothing to pin.
        Called with the pins' lock held."""
        if not self._entries.path(key).exists():
            return None, False
        fd = self._locks.try_shared(key)
        if fd is None:
            return None, True
        if not self._locks.same(key, fd) or not self._entries.complete(key):
            os.close(fd)
            return None, False
        self._pins.add(key)
        self._entries.touch(key)
        return EnvHandle(key, self._entries.env(key), fd, False, 0.0, self._release), False

    def _release(self, key: str, fd: int) -> None:
        """An ``EnvHandle``'s unpin: its pin dropped, its lock let go, the budget kept."""
        with self._pins.lock:
            self._pins.drop(key)
            with contextlib.suppress(OSError):
                self._entries.touch(key)
            os.close(fd)
        self._keep_budget()

    def _keep_budget(self) -> None:
        try:
            self._evictor.enforce(self.budget, self.budget)
        except OSError as exc:
            log.warning("env cache: cannot enforce the budget: %s", exc)


def _tail_args(exc: BaseException) -> tuple[str, ...]:
    return (exc.tail,) if isinstance(exc, EnvBuildFailed) else ()
