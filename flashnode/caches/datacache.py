"""Dataset slices: shards fetched, verified and cached (the payload's ``datasets`` are parsed
by flashnode.coordinator.datasets).

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

The Fetcher is the only code here that talks HTTP, with its own client that carries no
credentials: HTTPS only (plain HTTP to a loopback address only), certificates verified, at most
five redirects each held to the same rule, streamed to disk, resumed with ``Range`` after a dropped
connection, the declared size a hard cap. Wrong bytes are the task's fault (DataIntegrityError);
an origin that cannot be reached, a full disk or cache, or a stop are not (DataUnavailable).

Only public addresses (``OriginPolicy``): every connection resolves its host here, checks every
address it resolves to, and connects to a checked one (never resolving again, so a name cannot
pass the check and then lead elsewhere: DNS rebinding); TLS still names the host (SNI, the
certificate check). No proxy is ever used: one would connect on the agent's behalf to wherever
the name leads from there, past the check. A failure reason names the check that failed, never
what the origin answered (its ETag, its length, a digest of its bytes, its status beyond the
class): a job must not read an origin it is refused, or the owner's network, through them.

Why one module of this size: the fetcher (redirects, Range resume, verification) and the cache
(budget, pins, eviction, layout).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.cookiejar
import json
import logging
import os
import re
import secrets
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpcore
import httpx

from flashnode import __version__
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
from flashnode.errors import AttemptFailed, DataIntegrityError, DataUnavailable

# The payload half (flashnode.coordinator.datasets, no I/O) stays importable from here.
__all__ = [
    "CHECKSUM_KINDS",
    "DATASET_NAME",
    "CachedShard",
    "DataCache",
    "DatasetEntry",
    "FetchStats",
    "Fetched",
    "Fetcher",
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
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
NOT_THE_SIZE = "the origin's size is not the manifest's"


# --- fetching --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fetched:
    """What a fetch saw: the bytes' sha256 (also for an etag entry, to be recorded), the
    origin's ETag, how many requests it took and how many times it resumed."""

    size: int
    sha256: str
    etag: str | None
    requests: int
    resumes: int


class _Retry(Exception):
    """A transient failure: try again (resuming where the bytes stopped)."""


class _Refused(Exception):
    """A host resolved to an address the policy refuses (the message says what kind)."""

    def __init__(self, host: str, problem: str) -> None:
        super().__init__(f"{host} resolves to {problem}")


Resolver = Callable[[str, int], Sequence[str]]


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system's resolver), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _CheckedBackend(httpcore.NetworkBackend):
    """httpcore's sockets, to checked addresses only (see the module docstring)."""

    def __init__(self, policy: Callable[[], OriginPolicy], resolver: Resolver) -> None:
        self._policy = policy
        self._resolve = resolver
        self._sockets = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = self._resolve(host, port)
        except OSError:
            raise httpcore.ConnectError("cannot resolve the host") from None
        if not addresses:
            raise httpcore.ConnectError("the host resolves to no address")
        policy = self._policy()
        for address in addresses:
            problem = policy.problem(address)
            if problem:
                log.info("dataset origin %s refused: %s is %s", host, address, problem)
                raise _Refused(host, problem)
        failed: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for address in addresses:
            try:
                return self._sockets.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc
        assert failed is not None
        raise failed

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("no data origin is a unix socket")

    def sleep(self, seconds: float) -> None:
        self._sockets.sleep(seconds)


class _CheckedTransport(httpx.HTTPTransport):
    """httpx's transport (its request and error mapping), its connections made by
    ``_CheckedBackend``."""

    def __init__(self, verify: ssl.SSLContext | bool, backend: _CheckedBackend) -> None:
        # The pool httpx makes here (its ``_pool``, which its request handling uses) is replaced
        # at once: verify=False spares loading a trust store for it; the pool used verifies. Were
        # httpx to keep it elsewhere, the tests' refused origins would be fetched, and fail.
        super().__init__(verify=False, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=backend,
        )


@dataclass
class _Progress:
    offset: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)
    etag: str | None = None
    requests: int = 0
    resumes: int = 0

    def restart(self) -> None:
        self.offset = 0
        self.hasher = hashlib.sha256()


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """Origins of different submitters share this client: nothing one sets reaches another."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


class Fetcher:
    """Fetches one dataset entry to a file, verified. Thread-safe; one per agent.

    ``ca_file`` replaces the default trust store (owners with a private CA, and the tests).
    ``policy``: which addresses an origin may have (public ones by default; changed on a reload);
    ``resolver``: how a host name becomes addresses (the system's; the tests give their own).
    ``timeout_seconds`` bounds one entry's whole fetch, retries included; ``read_timeout_seconds``
    bounds each read. Transient failures (transport errors, 408, 429, 5xx) are retried after
    each of ``retry_delays`` in turn; progress resets the count.
    """

    def __init__(
        self,
        *,
        ca_file: Path | None = None,
        policy: OriginPolicy | None = None,
        resolver: Resolver = resolve,
        timeout_seconds: float = 3600.0,
        read_timeout_seconds: float = 60.0,
        connect_timeout_seconds: float = 30.0,
        retry_delays: Sequence[float] = (0.5, 1.0, 2.0, 4.0, 8.0),
        clock: Clock | None = None,
    ) -> None:
        verify: ssl.SSLContext | bool = True
        if ca_file is not None:
            verify = ssl.create_default_context(cafile=str(ca_file))
        self.timeout_seconds = timeout_seconds
        self.retry_delays = tuple(retry_delays)
        self.clock = clock or SystemClock()
        self.policy = policy or OriginPolicy()
        self._resolver = resolver
        self._verify = verify
        self._timeout = httpx.Timeout(read_timeout_seconds, connect=connect_timeout_seconds)
        self._made: httpx.Client | None = None
        self._lock = threading.Lock()

    @property
    def _client(self) -> httpx.Client:
        """Made at the first fetch: its trust store costs an agent that never fetches 3 MB."""
        with self._lock:
            if self._made is None:
                # No auth, no environment (proxies, netrc, SSL_CERT_FILE), no cookies, no
                # automatic redirects: this client must never carry anything of the agent's to
                # a data origin. Its connections go to checked addresses only.
                backend = _CheckedBackend(lambda: self.policy, self._resolver)
                self._made = httpx.Client(
                    transport=_CheckedTransport(self._verify, backend),
                    trust_env=False,
                    follow_redirects=False,
                    cookies=http.cookiejar.CookieJar(policy=_NoCookies()),
                    timeout=self._timeout,
                    headers={
                        "User-Agent": f"flashnode/{__version__}",
                        "Accept-Encoding": "identity",
                    },
                )
            return self._made

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, None
        if made is not None:
            made.close()

    def fetch(self, entry: DatasetEntry, dest: Path, *, stop: threading.Event) -> Fetched:
        """Fetch ``entry`` into the new file ``dest`` and verify it; on any error ``dest`` is
        removed. Raises DataIntegrityError (wrong bytes), AttemptFailed (the origin refuses, a
        refused redirect), DataUnavailable (unreachable, 5xx after retries, disk full, timed
        out, ``stop`` set)."""
        problem = url_problem(entry.url)  # again: an entry need not have come from the payload
        if problem:
            raise AttemptFailed(f"dataset entry {entry.where}: url refused ({problem})")
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise DataUnavailable(f"cannot create {dest.name}: {exc.strerror}") from None
        try:
            try:
                done = self._fetch(entry, fd, stop)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                dest.unlink()
            raise
        return done

    def _fetch(self, entry: DatasetEntry, fd: int, stop: threading.Event) -> Fetched:
        where = f"dataset entry {entry.where}"
        deadline = self.clock.monotonic() + self.timeout_seconds
        progress = _Progress()
        failures = 0
        while True:
            self._check_running(where, stop, deadline)
            before = progress.offset
            try:
                self._request(entry, fd, progress, stop, deadline)
                break
            except _Retry as exc:
                failures = 1 if progress.offset > before else failures + 1
                if failures > len(self.retry_delays):
                    raise DataUnavailable(
                        f"{where}: {exc} ({failures} tries)", job_endpoint=True
                    ) from None
                log.info("%s: %s; trying again", where, exc)
                if self.clock.wait(stop, self.retry_delays[failures - 1]):
                    raise DataUnavailable(f"{where}: fetch stopped") from None
                progress.resumes += progress.offset > 0
        if progress.offset != entry.size:
            raise DataIntegrityError(f"{where}: {NOT_THE_SIZE}")
        digest: str = progress.hasher.hexdigest()
        if entry.integrity.verifies and digest != entry.integrity.value:
            raise DataIntegrityError(f"{where}: the bytes' sha256 does not match the manifest's")
        return Fetched(entry.size, digest, progress.etag, progress.requests, progress.resumes)

    def _check_running(self, where: str, stop: threading.Event, deadline: float) -> None:
        if stop.is_set():
            raise DataUnavailable(f"{where}: fetch stopped")
        if self.clock.monotonic() > deadline:  # the origin is too slow
            raise DataUnavailable(
                f"{where}: not fetched within {self.timeout_seconds:g} s", job_endpoint=True
            )

    def _request(
        self,
        entry: DatasetEntry,
        fd: int,
        progress: _Progress,
        stop: threading.Event,
        deadline: float,
    ) -> None:
        """One GET (following redirects) that streams from ``progress.offset`` to the end."""
        where = f"dataset entry {entry.where}"
        headers = {}
        if progress.offset:
            headers["Range"] = f"bytes={progress.offset}-"
            if progress.etag and not progress.etag.startswith("W/"):
                headers["If-Range"] = progress.etag
        url = entry.url
        for hop in range(MAX_REDIRECTS + 1):
            request = self._client.build_request("GET", url, headers=headers)
            request.headers.pop("Authorization", None)
            progress.requests += 1
            try:
                response = self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                raise _Retry(f"origin unreachable ({_transport(exc)})") from None
            except _Refused as exc:
                kind = "redirect" if hop else "url"
                raise AttemptFailed(f"{where}: {kind} refused ({exc})") from None
            try:
                if response.status_code in REDIRECTS and "location" in response.headers:
                    if hop == MAX_REDIRECTS:
                        raise AttemptFailed(f"{where}: more than {MAX_REDIRECTS} redirects")
                    url = urljoin(str(response.url), response.headers["location"])
                    problem = url_problem(url)
                    if problem:
                        raise AttemptFailed(f"{where}: redirect refused ({problem})")
                    continue
                self._receive(entry, response, fd, progress, stop, deadline)
                return
            finally:
                response.close()

    def _receive(
        self,
        entry: DatasetEntry,
        response: httpx.Response,
        fd: int,
        progress: _Progress,
        stop: threading.Event,
        deadline: float,
    ) -> None:
        where = f"dataset entry {entry.where}"
        status = response.status_code
        if status in (408, 429) or status >= 500:
            raise _Retry(f"origin answered {status // 100}xx")
        if status == 416:
            raise DataIntegrityError(f"{where}: {NOT_THE_SIZE}")
        if status not in (200, 206):
            raise AttemptFailed(f"{where}: origin refused the request ({status // 100}xx)")
        etag = response.headers.get("etag")
        if entry.integrity.kind == "etag" and _opaque(etag) != _opaque(entry.integrity.value):
            raise DataIntegrityError(f"{where}: the origin's ETag is not the manifest's")
        if status == 200:
            if progress.offset:
                log.info("%s: origin ignored the range; starting again from byte 0", where)
                os.ftruncate(fd, 0)
                progress.restart()
            length = response.headers.get("content-length")
            if length is not None and length.strip() != str(entry.size):
                raise DataIntegrityError(f"{where}: {NOT_THE_SIZE}")
        else:
            first, total = _content_range(response.headers.get("content-range"))
            if first != progress.offset or total not in (None, entry.size):
                raise DataIntegrityError(f"{where}: the origin answered a range that does not fit")
        progress.etag = etag
        os.lseek(fd, progress.offset, os.SEEK_SET)
        try:
            for chunk in response.iter_raw():  # as they arrive: at most one read's worth
                if progress.offset + len(chunk) > entry.size:
                    raise DataIntegrityError(f"{where}: {NOT_THE_SIZE}")
                _write_all(fd, chunk, where)
                progress.hasher.update(chunk)
                progress.offset += len(chunk)
                self._check_running(where, stop, deadline)
        except httpx.TransportError as exc:
            raise _Retry(f"connection dropped ({_transport(exc)})") from None
        if progress.offset < entry.size:
            # A body delimited by the connection's close looks complete when it was cut; asking
            # for the rest tells the two apart (416 when the origin really has no more).
            raise _Retry("origin ended the body early")


def _write_all(fd: int, data: bytes, where: str) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            raise DataUnavailable(f"{where}: cannot write to the cache ({exc.strerror})") from None
        view = view[written:]


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total) of ``bytes FIRST-LAST/TOTAL``; None where absent or malformed."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if not match:
        return None, None
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), total


def _opaque(etag: str | None) -> str | None:
    """An ETag without its weakness prefix and quotes, for comparison."""
    if etag is None:
        return None
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    return etag.strip('"')


def _transport(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return "certificate not trusted"
    return type(exc).__name__


# --- the cache -------------------------------------------------------------------------------


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
