"""Dataset slices: shards fetched, verified and cached (the payload's ``datasets`` are parsed
by flashnode.coordinator.datasets; a shard is fetched by flashnode.caches.fetcher, over the
connections of flashnode.caches.origins).

A task's payload may carry ``datasets: [{"name": N, "entries": [{"path": P, "url": U, "size": S,
"integrity": {"kind": K, "value": V}}]}]``; the task then expects each entry at
``/work/data/<N>/<P>``. The agent fetches the entries before the task starts (the task has no
network) into a content-addressed cache under ``<state dir>/data/``:

- ``sha256`` and ``declared-sha256`` entries are keyed by the checksum and verified against it
  before they enter the cache; an ``etag`` is not a checksum: such an entry is keyed by
  (url, etag), must come with that ETag, and is recorded but never called verified.
- The cache keeps to a byte budget (``dataset_cache_bytes``, the figure the node advertises) by
  evicting the least recently used shards that no running task holds (pins).
- Two tasks needing the same shard at once fetch it once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnode.caches.fetcher import Fetcher
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator.datasets import (
    CHECKSUM_KINDS,
    DATASET_NAME,
    DatasetEntry,
    Integrity,
    IntegrityKind,
    OriginPolicy,
    parse_datasets,
    safe_path,
    url_problem,
)
from flashnode.errors import AttemptFailed, DataUnavailable

# The payload half (flashnode.coordinator.datasets, no I/O) stays importable from here.
__all__ = [
    "CHECKSUM_KINDS",
    "DATASET_NAME",
    "CachedShard",
    "DataCache",
    "DatasetEntry",
    "FetchStats",
    "Integrity",
    "IntegrityKind",
    "OriginPolicy",
    "ShardHandle",
    "cache_usage",
    "parse_datasets",
    "safe_path",
    "url_problem",
]

log = logging.getLogger(__name__)

CACHE_KEY = re.compile(r"^(etag-)?[0-9a-f]{64}$")


@dataclass
class _Shard:
    key: str
    size: int
    last_used: float
    mtime_ns: int
    record: dict[str, Any]  # what the sidecar keeps: url, kind, value, sha256, etag, fetched_at
    pins: int = 0


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class CachedShard:
    """One shard in the cache, as ``entries()`` shows it."""

    key: str
    size: int
    pins: int
    last_used: float
    verified: bool
    url: str


class ShardHandle:
    """A shard a task holds: pinned (never evicted) until ``release()``."""

    def __init__(
        self, cache: DataCache, entry: DatasetEntry, shard: _Shard, fetched: bool, seconds: float
    ) -> None:
        self._cache = cache
        self._shard = shard
        self.entry = entry
        self.path = cache.shard_path(shard.key)
        self.size = shard.size
        self.fetched = fetched  # False: a cache hit
        self.seconds = seconds
        self.verified = entry.integrity.verifies
        self.sha256: str = shard.record.get("sha256", "")
        self.released = False

    def release(self) -> None:
        """Unpin; idempotent."""
        if not self.released:
            self.released = True
            self._cache._unpin(self._shard)


@dataclass(frozen=True)
class FetchStats:
    """For the ledger and status: what staging a task's datasets cost."""

    entries: int
    hits: int
    bytes_fetched: int
    seconds: float

    @classmethod
    def of(cls, handles: Sequence[ShardHandle]) -> FetchStats:
        fetched = [h for h in handles if h.fetched]
        return cls(
            entries=len(handles),
            hits=len(handles) - len(fetched),
            bytes_fetched=sum(h.size for h in fetched),
            seconds=sum(h.seconds for h in handles),
        )


class DataCache:
    """Dataset shards by key under ``root`` (``<state dir>/data``), within ``budget_bytes``.

    ``root/shards/<key>`` holds the bytes (read-only) and ``<key>.json`` what is known about them;
    ``root/partial/`` holds fetches in progress, emptied at start. A shard enters ``shards/`` only
    verified (or, for an etag entry, complete with the right ETag), by rename.
    """

    def __init__(
        self, root: Path, budget_bytes: int, fetcher: Fetcher, clock: Clock | None = None
    ) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.fetcher = fetcher
        self.clock = clock or SystemClock()
        self._shards_dir = root / "shards"
        self._partial_dir = root / "partial"
        self._cond = threading.Condition()
        self._shards: dict[str, _Shard] = {}
        self._flights: dict[str, _Flight] = {}
        self._reserved = 0
        for d in (root, self._shards_dir, self._partial_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in os.listdir(self._partial_dir):
            _unlink(self._partial_dir / name)
        self._load()
        self.prune()

    def shard_path(self, key: str) -> Path:
        return self._shards_dir / key

    # --- taking shards ---------------------------------------------------------------------

    def acquire(self, entry: DatasetEntry, *, stop: threading.Event) -> ShardHandle:
        """The entry's shard, pinned: from the cache, or fetched and verified first. When
        another thread is fetching the same shard, wait for it instead of fetching again.

        Raises what ``Fetcher.fetch`` raises, and DataUnavailable when the shard does not fit
        beside the shards running tasks hold, or the disk lacks the room.
        """
        key = entry.key
        while True:
            with self._cond:
                shard = self._shards.get(key)
                if shard is not None and self._intact(shard):
                    shard.pins += 1
                    shard.last_used = self.clock.wall()
                    self._write_record(shard)
                    return ShardHandle(self, entry, shard, fetched=False, seconds=0.0)
                flight = self._flights.get(key)
                if flight is None:
                    self._reserve(entry)
                    flight = self._flights[key] = _Flight()
                    break
            while not flight.done.wait(0.1):
                if stop.is_set():
                    raise DataUnavailable(f"dataset entry {entry.where}: fetch stopped")
        started = self.clock.monotonic()
        new: _Shard | None = None
        try:
            new = self._fetch_into_place(entry, stop)
        finally:
            with self._cond:
                # One step: the reservation becomes the shard, pinned, before anyone looks.
                self._reserved -= entry.size
                if new is not None:
                    new.pins = 1
                    self._shards[key] = new
                    self._write_record(new)
                del self._flights[key]
                flight.done.set()
        seconds = self.clock.monotonic() - started
        log.info("dataset entry %s: fetched %d bytes in %.1f s", entry.where, entry.size, seconds)
        return ShardHandle(self, entry, new, fetched=True, seconds=seconds)

    def acquire_all(
        self, entries: Sequence[DatasetEntry], *, stop: threading.Event
    ) -> list[ShardHandle]:
        """Every entry's shard, in order; on an error the ones already taken are released."""
        handles: list[ShardHandle] = []
        try:
            for entry in entries:
                handles.append(self.acquire(entry, stop=stop))
        except BaseException:
            for handle in handles:
                handle.release()
            raise
        return handles

    def _fetch_into_place(self, entry: DatasetEntry, stop: threading.Event) -> _Shard:
        key = entry.key
        part = self._partial_dir / f"{key}.{secrets.token_hex(4)}.part"
        started = self.clock.monotonic()
        fetched = self.fetcher.fetch(entry, part, stop=stop)
        try:
            part.chmod(0o444)
            st = part.stat()
            os.replace(part, self.shard_path(key))
        except OSError as exc:
            _unlink(part)
            raise DataUnavailable(
                f"dataset entry {entry.where}: cannot keep it in the cache ({exc.strerror})"
            ) from None
        now = self.clock.wall()
        record = {
            "key": key,
            "size": entry.size,
            "url": entry.url,
            "kind": entry.integrity.kind,
            "value": entry.integrity.value,
            "sha256": fetched.sha256,
            "etag": fetched.etag,
            "fetched_at": now,
            "seconds": round(self.clock.monotonic() - started, 3),
        }
        return _Shard(key, entry.size, now, st.st_mtime_ns, record)

    # --- laying out ------------------------------------------------------------------------

    def layout(self, handles: Sequence[ShardHandle], dest: Path, *, task_uid: int) -> None:
        """Lay the shards out read-only at ``dest/<name>/<path>`` (``dest`` is the attempt's
        ``data/``, which the task sees as ``/work/data``).

        A shard is hard-linked from the cache when the task runs as another user than the one
        owning the cache (the task cannot then write through the link) and the filesystem
        allows; otherwise it is copied. Directories are created one by one without following
        symlinks, so nothing lands outside ``dest``; a second entry at the same path is refused
        (AttemptFailed). A full disk is DataUnavailable.
        """
        try:
            dest.mkdir(mode=0o755, exist_ok=True)
            root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise DataUnavailable(f"cannot lay out datasets in {dest} ({exc.strerror})") from None
        try:
            os.fchmod(root_fd, 0o755)
            for handle in handles:
                if handle.released:
                    raise ValueError("layout of a released shard")
                entry = handle.entry
                parts = [entry.dataset, *entry.path.split("/")]
                if not DATASET_NAME.match(entry.dataset) or not safe_path(entry.path):
                    raise AttemptFailed(f"dataset entry {entry.where} is not a safe path")
                with _opened_dirs(root_fd, parts[:-1], entry) as parent:
                    self._place(handle, parts[-1], parent, task_uid)
        finally:
            os.close(root_fd)

    def _place(self, handle: ShardHandle, name: str, dir_fd: int, task_uid: int) -> None:
        where = f"data/{handle.entry.where}"
        if os.stat(handle.path).st_uid != task_uid:
            try:
                os.link(handle.path, name, dst_dir_fd=dir_fd, follow_symlinks=False)
                return
            except FileExistsError:
                raise AttemptFailed(f"two dataset entries would be laid out at {where}") from None
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES):
                    raise DataUnavailable(f"cannot lay out {where} ({exc.strerror})") from None
        try:
            out = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444, dir_fd=dir_fd
            )
        except FileExistsError:
            raise AttemptFailed(f"two dataset entries would be laid out at {where}") from None
        except OSError as exc:
            raise DataUnavailable(f"cannot lay out {where} ({exc.strerror})") from None
        try:
            src = os.open(handle.path, os.O_RDONLY)
            try:
                remaining = handle.size
                while remaining > 0:
                    sent = os.sendfile(out, src, None, min(remaining, 1 << 30))
                    if sent == 0:
                        raise DataUnavailable(f"cannot lay out {where}: the shard is short")
                    remaining -= sent
            finally:
                os.close(src)
            os.fchmod(out, 0o444)
        except OSError as exc:
            raise DataUnavailable(f"cannot lay out {where} ({exc.strerror})") from None
        finally:
            os.close(out)

    # --- the budget ------------------------------------------------------------------------

    def entries(self) -> list[CachedShard]:
        """The shards in the cache, least recently used first."""
        with self._cond:
            shards = sorted(self._shards.values(), key=lambda s: s.last_used)
            return [
                CachedShard(
                    s.key,
                    s.size,
                    s.pins,
                    s.last_used,
                    s.record.get("kind") in CHECKSUM_KINDS,
                    str(s.record.get("url", "")),
                )
                for s in shards
            ]

    def usage(self) -> tuple[int, int]:
        """(bytes held, shards and fetches in progress together; the budget)."""
        with self._cond:
            return self._used(), self.budget_bytes

    def prune(self) -> int:
        """Evict unpinned shards, least recently used first, until the cache fits its budget
        (after the budget was lowered). Returns the bytes freed."""
        with self._cond:
            freed = 0
            for shard in sorted(self._shards.values(), key=lambda s: s.last_used):
                if self._used() <= self.budget_bytes:
                    break
                if shard.pins == 0:
                    freed += shard.size
                    self._evict(shard)
            return freed

    def _used(self) -> int:
        return sum(s.size for s in self._shards.values()) + self._reserved

    def _reserve(self, entry: DatasetEntry) -> None:
        """Make room for ``entry`` (evicting unpinned shards, least recently used first) and
        count it as held; DataUnavailable when pinned shards leave no room."""
        over = self._used() + entry.size - self.budget_bytes
        unpinned = sorted(
            (s for s in self._shards.values() if s.pins == 0), key=lambda s: s.last_used
        )
        if over > sum(s.size for s in unpinned):
            raise DataUnavailable(
                f"dataset entry {entry.where} ({entry.size} bytes) does not fit the dataset"
                f" cache beside the shards running tasks hold ({self.budget_bytes} bytes)"
            )
        for shard in unpinned:
            if over <= 0:
                break
            over -= shard.size
            self._evict(shard)
        try:
            free = os.statvfs(self.root)
        except OSError:
            free = None
        if free is not None and free.f_bavail * free.f_frsize < entry.size:
            raise DataUnavailable(
                f"dataset entry {entry.where} ({entry.size} bytes) does not fit the disk"
            )
        self._reserved += entry.size

    def _evict(self, shard: _Shard) -> None:
        log.info("dataset cache: evicting %s (%d bytes)", shard.key, shard.size)
        del self._shards[shard.key]
        _unlink(self._shards_dir / f"{shard.key}.json")
        _unlink(self.shard_path(shard.key))

    def _unpin(self, shard: _Shard) -> None:
        with self._cond:
            shard.pins -= 1
            shard.last_used = self.clock.wall()
            self._write_record(shard)

    def _intact(self, shard: _Shard) -> bool:
        """The shard is still as it entered the cache (a cheap check: size and mtime)."""
        try:
            st = os.stat(self.shard_path(shard.key), follow_symlinks=False)
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISREG(st.st_mode)
            and st.st_size == shard.size
            and st.st_mtime_ns == shard.mtime_ns
        ):
            return True
        if shard.pins == 0:
            log.warning("dataset cache: %s changed on disk; fetching it again", shard.key)
            self._evict(shard)
        return False

    # --- the records on disk ---------------------------------------------------------------

    def _write_record(self, shard: _Shard) -> None:
        record = dict(shard.record, size=shard.size, last_used=shard.last_used)
        record["mtime_ns"] = shard.mtime_ns
        path = self._shards_dir / f"{shard.key}.json"
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("dataset cache: cannot write the record of %s (%s)", shard.key, exc)

    def _load(self) -> None:
        names = set(os.listdir(self._shards_dir))
        for name in sorted(names):
            if name.endswith(".json") and name[:-5] in names:
                continue
            path = self._shards_dir / name
            shard = self._read(name) if CACHE_KEY.match(name) else None
            if shard is None:
                _unlink(path)
                if CACHE_KEY.match(name):
                    _unlink(self._shards_dir / f"{name}.json")
                continue
            self._shards[name] = shard

    def _read(self, key: str) -> _Shard | None:
        try:
            record = json.loads((self._shards_dir / f"{key}.json").read_text())
            st = os.stat(self.shard_path(key), follow_symlinks=False)
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict):
            return None
        size, mtime_ns, last_used = (
            record.get("size"),
            record.get("mtime_ns"),
            record.get("last_used"),
        )
        if (
            not stat.S_ISREG(st.st_mode)
            or record.get("key") != key
            or size != st.st_size
            or mtime_ns != st.st_mtime_ns
            or not isinstance(last_used, (int, float))
        ):
            return None
        return _Shard(key, st.st_size, float(last_used), st.st_mtime_ns, record)


@contextlib.contextmanager
def _opened_dirs(root_fd: int, names: Sequence[str], entry: DatasetEntry) -> Iterator[int]:
    """Open (creating) each directory below ``root_fd`` in turn without following a symlink;
    yields the last one's descriptor."""
    opened: list[int] = []
    fd = root_fd
    try:
        for name in names:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise AttemptFailed(
                        f"dataset entry data/{entry.where} collides with another entry"
                    ) from None
                raise DataUnavailable(
                    f"cannot lay out data/{entry.where} ({exc.strerror})"
                ) from None
            opened.append(fd)
            os.fchmod(fd, 0o755)
        yield fd
    finally:
        for fd in opened:
            os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        path.unlink()


def cache_usage(root: Path) -> tuple[int, int]:
    """(shards, bytes) in a cache directory, read without changing anything (for the doctor,
    which may run beside a working agent). A missing directory is an empty cache."""
    count = used = 0
    try:
        with os.scandir(root / "shards") as entries:
            for entry in entries:
                if CACHE_KEY.match(entry.name) and entry.is_file(follow_symlinks=False):
                    count += 1
                    used += entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        pass
    return count, used
