"""The Prometheus endpoint: real servers, scraped and parsed with prometheus_client's own parser."""

from __future__ import annotations

import http.client
import inspect
import json
import os
import pwd
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from harness import wait_for
from prometheus_client.parser import text_string_to_metric_families

from flashnode.config.listen import parse_listen
from flashnode.node.decision import Hold
from flashnode.owner.metrics import (
    HELD_RULES,
    Metrics,
    MetricsSink,
    NullMetrics,
    PublishedSink,
    create,
)
from flashnode.owner.metricsserver import MAX_PER_CLIENT, REQUEST_S


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def record(m: Metrics | NullMetrics) -> None:
    m.attempt_finished("committed", 12.5, cpu_percent=0.15, gpu_percent=None)
    m.attempt_finished("committed", 3.0, cpu_percent=None, gpu_percent=40.0)
    m.attempt_finished("failed", None)
    m.claim_finished(0.02, "work")
    m.claim_finished(0.5, "empty")
    m.coordinator_error("node heartbeat")
    m.coordinator_error("node heartbeat")
    m.coordinator_error("claim")
    m.uploaded(1000)
    m.uploaded(24)
    m.downloaded(7)
    m.set_running(2, suspended=1)
    m.set_controls(paused=True, held=["pause", "battery"])


def scrape_tcp(address: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
        return str(r.read().decode())


def test_counters_gauges_and_histograms_as_scraped_over_tcp() -> None:
    m = create("127.0.0.1:0")
    assert isinstance(m, Metrics) and m.address is not None
    try:
        record(m)
        got = samples(scrape_tcp(m.address))
    finally:
        m.close()
    assert got[("flashnode_attempts_total", (("outcome", "committed"),))] == 2
    assert got[("flashnode_attempts_total", (("outcome", "failed"),))] == 1
    # the unmeasured duration is left out, not counted as zero
    assert got[("flashnode_attempt_duration_seconds_count", ())] == 2
    assert got[("flashnode_attempt_duration_seconds_sum", ())] == 15.5
    assert got[("flashnode_claim_duration_seconds_count", (("result", "work"),))] == 1
    assert got[("flashnode_coordinator_errors_total", (("conversation", "node_heartbeat"),))] == 2
    assert got[("flashnode_coordinator_errors_total", (("conversation", "claim"),))] == 1
    assert got[("flashnode_uploaded_bytes_total", ())] == 1024
    assert got[("flashnode_downloaded_bytes_total", ())] == 7
    assert got[("flashnode_running_attempts", ())] == 2
    assert got[("flashnode_suspended_attempts", ())] == 1
    assert got[("flashnode_paused", ())] == 1
    assert got[("flashnode_claiming_held", (("rule", "battery"),))] == 1
    assert got[("flashnode_claiming_held", (("rule", "window"),))] == 0
    assert got[("flashnode_task_cpu_percent_count", ())] == 1
    assert got[("flashnode_task_cpu_percent_sum", ())] == 0.15
    assert got[("flashnode_task_gpu_percent_count", ())] == 1
    with pytest.raises(OSError):  # closed: nothing listens any more
        scrape_tcp(m.address)


def test_the_registry_is_private_not_the_global_one() -> None:
    from prometheus_client import REGISTRY, generate_latest

    a, b = Metrics(), Metrics()
    a.uploaded(5)
    assert b"flashnode_uploaded_bytes_total 0.0" in b.exposition()
    assert b"flashnode_" not in generate_latest(REGISTRY)


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def scrape_unix(path: Path, url: str = "/metrics") -> tuple[int, str]:
    conn = UnixHTTPConnection(str(path))
    try:
        conn.request("GET", url)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def test_a_unix_socket_serves_the_same_exposition(tmp_path: Path) -> None:
    path = tmp_path / "metrics.sock"
    m = create(f"unix:{path}")
    try:
        record(m)
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o660
        status, text = scrape_unix(path)
        assert status == 200
        assert samples(text)[("flashnode_paused", ())] == 1
        assert scrape_unix(path, "/other")[0] == 404
    finally:
        m.close()
    assert not path.exists()


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_a_scraper_that_stalls_is_dropped(where: str, tmp_path: Path) -> None:
    """A client connects, sends half a request line and waits: after ``REQUEST_S`` the agent
    hangs up on it (it holds one of the agent's threads while it waits), and scrapes go on."""
    path = tmp_path / "metrics.sock"
    m = create("127.0.0.1:0" if where == "tcp" else f"unix:{path}")
    assert isinstance(m, Metrics) and m.address is not None
    if where == "tcp":
        host, port = m.address.rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)), timeout=REQUEST_S * 3)
    else:
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.settimeout(REQUEST_S * 3)
        stalled.connect(str(path))
    try:
        stalled.sendall(b"GET /metr")
        assert stalled.recv(1) == b"", "the agent kept waiting on a scraper that stalled"
        if where == "tcp":
            assert "flashnode_paused" in scrape_tcp(m.address)
        else:
            assert scrape_unix(path)[0] == 200
    finally:
        stalled.close()
        m.close()


def test_connections_past_a_clients_share_are_closed_at_once() -> None:
    """A local user (or a trusted task, which shares the host's network) opening connection
    after connection gets at most ``MAX_PER_CLIENT`` of the agent's threads: one more is closed
    at once, not given a thread that waits ``REQUEST_S``; once those go, scrapes are answered."""
    m = create("127.0.0.1:0")
    assert isinstance(m, Metrics) and m.address is not None
    host, port = m.address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_PER_CLIENT)]
    try:
        for sock in held:
            sock.sendall(b"GET /metr")
        one_more = socket.create_connection((host, int(port)), timeout=REQUEST_S / 2)
        try:
            assert one_more.recv(1) == b"", "a connection past the client's share got a thread"
        finally:
            one_more.close()
    finally:
        for sock in held:
            sock.close()
    try:
        assert "flashnode_paused" in wait_for_scrape(m.address)
    finally:
        m.close()


DRIP = """
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
conns = []
for _ in range(8):
    try:
        conns.append(socket.create_connection((host, port), timeout=5))
    except OSError:
        pass
print("connected", flush=True)
end = time.monotonic() + 8
while time.monotonic() < end:
    for c in conns:
        try:
            c.send(b"G")
        except OSError:
            pass
    time.sleep(0.5)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the dripping clients run as another user")
def test_eight_dripping_connections_of_a_local_user_never_hold_the_owners_scrape() -> None:
    """Another local user opens eight connections and drips a byte into each every half
    second (each read within any per-read timeout): the owner's scrapes are answered within
    2 s all along, and the dripping connections are cut off at the request's deadline."""
    m = create("127.0.0.1:0")
    assert isinstance(m, Metrics) and m.address is not None
    host, port = m.address.rsplit(":", 1)
    dripper = subprocess.Popen(
        ["/usr/bin/python3", "-c", DRIP, host, port],
        user="nobody",
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert dripper.stdout is not None and dripper.stdout.readline() == "connected\n"
        for _ in range(6):
            assert "flashnode_paused" in scrape_tcp(m.address, timeout=2.0)
    finally:
        dripper.kill()
        dripper.wait(10)
        dripper.stdout.close()
        m.close()


def wait_for_scrape(address: str) -> str:
    """A scrape, once the connections closed just now have given their threads back."""

    def scrape() -> str | None:
        try:
            return scrape_tcp(address)
        except OSError:  # closed at once: the held threads are still ending
            return None

    return wait_for("a scrape answered", scrape, timeout=REQUEST_S * 2)


def test_a_stale_socket_is_replaced_but_a_live_one_or_a_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "metrics.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays; nobody listens
    first = create(f"unix:{path}")
    try:
        with pytest.raises(OSError, match="in use"):
            create(f"unix:{path}")
        assert scrape_unix(path)[0] == 200  # the refused second one did not disturb the first
    finally:
        first.close()
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    with pytest.raises(OSError, match="not a socket"):
        create(f"unix:{precious}")
    assert precious.read_text() == "keep me"


def test_remote_addresses_are_refused_without_the_opt_in() -> None:
    with pytest.raises(ValueError, match="not loopback"):
        create("0.0.0.0:0")
    assert not parse_listen("0.0.0.0:9464").loopback
    assert not parse_listen("192.168.1.5:9464").loopback
    assert not parse_listen("metrics.example.org:9464").loopback
    assert parse_listen("localhost:9464").loopback and parse_listen("[::1]:9464").loopback
    assert parse_listen("127.0.0.2:9464").loopback
    m = create("127.0.0.1:0", allow_remote=True)  # the opt-in does not force a remote address
    m.close()


def test_off_means_a_no_op_twin_and_no_prometheus_import() -> None:
    m = create(None)
    assert isinstance(m, NullMetrics)
    record(m)
    m.close()
    probe = (
        "import json, sys\n"
        "from flashnode.cli import controls\n"
        "from flashnode.config import settings\n"
        "from flashnode.owner import metrics\n"
        "m = metrics.create(None); m.uploaded(1); m.close()\n"
        "print(json.dumps('prometheus_client' in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


def _calls(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


def test_the_no_op_twin_takes_every_call_the_metrics_take_alike() -> None:
    """What the agent records (``MetricsSink``) is what the no-op twin offers, and the metrics
    take each call with the same parameters and defaults: neither can drift from the other."""
    sink = _calls(MetricsSink)
    assert sink == _calls(NullMetrics)
    exported = _calls(Metrics)
    assert {name: exported.get(name) for name in sink} == sink


def test_a_failing_conversation_is_marked_until_it_works_again() -> None:
    m = Metrics()
    fresh = samples(m.exposition().decode())
    for conversation in ("registration", "node_heartbeat", "claim"):  # there before any error
        labels = (("conversation", conversation),)
        assert fresh[("flashnode_coordinator_failing", labels)] == 0
        assert fresh[("flashnode_coordinator_errors_total", labels)] == 0
    m.coordinator_error("node heartbeat")
    m.coordinator_error("node heartbeat")
    failing = samples(m.exposition().decode())
    assert failing[("flashnode_coordinator_failing", (("conversation", "node_heartbeat"),))] == 1
    assert failing[("flashnode_coordinator_failing", (("conversation", "claim"),))] == 0
    m.coordinator_working("node heartbeat")
    again = samples(m.exposition().decode())
    assert again[("flashnode_coordinator_failing", (("conversation", "node_heartbeat"),))] == 0
    assert again[("flashnode_coordinator_errors_total", (("conversation", "node_heartbeat"),))] == 2


def test_the_timestamps_say_when_the_agent_started_published_and_last_finished() -> None:
    before = time.time()
    m = Metrics()
    got = samples(m.exposition().decode())
    assert before <= got[("flashnode_start_time_seconds", ())] <= time.time()
    assert got[("flashnode_status_published_timestamp_seconds", ())] == 0  # not yet
    assert got[("flashnode_last_attempt_finished_timestamp_seconds", ())] == 0  # none yet
    sink = PublishedSink(m)
    sink.send(READY=1)
    sink.tick()
    published = ("flashnode_status_published_timestamp_seconds", ())
    assert samples(m.exposition().decode())[published] == 0
    sink.status("idle")
    m.attempt_finished("failed", None)
    got = samples(m.exposition().decode())
    assert before <= got[("flashnode_status_published_timestamp_seconds", ())] <= time.time()
    assert before <= got[("flashnode_last_attempt_finished_timestamp_seconds", ())] <= time.time()
    PublishedSink(NullMetrics()).status("idle")  # metrics off: nothing to tell


def test_every_hold_a_decision_names_has_its_claiming_held_series() -> None:
    assert set(HELD_RULES) == set(get_args(get_type_hints(Hold)["rule"]))


SPOOF = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
for source in (None, "127.0.7.9"):
    s = socket.socket()
    s.settimeout(5)
    if source:  # the metrics port as its own, on another loopback address
        s.bind((source, port))
    s.connect((host, port))
    try:
        s.sendall(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
        print("answered" if s.recv(1) else "closed", flush=True)
    except ConnectionResetError:
        print("closed", flush=True)
    s.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the task user's client runs as another user")
def test_a_task_users_connection_is_refused_even_from_a_port_that_matches_the_agents() -> None:
    """The task users' connections are closed unanswered, also one whose source port is the
    metrics port itself (on another loopback address), which a lookup by ports alone mistook
    for the agent's own socket."""
    nobody = pwd.getpwnam("nobody").pw_uid
    m = create("127.0.0.1:0", refused_uids=frozenset({nobody}))
    assert isinstance(m, Metrics) and m.address is not None
    host, port = m.address.rsplit(":", 1)
    try:
        done = subprocess.run(
            ["/usr/bin/python3", "-c", SPOOF, host, port],
            user="nobody",
            capture_output=True,
            text=True,
            cwd="/",
            timeout=30,
        )
        assert done.stdout.split() == ["closed", "closed"], done.stdout + done.stderr
        assert "flashnode_paused" in scrape_tcp(m.address, timeout=2.0)
    finally:
        m.close()
