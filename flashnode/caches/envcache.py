"""The cache of job environments: built once (``envbuild``), keyed, pinned while tasks use
them, shared read-only, within a byte budget, least recently used evicted first; failed builds
remembered for a while (``envfailed``, under the cache's lock). What it writes of an
environment and tells the owner is ``envrecords``.

Layout of the cache root (``<state dir>/envs/``, mode 0711: task users can reach an environment
whose name they are given, never list the cache)::

    <key>/env/          a finished environment: a relocatable venv, owned by the agent, dirs 0755,
                        files 0644 or 0755 (task users read and execute it, never write it)
    <key>/meta.json     what it is: python, the lines (credentials redacted), bytes, last use; 0600
    .tmp/<key>.<rand>/  a build in progress; renamed to <key>/ only when complete, so a crash
                        mid-build leaves nothing that looks usable (swept at the next start)
    .locks/<key>        flock: shared while a task uses the environment (a pin), exclusive to
                        build or evict it; this is what keeps ``flashnode envs prune`` in another
                        process from removing an environment a running task uses
    .failed/<key>.json  the negative cache: a build that failed because of the job's lines
    .python/            interpreters uv downloads, when the owner allows downloads

The key is the sha256 of the Python version (``major.minor``), the platform and the normalised
lines (comments, surrounding space and blank lines dropped; order kept, because index directives
are order-sensitive).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from flashnode.caches.envbox import BUDGET_BOUND, POLL_S, DiskRoom, size
from flashnode.caches.envbuild import FORMAT, Builder, EnvSpec, UvBuilder, platform_tag
from flashnode.caches.envfailed import FailedBuilds
from flashnode.caches.envrecords import EnvInfo, fsync_dir, write_json
from flashnode.caches.envtree import remove, secure_tree
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.errors import Cancelled, EnvBuildFailed, EnvUnavailable
from flashnode.sandbox import cgroups
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs import TaskUser
from flashnode.sandbox.removal import remove_tree

log = logging.getLogger(__name__)

ENVS_DIR = "envs"  # the cache's directory in the state dir
PYTHON_DIR = ".python"  # the managed interpreters' directory in the cache


# --- the cache ---------------------------------------------------------------------------------


class EnvHandle:
    """A pinned environment: it cannot be evicted until ``release()`` (or the end of a ``with``).

    ``path`` is the venv; ``python`` its interpreter (what a module task runs); ``built`` tells
    whether this acquire built it, and ``build_seconds`` how long that took (0 when reused).
    """

    def __init__(
        self,
        cache: EnvCache,
        key: str,
        path: Path,
        lock_fd: int,
        built: bool,
        build_seconds: float,
    ) -> None:
        self.key = key
        self.path = path
        self.python = path / "bin" / "python"
        self.built = built
        self.build_seconds = build_seconds
        self._cache = cache
        self._fd: int | None = lock_fd
        self._release_lock = threading.Lock()

    def env(self, path: str = os.defpath) -> dict[str, str]:
        """What an argv task's environment needs: ``VIRTUAL_ENV``, and ``PATH`` with the
        environment's ``bin`` first, then ``path`` (the task's own search path)."""
        bin_dir = str(self.path / "bin")
        return {"VIRTUAL_ENV": str(self.path), "PATH": f"{bin_dir}:{path}" if path else bin_dir}

    def release(self) -> None:
        """Unpin (idempotent); the budget is enforced again once nothing uses the env."""
        with self._release_lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            self._cache._release(self.key, fd)

    def __enter__(self) -> EnvHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass
class _Build:
    done: threading.Event
    error: BaseException | None = None


class EnvCache:
    """Environments by key under ``root``, at most ``budget_bytes`` of them (see the module
    docstring for the layout and locking; flashnode.caches.envbuild for the privileges). A build may
    write at most min(``budget_bytes``, the free space above ``min_free_bytes``) while it runs.
    ``build_user``, ``hierarchy`` and ``build_limits`` go to the UvBuilder made when no
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
        self._tmp = root / ".tmp"
        self._locks = root / ".locks"
        self._failed_dir = root / ".failed"
        self._python_dir = root / PYTHON_DIR
        self._builder = builder or UvBuilder(
            self._python_dir,
            allow_python_downloads=allow_python_downloads,
            allow_source_builds=allow_source_builds,
            index_policy=index_policy,
            build_user=build_user,
            hierarchy=hierarchy,
            limits=build_limits,
            clock=self._clock,
        )
        self._platform = platform_tag()
        self._lock = threading.Lock()
        self._evicting = threading.Lock()
        self._builds: dict[str, _Build] = {}
        self._pins: dict[str, int] = {}
        self._failures = FailedBuilds(self._failed_dir, self._clock, self._lock)
        self._setup()
        self._failures.load(self.negative_ttl_s)
        self._sweep()

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
            with self._lock:
                self._failures.raise_if_failed(key, self.allow_source_builds)
                build = self._builds.get(key)
                busy = False
                if build is None:
                    handle, busy = self._try_pin(key)
                    if handle is not None:
                        log.debug("env %s: reused", key[:12])
                        return handle
                    if not busy:
                        build = _Build(threading.Event())
                        self._builds[key] = build
                        mine = True
                else:
                    mine = False
            if busy:
                self._clock.wait(stop, 0.1)  # another process builds or evicts it
                continue
            assert build is not None
            if mine:
                return self._build_and_pin(spec, build, stop, deadline)
            while not self._clock.wait(build.done, POLL_S):
                if stop.is_set() or self._clock.monotonic() >= deadline:
                    break
            if build.done.is_set() and isinstance(build.error, (EnvBuildFailed, EnvUnavailable)):
                raise type(build.error)(str(build.error), *_tail_args(build.error))

    def entries(self) -> list[EnvInfo]:
        """Every finished environment, least recently used first."""
        infos = []
        for meta_path in self.root.glob("*/meta.json"):
            key = meta_path.parent.name
            if not re.fullmatch(r"[0-9a-f]{64}", key):
                continue
            info = self._info(key)
            if info is not None:
                infos.append(info)
        return sorted(infos, key=lambda i: (i.last_used, i.key))

    def prune(self, everything: bool = False) -> list[EnvInfo]:
        """Evict environments no task uses, least recently used first, until the cache is within
        its budget (``everything``: all of them). Returns what was evicted."""
        evicted = self._enforce_budget(budget=0 if everything else self.budget)
        self._sweep()
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
        self, spec: EnvSpec, build: _Build, stop: threading.Event, deadline: float
    ) -> EnvHandle:
        key = spec.key
        try:
            handle = self._build_locked(spec, stop, deadline)
        except BaseException as exc:
            build.error = exc
            raise
        finally:
            with self._lock:
                self._builds.pop(key, None)
            build.done.set()
        try:
            self._enforce_budget(self.budget)
        except OSError as exc:
            log.warning("env cache: cannot enforce the budget: %s", exc)
        return handle

    def _build_locked(self, spec: EnvSpec, stop: threading.Event, deadline: float) -> EnvHandle:
        key = spec.key
        fd = self._lock_exclusive(key, stop, deadline)
        try:
            entry = self.root / key
            if self._complete(key):
                return self._pinned_from_exclusive(key, fd, built=False, seconds=0.0)
            if os.path.lexists(entry):
                self._doom(entry)
            room = self._room()
            work = self._tmp / f"{key}.{secrets.token_hex(6)}"
            work.mkdir(mode=0o700)
            started = self._clock.monotonic()
            log.info(
                "env %s: building Python %s, %d line(s)", key[:12], spec.python, len(spec.lines)
            )
            try:
                env_dir = self._builder.build(spec, work, stop=stop, deadline=deadline, room=room)
                if env_dir != work / "env":
                    raise EnvUnavailable("the builder put the environment somewhere else")
                for child in work.iterdir():
                    if child.name != "env":
                        remove(child)
                stats = secure_tree(env_dir)
                seconds = self._clock.monotonic() - started
                now = self._clock.wall()
                meta = {
                    "format": FORMAT,
                    "key": key,
                    "python": spec.python,
                    "platform": spec.platform,
                    "lines": spec.shown_lines(),
                    "bytes": stats.bytes,
                    "files": stats.files,
                    "created": now,
                    "last_used": now,
                    "build_seconds": round(seconds, 3),
                }
                write_json(work / "meta.json", meta)
                os.chmod(work, 0o755)
                os.sync()  # the rename publishes it: what it names must be on disk first
                os.rename(work, entry)
                fsync_dir(self.root)
            except EnvBuildFailed as exc:
                log.warning("env %s: build failed: %s", key[:12], exc)
                self._failures.remember(key, exc, self.negative_ttl_s, self.allow_source_builds)
                raise
            except OSError as exc:
                raise EnvUnavailable(f"cannot build the environment: {exc}") from None
            finally:
                if work.exists():
                    self._doom(work)
            log.info("env %s: built in %.1f s, %d MiB", key[:12], seconds, stats.bytes >> 20)
            return self._pinned_from_exclusive(key, fd, built=True, seconds=seconds)
        except BaseException:
            os.close(fd)
            raise

    def _room(self) -> DiskRoom:
        """What the next build may write: the budget, or the free space above
        ``min_free_bytes`` when that is less (none: the node's fault)."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError as exc:
            raise EnvUnavailable(f"cannot tell the free space for a build: {exc}") from None
        above = free - self.min_free_bytes
        if above <= 0:
            raise EnvUnavailable(
                f"no room to build an environment: {size(free)} free, min_free_bytes is"
                f" {size(self.min_free_bytes)}"
            )
        if self.budget <= above:
            return DiskRoom(self.budget, BUDGET_BOUND)
        return DiskRoom(above, "the free disk space above min_free_bytes")

    def _pinned_from_exclusive(self, key: str, fd: int, built: bool, seconds: float) -> EnvHandle:
        # The downgrade is not atomic (flock(2)); an eviction that slips in between is caught
        # by checking the entry again.
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not self._complete(key):
            raise EnvUnavailable("the environment was removed while it was being pinned")
        with self._lock:
            self._pins[key] = self._pins.get(key, 0) + 1
            self._touch(key)
        return EnvHandle(self, key, self.root / key / "env", fd, built, seconds)

    # --- pins ----------------------------------------------------------------------------------

    def pin(self, key: str) -> EnvHandle | None:
        """The finished environment ``key`` pinned (a task rejoined after a restart uses it);
        None when it is not there, or being built or evicted."""
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            return None
        with self._lock:
            handle, _ = self._try_pin(key)
        return handle

    def _try_pin(self, key: str) -> tuple[EnvHandle | None, bool]:
        """(a pinned handle, False) for a finished entry; (None, True) when another holder has
        it exclusively (building or evicting); (None, False) when there is nothing to pin.
        Called with ``self._lock`` held."""
        if not (self.root / key).exists():
            return None, False
        fd = self._open_lock(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None, True
        if not self._same_lock(key, fd) or not self._complete(key):
            os.close(fd)
            return None, False
        self._pins[key] = self._pins.get(key, 0) + 1
        self._touch(key)
        return EnvHandle(self, key, self.root / key / "env", fd, False, 0.0), False

    def _release(self, key: str, fd: int) -> None:
        with self._lock:
            left = self._pins.get(key, 1) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)
            with contextlib.suppress(OSError):
                self._touch(key)
            os.close(fd)
        try:
            self._enforce_budget(self.budget)
        except OSError as exc:
            log.warning("env cache: cannot enforce the budget: %s", exc)

    def _open_lock(self, key: str) -> int:
        return os.open(self._locks / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _same_lock(self, key: str, fd: int) -> bool:
        """The locked file is still the one the lock path names (it may have been replaced)."""
        try:
            return os.stat(self._locks / key).st_ino == os.fstat(fd).st_ino
        except OSError:
            return False

    def _lock_exclusive(self, key: str, stop: threading.Event, deadline: float) -> int:
        while True:
            fd = self._open_lock(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._same_lock(key, fd):
                    return fd
            except BlockingIOError:
                pass
            os.close(fd)
            if stop.is_set():
                raise Cancelled("stopped while waiting for the job environment")
            if self._clock.monotonic() >= deadline:
                raise EnvUnavailable("timed out waiting for the environment's lock")
            self._clock.wait(stop, 0.1)

    # --- entries and eviction ----------------------------------------------------------------

    def _complete(self, key: str) -> bool:
        entry = self.root / key
        # exists() follows bin/python to the base interpreter: gone means the env is stale.
        return (entry / "meta.json").is_file() and (entry / "env" / "bin" / "python").exists()

    def _read_meta(self, key: str) -> dict[str, object] | None:
        try:
            data = json.loads((self.root / key / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _touch(self, key: str) -> None:
        meta = self._read_meta(key)
        if meta is not None:
            meta["last_used"] = self._clock.wall()
            write_json(self.root / key / "meta.json", meta)

    def _info(self, key: str) -> EnvInfo | None:
        meta = self._read_meta(key)
        if meta is None:
            return None
        lines = meta.get("lines")
        return EnvInfo(
            key=key,
            python=str(meta.get("python", "?")),
            bytes=_int(meta.get("bytes")),
            last_used=_float(meta.get("last_used")),
            in_use=self._in_use(key),
            path=self.root / key / "env",
            created=_float(meta.get("created")),
            build_seconds=_float(meta.get("build_seconds")),
            lines=tuple(str(x) for x in lines) if isinstance(lines, list) else (),
        )

    def _in_use(self, key: str) -> bool:
        with self._lock:
            if self._pins.get(key) or key in self._builds:
                return True
        fd = self._open_lock(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _enforce_budget(self, budget: int) -> list[EnvInfo]:
        with self._evicting:
            infos = self.entries()
            total = sum(i.bytes for i in infos)
            evicted: list[EnvInfo] = []
            for info in infos:
                if total <= budget:
                    break
                if not info.in_use and self._evict(info.key):
                    total -= info.bytes
                    evicted.append(info)
                    log.info("env %s: evicted (%d MiB)", info.key[:12], info.bytes >> 20)
            if total > budget and budget == self.budget:
                log.warning(
                    "env cache holds %d MiB, over its budget of %d MiB: the rest is in use",
                    total >> 20,
                    budget >> 20,
                )
            return evicted

    def _evict(self, key: str) -> bool:
        with self._lock:
            if self._pins.get(key) or key in self._builds:
                return False
            fd = self._open_lock(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
        try:
            if not self._same_lock(key, fd):
                return False
            doomed = self._hide(self.root / key)
        finally:
            os.close(fd)
        if doomed is not None:
            remove_tree(doomed)
        return True

    def _hide(self, path: Path) -> Path | None:
        """Move ``path`` out of sight at once (atomic); where it went, or None if it was gone."""
        doomed = self._tmp / f"del.{secrets.token_hex(6)}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        return doomed

    def _doom(self, path: Path) -> None:
        """Move ``path`` out of sight at once, then delete it."""
        doomed = self._hide(path)
        if doomed is not None:
            remove_tree(doomed)

    # --- housekeeping ------------------------------------------------------------------------

    def _setup(self) -> None:
        try:
            for path, mode in (
                (self.root, 0o711),
                (self._tmp, 0o711),
                (self._locks, 0o700),
                (self._failed_dir, 0o700),
                (self._python_dir, 0o755),
            ):
                path.mkdir(exist_ok=True, mode=mode)
                path.chmod(mode)
            if os.geteuid() == 0:
                # Task users must reach <root>/<key>/env: let them search (not list) the dir
                # above, as the workspace does for attempts/.
                parent = self.root.parent
                parent.chmod(stat.S_IMODE(parent.stat().st_mode) | 0o111)
        except OSError as exc:
            raise EnvUnavailable(
                f"cannot set up the environment cache {self.root}: {exc}"
            ) from None

    def _sweep(self) -> None:
        """Remove what a crash left: builds nobody holds, doomed trees, unfinished entries."""
        for path in self._tmp.iterdir():
            key = path.name.split(".", 1)[0]
            if path.name.startswith("del.") or not re.fullmatch(r"[0-9a-f]{64}", key):
                with contextlib.suppress(OSError):
                    remove(path)
                continue
            self._remove_if_free(key, path)
        for path in self.root.iterdir():
            if re.fullmatch(r"[0-9a-f]{64}", path.name) and not self._complete(path.name):
                self._remove_if_free(path.name, path)
        for path in self._locks.iterdir():
            if not os.path.lexists(self.root / path.name):
                self._remove_if_free(path.name, path)

    def _remove_if_free(self, key: str, path: Path) -> None:
        with self._lock:
            if key in self._builds:
                return
            fd = self._open_lock(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return
        try:
            if path.parent == self._locks:
                # Unlinked while held: a waiter on the old file sees it is not the path's
                # (_same_lock) and opens the new one.
                if self._same_lock(key, fd) and not os.path.lexists(self.root / key):
                    path.unlink()
                return
            if path.parent == self.root and self._complete(key):
                return
            log.info("env cache: removing leftover %s", path.name)
            self._doom(path)
        finally:
            os.close(fd)


def _tail_args(exc: BaseException) -> tuple[str, ...]:
    return (exc.tail,) if isinstance(exc, EnvBuildFailed) else ()


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
