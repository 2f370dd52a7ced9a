"""A task's dataset slices as its payload names them: parsed and checked, with no I/O.

``datasets: [{"name": N, "entries": [{"path": P, "url": U, "size": S, "integrity": {"kind": K,
"value": V}}]}]`` becomes a tuple of ``DatasetEntry``: a safe name and relative path (laid out at
``/work/data/<N>/<P>``), an allowed URL (HTTPS; plain HTTP only to loopback; no credentials), a
size and how the bytes are known to be right. Fetching them is flashnode.caches.fetcher,
caching them flashnode.caches.datacache.

Which addresses an origin may have is ``OriginPolicy.problem``: public (global unicast) ones,
unless the owner allows private ones (``dataset_allow_private_origins``); the fetcher applies it
to every address a host name resolves to, before it connects.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from flashnode.config.urls import is_loopback
from flashnode.errors import AttemptFailed

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IntegrityKind = Literal["sha256", "declared-sha256", "etag"]
CHECKSUM_KINDS = ("sha256", "declared-sha256")
DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_HEX = re.compile(r"^[0-9A-Fa-f]{64}$")
MAX_ENTRIES = 100_000
MAX_URL_CHARS = 4096
MAX_PATH_CHARS = 1024
MAX_SEGMENT_BYTES = 255
MAX_ETAG_CHARS = 256


@dataclass(frozen=True)
class Integrity:
    kind: IntegrityKind
    value: str  # a lower-case sha256 hex digest, or an ETag as the manifest gives it

    @property
    def verifies(self) -> bool:
        """True when the value is a checksum the bytes are verified against."""
        return self.kind in CHECKSUM_KINDS


@dataclass(frozen=True)
class DatasetEntry:
    """One file of a task's dataset slice, checked: a safe name and relative path, an allowed
    URL, a size, and how its bytes are known to be right."""

    dataset: str
    path: str
    url: str
    size: int
    integrity: Integrity

    @property
    def where(self) -> str:
        """The entry as error messages name it: ``<name>/<path>``, shortened if long."""
        text = f"{self.dataset}/{self.path}"
        return text if len(text) <= 160 else text[:120] + "…" + text[-30:]

    @property
    def key(self) -> str:
        """The cache key: the checksum, or ``etag-`` and a digest of (url, etag)."""
        if self.integrity.verifies:
            return self.integrity.value
        digest = hashlib.sha256(f"{self.url}\n{self.integrity.value}".encode()).hexdigest()
        return "etag-" + digest


def parse_datasets(value: Any, budget_bytes: int | None = None) -> tuple[DatasetEntry, ...]:
    """The payload's ``datasets`` as checked entries, or AttemptFailed with the reason.

    None and ``[]`` mean no datasets. Unknown keys are ignored; known ones are strict. The sum of
    all sizes must fit ``budget_bytes`` when it is given (the coordinator checks the same against
    what the node advertised). No two entries may land at the same path, or one inside another.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise AttemptFailed("payload datasets is not a list")
    entries: list[DatasetEntry] = []
    for i, dataset in enumerate(value):
        if not isinstance(dataset, dict):
            raise AttemptFailed(f"payload datasets[{i}] is not an object")
        name = dataset.get("name")
        if not isinstance(name, str) or not DATASET_NAME.match(name):
            raise AttemptFailed(
                f"dataset name {_show(name)} is not a safe name (letters, digits, '.', '_', '-')"
            )
        raw = dataset.get("entries")
        if raw is None:
            raw = []
        if not isinstance(raw, list):
            raise AttemptFailed(f"dataset {name!r}: entries is not a list")
        for j, entry in enumerate(raw):
            entries.append(_entry(name, j, entry))
            if len(entries) > MAX_ENTRIES:
                raise AttemptFailed(f"payload datasets have more than {MAX_ENTRIES} entries")
    total = sum(e.size for e in entries)
    if budget_bytes is not None and total > budget_bytes:
        raise AttemptFailed(
            f"dataset slices need {total} bytes; this node's dataset cache holds"
            f" {budget_bytes} (dataset_cache_bytes)"
        )
    _check_disjoint(entries)
    return tuple(entries)


def _entry(name: str, index: int, raw: Any) -> DatasetEntry:
    if not isinstance(raw, dict):
        raise AttemptFailed(f"dataset {name!r}: entries[{index}] is not an object")
    path = raw.get("path")
    if not isinstance(path, str) or not safe_path(path):
        raise AttemptFailed(
            f"dataset {name!r}: entry path {_show(path)} is not a safe relative path"
        )
    where = f"dataset entry {name}/{path}"
    url = raw.get("url")
    if not isinstance(url, str):
        raise AttemptFailed(f"{where}: url is not a string")
    problem = url_problem(url)
    if problem:
        raise AttemptFailed(f"{where}: url refused ({problem})")
    size = raw.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise AttemptFailed(f"{where}: size is not an integer >= 0")
    integrity = raw.get("integrity")
    if not isinstance(integrity, dict):
        raise AttemptFailed(f"{where}: integrity is not an object")
    kind, check = integrity.get("kind"), integrity.get("value")
    if kind not in ("sha256", "declared-sha256", "etag"):
        raise AttemptFailed(
            f"{where}: integrity kind {_show(kind)} is not sha256, declared-sha256 or etag"
        )
    if not isinstance(check, str):
        raise AttemptFailed(f"{where}: integrity value is not a string")
    if kind in CHECKSUM_KINDS:
        if not SHA256_HEX.match(check):
            raise AttemptFailed(f"{where}: integrity value is not a sha256 hex digest")
        check = check.lower()
    elif not check or len(check) > MAX_ETAG_CHARS or not _visible_ascii(check):
        raise AttemptFailed(f"{where}: integrity value is not an ETag")
    return DatasetEntry(name, path, url, size, Integrity(kind, check))


def safe_path(path: str) -> bool:
    """A relative path of non-empty segments, none '.' or '..', no backslash, NUL or control
    character, of bounded length."""
    if not path or len(path) > MAX_PATH_CHARS or path.startswith("/"):
        return False
    if "\\" in path or not path.isprintable() or _surrogates(path):
        return False
    return all(
        seg not in ("", ".", "..") and len(seg.encode()) <= MAX_SEGMENT_BYTES
        for seg in path.split("/")
    )


def _check_disjoint(entries: Sequence[DatasetEntry]) -> None:
    files: set[str] = set()
    dirs: set[str] = set()
    for e in entries:
        full = f"{e.dataset}/{e.path}"
        if full in files or full in dirs:
            raise AttemptFailed(f"two dataset entries would be laid out at data/{e.where}")
        files.add(full)
        parts = full.split("/")
        dirs.update("/".join(parts[:n]) for n in range(1, len(parts)))
    clash = files & dirs
    if clash:
        raise AttemptFailed(
            f"dataset entry data/{_short(min(clash))} would be both a file and a directory"
        )


def url_problem(url: str) -> str | None:
    """Why a dataset URL (or a redirect's target) is refused; None if it is allowed.

    HTTPS anywhere; plain HTTP only to a loopback address (as for the coordinator); never user
    info (httpx would turn it into an Authorization header), never whitespace or controls.
    """
    if len(url) > MAX_URL_CHARS:
        return f"longer than {MAX_URL_CHARS} characters"
    if not _visible_ascii(url):
        return "not a plain ASCII URL without spaces"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return "not a valid URL"
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http") or not parts.hostname:
        return "not an https URL"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "carries credentials"
    if scheme == "http" and not is_loopback(parts.hostname):
        return "plain http is allowed only to a loopback address"
    return None


# IPv6 forms that carry an IPv4 address in their last 32 bits, each reaching that address.
_V4_IN_V6 = tuple(
    ipaddress.ip_network(n)
    for n in (
        "::/96",  # IPv4-compatible (deprecated)
        "::ffff:0:0/96",  # IPv4-mapped
        "::ffff:0:0:0/96",  # IPv4-translated (SIIT)
        "64:ff9b::/96",  # NAT64, the well-known prefix
    )
)
_NOT_PUBLIC_V4 = ipaddress.ip_network("192.0.0.0/24")  # IETF protocol assignments
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")


@dataclass(frozen=True)
class OriginPolicy:
    """Which addresses a data origin may have (the owner's ``dataset_allow_private_origins``).

    Public (global unicast) addresses always. ``private``: also loopback, private, unique-local,
    shared and other non-public unicast addresses, but never link-local ones (169.254.0.0/16,
    fe80::/10: where cloud metadata services answer). ``networks``: also the addresses in these,
    whatever they are. Never an unspecified, multicast or broadcast address.
    """

    private: bool = False
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def of(cls, allow: bool | Sequence[str]) -> OriginPolicy:
        """From the setting's value: true/false, or networks (``10.0.0.0/8``, ``::1``)."""
        if isinstance(allow, bool):
            return cls(private=allow)
        return cls(networks=tuple(ipaddress.ip_network(n, strict=False) for n in allow))

    def problem(self, address: str | IPAddress) -> str | None:
        """Why an origin at ``address`` is refused (what kind of address it is); None when it
        is allowed. An IPv6 form of an IPv4 address (mapped, compatible, NAT64, 6to4) is judged
        by the IPv4 address it reaches."""
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        if isinstance(ip, ipaddress.IPv6Address):
            inner = _embedded_v4(ip)
            if inner is not None:
                return self.problem(inner)
        if ip.is_unspecified:
            return "an unspecified address"
        if ip.is_multicast:
            return "a multicast address"
        if ip == ipaddress.IPv4Address("255.255.255.255"):
            return "a broadcast address"
        if any(ip.version == n.version and ip in n for n in self.networks):
            return None
        if ip.is_link_local:
            return "a link-local address"
        if self.private:
            return None
        if ip.is_loopback:
            return "a loopback address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
            return "a site-local address"
        if ip in _UNIQUE_LOCAL:
            return "a unique-local address"
        if ip.is_private:
            return "a private address"
        if ip.is_reserved:
            return "a reserved address"
        if not ip.is_global or ip in _NOT_PUBLIC_V4:
            return "not a public address"
        return None


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches (None when it is not one of those forms); ``::``
    and ``::1`` are themselves."""
    if ip.sixtofour is not None:
        return ip.sixtofour
    if int(ip) <= 1:
        return None
    if any(ip in n for n in _V4_IN_V6):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _visible_ascii(text: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in text)


def _surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "…"


def _short(text: str) -> str:
    return text if len(text) <= 160 else text[:120] + "…" + text[-30:]
