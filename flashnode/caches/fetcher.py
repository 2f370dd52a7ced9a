"""Fetching one dataset entry to a file, verified (``Fetcher``).

The Fetcher is the only code that talks HTTP to a dataset origin, with its own client that
carries no credentials: HTTPS only (plain HTTP to a loopback address only), certificates
verified, at most five redirects each held to the same rule, streamed to disk, resumed with
``Range`` after a dropped connection, the declared size a hard cap. Wrong bytes are the task's
fault (DataIntegrityError); an origin that cannot be reached, a full disk or cache, or a stop are
not (DataUnavailable). A failure reason names the check that failed, never what the origin
answered (its ETag, its length, a digest of its bytes, its status beyond the class): a job must
not read an origin it is refused, or the owner's network, through them.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.cookiejar
import logging
import os
import re
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx

from flashnode import __version__
from flashnode.caches.origins import (
    CheckedBackend,
    CheckedTransport,
    NoCookies,
    Refused,
    Resolver,
    resolve,
)
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator.datasets import DatasetEntry, OriginPolicy, url_problem
from flashnode.errors import AttemptFailed, DataIntegrityError, DataUnavailable

log = logging.getLogger(__name__)


MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
NOT_THE_SIZE = "the origin's size is not the manifest's"


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
        # Asked before each chunk is written (its size, what it is for): raises when the disk
        # has not that much room above the owner's floor (set by the agent's wiring).
        self.room: Callable[[int, str], None] | None = None
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
                backend = CheckedBackend(lambda: self.policy, self._resolver)
                self._made = httpx.Client(
                    transport=CheckedTransport(self._verify, backend),
                    trust_env=False,
                    follow_redirects=False,
                    cookies=http.cookiejar.CookieJar(policy=NoCookies()),
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
            except Refused as exc:
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
                if self.room is not None:  # the owner's floor, before the write
                    self.room(len(chunk), where)
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
