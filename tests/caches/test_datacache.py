"""Dataset slices: the payload checked, shards fetched from a real HTTPS origin (a test CA), verified,
resumed, cached once, evicted within budget, laid out read-only; and what each failure means."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import free_port, wait_for
from origin import Generated, Origin, Route, TestCA

from flashnode.caches.datacache import (
    DataCache,
    DatasetEntry,
    FetchStats,
    Integrity,
    OriginPolicy,
    cache_usage,
    parse_datasets,
)
from flashnode.caches.fetcher import Fetcher
from flashnode.errors import AttemptFailed, DataIntegrityError, DataUnavailable, ShortOfRoom

GiB = 1 << 30


class TickClock:
    """Real time, except that wall time advances one second per reading: LRU order is exact."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        self.now += 1
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(timeout)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def origin(ca: TestCA) -> Iterator[Origin]:
    with Origin(ca) as server:
        yield server


LOOPBACK_ALLOWED = OriginPolicy(private=True)  # the test origins listen on loopback


@pytest.fixture
def fetcher(ca: TestCA) -> Iterator[Fetcher]:
    f = Fetcher(
        ca_file=ca.ca_file,
        policy=LOOPBACK_ALLOWED,
        retry_delays=(0.01, 0.01),
        read_timeout_seconds=10,
    )
    yield f
    f.close()


def cache_at(root: Path, fetcher: Fetcher, budget: int = 1 << 30) -> DataCache:
    return DataCache(root, budget, fetcher, clock=TickClock())


def entry(
    url: str, data: bytes, path: str = "f.bin", name: str = "ds", size: int | None = None
) -> DatasetEntry:
    return DatasetEntry(
        name,
        path,
        url,
        len(data) if size is None else size,
        Integrity("sha256", hashlib.sha256(data).hexdigest()),
    )


def payload_entry(url: str, data: bytes, path: str = "f.bin", **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "path": path,
        "url": url,
        "size": len(data),
        "integrity": {"kind": "sha256", "value": hashlib.sha256(data).hexdigest()},
    }
    raw.update(over)
    return raw


def leftovers(root: Path) -> list[str]:
    return sorted(os.listdir(root / "shards")) + sorted(os.listdir(root / "partial"))


NEVER = threading.Event()

# --- the payload -----------------------------------------------------------------------------

GOOD_URL = "https://data.example.org/a.bin"
SHA = "ab" * 32


def one(entry_over: dict[str, Any] | None = None, name: Any = "ds") -> list[dict[str, Any]]:
    raw = {
        "path": "a/b.bin",
        "url": GOOD_URL,
        "size": 10,
        "integrity": {"kind": "sha256", "value": SHA},
    }
    raw.update(entry_over or {})
    return [{"name": name, "entries": [raw]}]


def test_the_coordinators_shape_parses_into_checked_entries() -> None:
    parsed = parse_datasets(
        [
            {
                "name": "imagenet-1k",
                "version": "ignored",
                "entries": [
                    {
                        "path": "train/shard-0000.tar",
                        "url": "https://cdn.example.org/s0",
                        "size": 5,
                        "integrity": {"kind": "declared-sha256", "value": "AB" * 32},
                    },
                    {
                        "path": "train/shard-0001.tar",
                        "url": "http://127.0.0.1:9/s1",
                        "size": 0,
                        "integrity": {"kind": "etag", "value": '"v1"'},
                    },
                ],
            },
            {"name": "empty", "entries": []},
        ],
        budget_bytes=5,
    )
    assert [(e.dataset, e.path, e.size) for e in parsed] == [
        ("imagenet-1k", "train/shard-0000.tar", 5),
        ("imagenet-1k", "train/shard-0001.tar", 0),
    ]
    assert parsed[0].key == "ab" * 32 and parsed[0].integrity.verifies
    assert parsed[1].key.startswith("etag-") and not parsed[1].integrity.verifies
    assert parse_datasets(None, 0) == () == parse_datasets([], 0)


@pytest.mark.parametrize(
    ("datasets", "reason"),
    [
        ("ds", "not a list"),
        (["ds"], "datasets[0] is not an object"),
        ([{"name": "ds", "entries": {}}], "entries is not a list"),
        ([{"name": "ds", "entries": ["x"]}], "entries[0] is not an object"),
        *[
            (one(name=name), "is not a safe name")
            for name in ["", "..", ".hidden", "a/b", "a b", "é", "x" * 129, None, 5, "-x"]
        ],
        *[
            (one({"path": path}), "is not a safe relative path")
            for path in [
                "",
                "/etc/passwd",
                "../x",
                "a/../../x",
                "a//b",
                "a/./b",
                ".",
                "a/",
                "a\\b",
                "a\x00b",
                "a\nb",
                "\udcff",
                "x" * 256,
                "a/" * 600,
                None,
                3,
            ]
        ],
        *[
            (one({"url": url}), "url refused")
            for url in [
                "http://data.example.org/a",
                "http://10.0.0.1/a",
                "ftp://data.example.org/a",
                "file:///etc/passwd",
                "https://user:secret@data.example.org/a",
                "https://user@data.example.org/a",
                "https:///a",
                "https://data.example.org:99999/a",
                "https://data.example.org/a b",
                "https://data.example.org/\u00e9",
                "https://x.org/" + "a" * 5000,
            ]
        ],
        (one({"url": 7}), "url is not a string"),
        *[(one({"size": size}), "size is not an integer") for size in [-1, True, 1.5, "10", None]],
        (one({"integrity": "sha256"}), "integrity is not an object"),
        (one({"integrity": {"kind": "md5", "value": SHA}}), "is not sha256"),
        (one({"integrity": {"kind": "sha256", "value": "ab"}}), "not a sha256 hex digest"),
        (one({"integrity": {"kind": "sha256", "value": "zz" * 32}}), "not a sha256 hex digest"),
        (one({"integrity": {"kind": "sha256", "value": None}}), "value is not a string"),
        (one({"integrity": {"kind": "etag", "value": ""}}), "is not an ETag"),
        (one({"integrity": {"kind": "etag", "value": "a b"}}), "is not an ETag"),
        (one({"integrity": {"kind": "etag", "value": "a\r\nX: y"}}), "is not an ETag"),
    ],
)
def test_hostile_payloads_are_refused_with_a_reason(datasets: Any, reason: str) -> None:
    with pytest.raises(AttemptFailed) as err:
        parse_datasets(datasets, budget_bytes=1 << 40)
    assert reason in str(err.value)
    assert not isinstance(err.value, DataIntegrityError)


def test_over_budget_and_colliding_entries_are_refused() -> None:
    three = [*one(), *one({"path": "c"}, name="other"), *one({"size": 1}, name="x")]
    assert len(parse_datasets(three, 21)) == 3
    with pytest.raises(AttemptFailed, match=r"need 21 bytes; this node's dataset cache holds 20"):
        parse_datasets(three, 20)
    with pytest.raises(AttemptFailed, match="two dataset entries would be laid out at data/ds/a"):
        parse_datasets([{"name": "ds", "entries": one()[0]["entries"] * 2}], 100)
    clash = [{"name": "ds", "entries": [one({"path": "a"})[0]["entries"][0]]}, *one()]
    with pytest.raises(AttemptFailed, match="data/ds/a would be both a file and a directory"):
        parse_datasets(clash, 100)
    # Nothing to fetch fits a node that lends no cache at all.
    assert len(parse_datasets(one({"size": 0}), 0)) == 1


# --- fetching, verifying, laying out ---------------------------------------------------------


def test_shards_are_fetched_verified_and_laid_out_read_only(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    a, b = os.urandom(300_000), os.urandom(1234)
    origin.add("/a", a)
    origin.add("/b", b)
    entries = parse_datasets(
        [
            {"name": "ds", "entries": [payload_entry(origin.url("/a"), a, "train/x/a.bin")]},
            {"name": "labels", "entries": [payload_entry(origin.url("/b"), b, "b.csv")]},
        ],
        budget_bytes=1 << 20,
    )
    cache = cache_at(tmp_path / "data", fetcher, 1 << 20)
    handles = cache.acquire_all(entries, stop=NEVER)
    assert [h.fetched for h in handles] == [True, True] and all(h.verified for h in handles)
    stats = FetchStats.of(handles)
    assert (stats.entries, stats.hits, stats.bytes_fetched) == (2, 0, len(a) + len(b))
    assert stats.seconds > 0

    work = tmp_path / "ws"
    work.mkdir()
    cache.layout(handles, work / "data", task_uid=65534)  # another user: hard links
    laid = work / "data" / "ds" / "train" / "x" / "a.bin"
    assert laid.read_bytes() == a and (work / "data" / "labels" / "b.csv").read_bytes() == b
    assert stat.S_IMODE(laid.stat().st_mode) == 0o444
    assert stat.S_IMODE((work / "data" / "ds" / "train").stat().st_mode) == 0o755
    assert laid.stat().st_ino == handles[0].path.stat().st_ino

    own = tmp_path / "ws-own"
    own.mkdir()
    cache.layout(handles, own / "data", task_uid=os.geteuid())  # the cache's own user: copies
    copy = own / "data" / "ds" / "train" / "x" / "a.bin"
    assert copy.read_bytes() == a and copy.stat().st_ino != handles[0].path.stat().st_ino
    assert stat.S_IMODE(copy.stat().st_mode) == 0o444
    assert origin.count("/a") == 1 and origin.count("/b") == 1
    assert cache_usage(tmp_path / "data") == (2, len(a) + len(b))


def test_a_cached_shard_is_never_fetched_twice(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(100_000)
    origin.add("/a", data)
    origin.add("/mirror", data)
    cache = cache_at(tmp_path / "data", fetcher)
    first = cache.acquire(entry(origin.url("/a"), data), stop=NEVER)
    first.release()
    again = cache.acquire(entry(origin.url("/a"), data), stop=NEVER)
    # The same bytes under another path and URL: the checksum is the key.
    same = cache.acquire(entry(origin.url("/mirror"), data, path="other.bin"), stop=NEVER)
    assert (first.fetched, again.fetched, same.fetched) == (True, False, False)
    assert origin.count() == 1
    assert FetchStats.of([again, same]).hits == 2

    # A restarted agent finds the cache as it was, and drops what it cannot vouch for.
    (tmp_path / "data" / "partial" / "x.part").write_bytes(b"half")
    (tmp_path / "data" / "shards" / ("cd" * 32)).write_bytes(b"no record")
    (tmp_path / "data" / "shards" / "stray").write_bytes(b"?")
    restarted = cache_at(tmp_path / "data", fetcher)
    assert not restarted.acquire(entry(origin.url("/a"), data), stop=NEVER).fetched
    assert origin.count() == 1
    assert leftovers(tmp_path / "data") == [first.path.name, first.path.name + ".json"]

    # A shard changed behind the cache's back is fetched again, not handed out.
    for h in (again, same):
        h.release()
    restarted = cache_at(tmp_path / "data", fetcher)
    os.chmod(first.path, 0o644)
    first.path.write_bytes(b"x" * len(data))
    fresh = restarted.acquire(entry(origin.url("/a"), data), stop=NEVER)
    assert fresh.fetched and fresh.path.read_bytes() == data and origin.count() == 2


def _waiting_on_a_fetch(thread: threading.Thread) -> bool:
    """The thread is blocked inside DataCache.acquire waiting for another thread's fetch."""
    frame = sys._current_frames().get(thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return bool(names) and names[0] == "wait" and "acquire" in names


def test_tasks_needing_the_same_shard_at_once_fetch_it_once(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(500_000)
    hold = threading.Event()
    origin.add("/a", data, hold=hold)
    cache = cache_at(tmp_path / "data", fetcher)
    results: list[Any] = []

    def take() -> None:
        try:
            results.append(cache.acquire(entry(origin.url("/a"), data), stop=NEVER))
        except Exception as exc:  # pragma: no cover - reported below
            results.append(exc)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    # Let the origin answer only once every thread has either asked it or is waiting.
    wait_for(
        "all four to ask or wait",
        lambda: origin.count("/a") + sum(_waiting_on_a_fetch(t) for t in threads) >= 4,
    )
    hold.set()
    for t in threads:
        t.join(30)
    assert origin.count("/a") == 1
    assert sorted(h.fetched for h in results) == [False, False, False, True]
    assert all(h.path.read_bytes() == data for h in results)


def test_a_dropped_connection_resumes_with_range_and_verifies(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(3 * 1024 * 1024 + 77)
    cut = 1024 * 1024 + 5
    origin.add("/a", data, drop_at=cut, etag='"v1"')
    cache = cache_at(tmp_path / "data", fetcher)
    handle = cache.acquire(entry(origin.url("/a"), data), stop=NEVER)
    assert handle.path.read_bytes() == data
    first, second = origin.requests
    assert "range" not in first.headers
    assert second.headers["range"] == f"bytes={cut}-"
    assert second.headers["if-range"] == '"v1"'


def test_an_origin_that_ignores_the_range_is_read_again_from_the_start(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(2 * 1024 * 1024)
    origin.add("/a", data, drop_at=700_001, ignore_range=True)
    handle = cache_at(tmp_path / "data", fetcher).acquire(entry(origin.url("/a"), data), stop=NEVER)
    assert handle.path.read_bytes() == data
    assert [("range" in r.headers) for r in origin.requests] == [False, True]


@pytest.mark.parametrize(
    ("how", "size_delta", "reason"),
    [
        ({"corrupt": True}, 0, "the bytes' sha256 does not match the manifest's"),
        ({}, 10, "the origin's size is not the manifest's"),
        ({"no_length": True, "extra": b"more"}, 0, "the origin's size is not the manifest's"),
        ({"no_length": True}, 10, "the origin's size is not the manifest's"),
    ],
)
def test_wrong_bytes_fail_the_attempt_naming_the_entry_and_leave_nothing(
    origin: Origin,
    fetcher: Fetcher,
    tmp_path: Path,
    how: dict[str, Any],
    size_delta: int,
    reason: str,
) -> None:
    data = os.urandom(1000)
    origin.add("/a", data, **how)
    cache = cache_at(tmp_path / "data", fetcher)
    bad = entry(origin.url("/a"), data, path="sub/file.bin", size=len(data) + size_delta)
    with pytest.raises(DataIntegrityError, match=reason) as err:
        cache.acquire(bad, stop=NEVER)
    assert "dataset entry ds/sub/file.bin" in str(err.value)
    assert isinstance(err.value, AttemptFailed)
    assert leftovers(tmp_path / "data") == []
    assert cache.usage() == (0, 1 << 30) and cache.entries() == []


def test_an_unreachable_origin_is_not_the_tasks_fault(fetcher: Fetcher, tmp_path: Path) -> None:
    cache = cache_at(tmp_path / "data", fetcher)
    gone = entry(f"https://127.0.0.1:{free_port()}/a", b"x")
    with pytest.raises(DataUnavailable, match=r"origin unreachable \(ConnectError\) \(3 tries\)"):
        cache.acquire(gone, stop=NEVER)
    assert leftovers(tmp_path / "data") == [] and cache.usage()[0] == 0


def test_5xx_is_retried_then_unavailable_and_4xx_fails(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(10)
    origin.add("/flaky", data, status=503, refuse_times=2)
    origin.add("/down", data, status=502)
    origin.add("/gone", data, status=404)
    cache = cache_at(tmp_path / "data", fetcher)
    assert cache.acquire(entry(origin.url("/flaky"), data), stop=NEVER).fetched
    assert origin.count("/flaky") == 3
    with pytest.raises(DataUnavailable, match="origin answered 5xx"):
        cache.acquire(entry(origin.url("/down"), b"other", path="d"), stop=NEVER)
    assert origin.count("/down") == 3
    with pytest.raises(AttemptFailed, match=r"ds/g: origin refused the request \(4xx\)") as err:
        cache.acquire(entry(origin.url("/gone"), os.urandom(10), path="g"), stop=NEVER)
    assert not isinstance(err.value, DataIntegrityError) and origin.count("/gone") == 1


def test_an_origin_whose_certificate_is_not_trusted_is_unavailable(
    origin: Origin, tmp_path: Path
) -> None:
    origin.add("/a", b"x")
    default_trust = Fetcher(policy=LOOPBACK_ALLOWED, retry_delays=())
    with pytest.raises(DataUnavailable, match="certificate not trusted"):
        cache_at(tmp_path / "data", default_trust).acquire(
            entry(origin.url("/a"), b"x"), stop=NEVER
        )
    assert origin.count() == 0  # the TLS handshake failed: no request was ever sent
    default_trust.close()


def test_redirects_are_followed_a_few_times_under_the_same_rule(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(1000)
    origin.add("/real", data)
    origin.routes["/hop"] = Route(redirect="/real")
    origin.routes["/plain"] = Route(redirect="http://data.example.org/a")
    origin.routes["/loop"] = Route(redirect="/loop")
    cache = cache_at(tmp_path / "data", fetcher)
    assert cache.acquire(entry(origin.url("/hop"), data), stop=NEVER).path.read_bytes() == data
    with pytest.raises(AttemptFailed, match="redirect refused .plain http is allowed only to a"):
        cache.acquire(entry(origin.url("/plain"), b"y", path="p"), stop=NEVER)
    with pytest.raises(AttemptFailed, match="more than 5 redirects"):
        cache.acquire(entry(origin.url("/loop"), b"z", path="l"), stop=NEVER)
    assert origin.count("/loop") == 6
    assert leftovers(tmp_path / "data") == [
        *sorted([cache.entries()[0].key, cache.entries()[0].key + ".json"])
    ]


def test_nothing_of_the_agents_reaches_a_data_origin(
    origin: Origin, ca: TestCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials in the URL or a redirect, the environment's proxy, netrc and trust store, and
    cookies one origin set: none of them ever goes with a dataset request."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login agent password coordinator-token\n")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("SSL_CERT_FILE", "/nonexistent")
    data = os.urandom(1000)
    origin.add("/a", data, set_cookie="session=task-a; Path=/")
    origin.add("/b", data[::-1])
    with_token = origin.url("/b").replace("https://", "https://agent:token@")
    origin.routes["/leak"] = Route(redirect=with_token)
    fetcher = Fetcher(ca_file=ca.ca_file, policy=LOOPBACK_ALLOWED, retry_delays=())
    cache = cache_at(tmp_path / "data", fetcher)
    cache.acquire(entry(origin.url("/a"), data), stop=NEVER)
    cache.acquire(entry(origin.url("/b"), data[::-1], path="b"), stop=NEVER)
    with pytest.raises(AttemptFailed, match="redirect refused .carries credentials"):
        cache.acquire(entry(origin.url("/leak"), b"other", path="c"), stop=NEVER)
    with pytest.raises(AttemptFailed, match="url refused .carries credentials"):
        cache.acquire(entry(with_token, b"q", path="d"), stop=NEVER)
    fetcher.close()
    assert [r.path for r in origin.requests] == ["/a", "/b", "/leak"]
    for request in origin.requests:
        assert "authorization" not in request.headers
        assert "cookie" not in request.headers
        assert "proxy-authorization" not in request.headers


# --- origins: public unless the owner says otherwise --------------------------------------------

PRIVATE_PAGE = b"the owner's router admin page: admin / hunter2"


@pytest.mark.parametrize(
    ("address", "public_only", "private_allowed"),
    [
        ("8.8.8.8", None, None),
        ("2606:4700::1", None, None),
        ("::ffff:8.8.8.8", None, None),  # the IPv6 forms of a public address are public
        ("2002:808:808::1", None, None),
        ("64:ff9b::808:808", None, None),
        ("127.0.0.1", "a loopback address", None),
        ("127.1.2.3", "a loopback address", None),
        ("::1", "a loopback address", None),
        ("10.1.2.3", "a private address", None),
        ("172.16.0.1", "a private address", None),
        ("192.168.1.1", "a private address", None),
        ("100.64.0.1", "not a public address", None),  # shared (carrier-grade NAT)
        ("192.0.0.8", "not a public address", None),
        ("198.18.0.1", "a private address", None),
        ("fc00::1", "a unique-local address", None),
        ("fd12:3456::1", "a unique-local address", None),
        ("fec0::1", "a site-local address", None),
        ("64:ff9b:1::1", "a reserved address", None),  # local-use NAT64
        ("2001:db8::1", "a private address", None),
        ("169.254.169.254", "a link-local address", "a link-local address"),  # cloud metadata
        ("fe80::1", "a link-local address", "a link-local address"),
        ("224.0.0.1", "a multicast address", "a multicast address"),
        ("ff02::1", "a multicast address", "a multicast address"),
        ("255.255.255.255", "a broadcast address", "a broadcast address"),
        ("0.0.0.0", "an unspecified address", "an unspecified address"),
        ("::", "an unspecified address", "an unspecified address"),
        # An IPv6 form of an IPv4 address is judged by the address it reaches.
        ("::ffff:127.0.0.1", "a loopback address", None),
        ("::127.0.0.1", "a loopback address", None),
        ("::ffff:0:7f00:1", "a loopback address", None),
        ("64:ff9b::a9fe:a9fe", "a link-local address", "a link-local address"),
        ("2002:a00:1::1", "a private address", None),
        ("::ffff:169.254.169.254", "a link-local address", "a link-local address"),
    ],
)
def test_origin_addresses_are_judged_by_what_they_reach(
    address: str, public_only: str | None, private_allowed: str | None
) -> None:
    assert OriginPolicy().problem(address) == public_only
    assert OriginPolicy(private=True).problem(address) == private_allowed
    # Networks the owner names are allowed, whatever they are, but never a non-unicast address.
    named = OriginPolicy.of(["169.254.169.254/32", "127.0.0.0/8", "224.0.0.0/4"])
    assert named.problem("169.254.169.254") is None and named.problem("::ffff:127.0.0.1") is None
    assert named.problem("224.0.0.1") == "a multicast address"
    assert named.problem("10.0.0.1") == "a private address"


def test_a_job_cannot_fetch_the_owners_loopback_service_without_the_owners_opt_in(
    ca: TestCA, origin: Origin, tmp_path: Path
) -> None:
    """The attack: a dataset entry naming a service on the owner's machine, by address and by
    name. Refused before any connection (not even a TLS handshake reaches it); the owner who
    serves datasets from this machine opts in."""
    origin.add("/private", PRIVATE_PAGE, etag='"v1"')
    fetcher = Fetcher(ca_file=ca.ca_file, retry_delays=())
    cache = cache_at(tmp_path / "data", fetcher)
    for url in (origin.url("/private"), origin.url("/private", host="localhost")):
        with pytest.raises(AttemptFailed, match=r"url refused \(.+ resolves to a loopback") as err:
            cache.acquire(entry(url, PRIVATE_PAGE), stop=NEVER)
        assert not isinstance(err.value, (DataIntegrityError, DataUnavailable))
    assert origin.count() == 0 and origin.server_names == []
    assert leftovers(tmp_path / "data") == []

    fetcher.policy = OriginPolicy(private=True)  # dataset_allow_private_origins = true
    handle = cache.acquire(entry(origin.url("/private"), PRIVATE_PAGE), stop=NEVER)
    assert handle.path.read_bytes() == PRIVATE_PAGE
    fetcher.close()


def test_a_redirect_from_an_allowed_origin_to_the_owners_loopback_is_refused(
    ca: TestCA, tmp_path: Path
) -> None:
    with Origin(ca, host="127.0.0.2") as allowed, Origin(ca) as private:
        private.add("/secret", PRIVATE_PAGE)
        targets = {
            "/to-address": private.url("/secret"),
            "/to-name": private.url("/secret", host="localhost"),
            "/to-mapped": f"https://[::ffff:127.0.0.1]:{private.port}/secret",
        }
        for path, target in targets.items():
            allowed.routes[path] = Route(redirect=target)
        allowed.add("/public", b"public bytes")
        # The owner allows one address of their network, not the rest of it.
        fetcher = Fetcher(
            ca_file=ca.ca_file, policy=OriginPolicy.of(["127.0.0.2"]), retry_delays=()
        )
        cache = cache_at(tmp_path / "data", fetcher)
        for path in targets:
            with pytest.raises(AttemptFailed, match=r"redirect refused \(.+ a loopback address\)"):
                cache.acquire(entry(allowed.url(path), PRIVATE_PAGE, path=path[1:]), stop=NEVER)
        assert private.count() == 0 and private.server_names == []
        assert allowed.count() == len(targets)
        good = cache.acquire(entry(allowed.url("/public"), b"public bytes", path="p"), stop=NEVER)
        assert good.path.read_bytes() == b"public bytes"
        fetcher.close()


def test_a_name_is_resolved_once_per_connection_and_connected_to_as_checked(
    tmp_path: Path,
) -> None:
    """The resolution is injected at the edge (no DNS here). A name whose every other answer is
    the owner's private service (DNS rebinding): each connection resolves once, connects to the
    address it checked, and speaks TLS to the name (SNI, the certificate checked for it)."""
    named = TestCA(tmp_path / "ca", names=("flip.example.org", "rebind.example.org"))
    calls: list[str] = []
    answers = {"flip.example.org": 0, "rebind.example.org": 0}

    def resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        answers[host] += 1
        # flip: allowed, refused, allowed, ... per call; rebind: allowed once, then refused.
        first = answers[host] % 2 == 1 if host == "flip.example.org" else answers[host] == 1
        return ["127.0.0.2"] if first else ["127.0.0.1"]

    big = os.urandom(2 * 1024 * 1024)
    with Origin(named, host="127.0.0.2") as allowed, Origin(named) as private:
        allowed.add("/a", b"bytes")
        allowed.add("/big", big, drop_at=500_000)
        private.add("/a", PRIVATE_PAGE)
        private.add("/big", PRIVATE_PAGE)
        fetcher = Fetcher(
            ca_file=named.ca_file,
            policy=OriginPolicy.of(["127.0.0.2"]),
            resolver=resolver,
            retry_delays=(0.01,),
        )
        cache = cache_at(tmp_path / "data", fetcher)
        url = f"https://flip.example.org:{allowed.port}/a"
        assert cache.acquire(entry(url, b"bytes"), stop=NEVER).path.read_bytes() == b"bytes"
        assert calls == ["flip.example.org"]  # one resolution, and its answer was used
        assert allowed.server_names == ["flip.example.org"]
        assert allowed.requests[0].headers["host"] == f"flip.example.org:{allowed.port}"

        # The first connection is cut; the resumed one resolves again: to the private service.
        url = f"https://rebind.example.org:{allowed.port}/big"
        with pytest.raises(AttemptFailed, match=r"url refused \(rebind.example.org resolves"):
            cache.acquire(entry(url, big, path="big"), stop=NEVER)
        assert calls[1:] == ["rebind.example.org", "rebind.example.org"]
        assert private.count() == 0 and private.server_names == []
        fetcher.close()

        # The certificate is checked for the name, not the address connected to.
        other = Fetcher(
            ca_file=named.ca_file,
            policy=OriginPolicy.of(["127.0.0.2"]),
            resolver=lambda host, port: ["127.0.0.2"],
            retry_delays=(),
        )
        with pytest.raises(DataUnavailable, match="certificate not trusted"):
            cache_at(tmp_path / "other", other).acquire(
                entry(f"https://elsewhere.example.org:{allowed.port}/a", b"bytes"), stop=NEVER
            )
        assert allowed.count("/a") == 1
        other.close()


def test_a_failure_reason_never_echoes_what_the_origin_answered(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    """Probing a service through failure reasons: its ETag, its length, a digest of its bytes,
    its exact status. The reason names the check that failed, and nothing of the answer."""
    page = PRIVATE_PAGE * 100
    tag = '"etag-of-the-private-page-7f3a"'
    origin.add("/page", page, etag=tag)
    origin.add("/denied", page, status=403)
    cache = cache_at(tmp_path / "data", fetcher)
    url = origin.url("/page")
    probes = {
        "the origin's ETag is not the manifest's": DatasetEntry(
            "ds", "e", url, len(page), Integrity("etag", '"guess"')
        ),
        "the origin's size is not the manifest's": entry(url, page, path="s", size=10),
        "the bytes' sha256 does not match": entry(url, b"y" * len(page), path="h"),
        "origin refused the request (4xx)": entry(origin.url("/denied"), page, path="d"),
    }
    for check, probe in probes.items():
        with pytest.raises(AttemptFailed) as err:
            cache.acquire(probe, stop=NEVER)
        reason = str(err.value)
        assert check in reason, reason
        for answered in ("7f3a", str(len(page)), hashlib.sha256(page).hexdigest()[:8], "403"):
            assert answered not in reason, reason


def test_an_etag_entry_is_recorded_but_not_called_verified(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(5000)
    origin.add("/a", data, etag='"abc"')
    cache = cache_at(tmp_path / "data", fetcher)
    tagged = DatasetEntry("ds", "t.bin", origin.url("/a"), len(data), Integrity("etag", '"abc"'))
    handle = cache.acquire(tagged, stop=NEVER)
    assert not handle.verified and handle.path.name.startswith("etag-")
    assert handle.sha256 == hashlib.sha256(data).hexdigest()  # recorded, for the ledger
    assert [e.verified for e in cache.entries()] == [False]
    moved = DatasetEntry("ds", "t.bin", origin.url("/a"), len(data), Integrity("etag", '"old"'))
    with pytest.raises(DataIntegrityError, match="the origin's ETag is not the manifest's"):
        cache.acquire(moved, stop=NEVER)


def test_the_budget_evicts_the_least_recently_used_shard_no_task_holds(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    blobs = {name: os.urandom(100) for name in "abcdef"}
    for name, data in blobs.items():
        origin.add(f"/{name}", data)
    cache = cache_at(tmp_path / "data", fetcher, budget=300)

    def take(name: str) -> Any:
        return cache.acquire(entry(origin.url(f"/{name}"), blobs[name], path=name), stop=NEVER)

    def keys() -> set[str]:
        return {e.key for e in cache.entries()}

    for name in "abc":
        take(name).release()
    held_b = take("b")  # b is in use now, and the most recently used
    held_d = take("d")  # no room: a (least recently used, unused) goes
    assert keys() == {entry("", blobs[n]).key for n in "bcd"}
    held_e = take("e")  # c goes; b and d are held
    assert keys() == {entry("", blobs[n]).key for n in "bde"}
    with pytest.raises(DataUnavailable, match="does not fit the dataset cache beside the shards"):
        take("f")  # everything is held: nothing is evicted, nothing fetched
    assert keys() == {entry("", blobs[n]).key for n in "bde"} and origin.count("/f") == 0
    assert cache.usage() == (300, 300)
    for h in (held_b, held_d, held_e):
        h.release()
    take("a")  # fetched again after its eviction
    assert origin.count("/a") == 2

    lowered = DataCache(tmp_path / "data", 150, fetcher, clock=TickClock())
    assert lowered.usage() == (100, 150) and len(lowered.entries()) == 1


def test_a_stop_ends_waiting_for_another_fetch(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(1000)
    hold = threading.Event()
    origin.add("/a", data, hold=hold)
    cache = cache_at(tmp_path / "data", fetcher)
    first = threading.Thread(
        target=lambda: cache.acquire(entry(origin.url("/a"), data), stop=NEVER)
    )
    first.start()
    wait_for("the first fetch", lambda: origin.count("/a") == 1)
    stop = threading.Event()
    stop.set()
    with pytest.raises(DataUnavailable, match="fetch stopped"):
        cache.acquire(entry(origin.url("/a"), data), stop=stop)
    hold.set()
    first.join(30)
    with pytest.raises(DataUnavailable, match="fetch stopped"):
        fetcher.fetch(entry(origin.url("/a"), b"other"), tmp_path / "x", stop=stop)
    assert not (tmp_path / "x").exists()


def test_layout_lands_nothing_outside_its_directory(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    data = os.urandom(100)
    origin.add("/a", data)
    cache = cache_at(tmp_path / "data", fetcher)
    handle = cache.acquire(entry(origin.url("/a"), data), stop=NEVER)
    outside = tmp_path / "outside"
    outside.mkdir()
    work = tmp_path / "ws"
    work.mkdir()

    # An entry that never went through parse_datasets.
    handle.entry = DatasetEntry(
        "ds", "../../outside/x", handle.entry.url, 100, handle.entry.integrity
    )
    with pytest.raises(AttemptFailed, match="is not a safe path"):
        cache.layout([handle], work / "data", task_uid=65534)
    # A symlink planted where a directory goes is not followed.
    (work / "data").mkdir(exist_ok=True)
    os.symlink(outside, work / "data" / "ds")
    handle.entry = DatasetEntry("ds", "x", handle.entry.url, 100, handle.entry.integrity)
    with pytest.raises(AttemptFailed, match="collides with another entry"):
        cache.layout([handle], work / "data", task_uid=65534)
    assert os.listdir(outside) == []
    # Two entries at one path.
    os.unlink(work / "data" / "ds")
    with pytest.raises(AttemptFailed, match="two dataset entries would be laid out at data/ds/x"):
        cache.layout([handle, handle], work / "data", task_uid=65534)
    with pytest.raises(AttemptFailed, match="two dataset entries"):
        cache.layout([handle, handle], tmp_path / "ws2", task_uid=os.geteuid())
    handle.release()
    with pytest.raises(ValueError, match="released"):
        cache.layout([handle], tmp_path / "ws3", task_uid=65534)


def test_a_1_gb_shard_is_fetched_and_verified_in_bounded_memory(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    """Streams from an origin that makes the bytes on the fly; a sampler watches this process's
    resident memory (origin included) while the shard is fetched, hashed and kept."""
    big = Generated(GiB, seed=18)
    digest = big.sha256()
    origin.add("/big", big)
    origin.add("/small", b"warm-up")
    cache = cache_at(tmp_path / "data", fetcher, budget=2 * GiB)
    cache.acquire(entry(origin.url("/small"), b"warm-up", path="w"), stop=NEVER)
    me = psutil.Process()
    base = peak = me.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.02):
            peak = max(peak, me.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        shard = DatasetEntry("big", "big.bin", origin.url("/big"), GiB, Integrity("sha256", digest))
        handle = cache.acquire(shard, stop=NEVER)
    finally:
        done.set()
        sampler.join()
    try:
        assert handle.fetched and handle.size == GiB and handle.path.stat().st_size == GiB
        assert peak - base < 64 * 1024 * 1024, f"RSS grew by {(peak - base) >> 20} MiB"
    finally:
        shutil.rmtree(tmp_path / "data")  # a GiB is too much to leave in pytest's kept tmp dirs


def test_a_shard_the_disk_has_no_room_for_stops_before_the_chunk_that_would_pass_the_floor(
    origin: Origin, fetcher: Fetcher, tmp_path: Path
) -> None:
    """Each chunk is weighed against the owner's floor before it is written: one that does
    not fit ends the fetch as the node's shortage, and nothing of the shard is left."""
    data = os.urandom(3 << 20)
    origin.add("/big", data)
    weighed: list[int] = []

    def room(nbytes: int, what: str) -> None:
        if sum(weighed) + nbytes > 1 << 20:
            raise ShortOfRoom(f"low disk: {what} does not fit")
        weighed.append(nbytes)

    fetcher.room = room
    with pytest.raises(ShortOfRoom, match="dataset entry .* does not fit"):
        fetcher.fetch(entry(origin.url("/big"), data), tmp_path / "x", stop=threading.Event())
    assert not (tmp_path / "x").exists()
    assert 0 < sum(weighed) <= 1 << 20
