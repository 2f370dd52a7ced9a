"""The coordinator edge against httpx's MockTransport: every status of every endpoint means one
thing (answers.STATUS), and whatever a broken answer raises becomes the agent's own error."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import ssl
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from harness import CoordinatorServer, free_port

from flashnode.coordinator.answers import STATUS, Done
from flashnode.coordinator.client import Coordinator, PlainHttp
from flashnode.coordinator.messages import (
    CheckpointPart,
    ExecutionEvidence,
    NodeCapabilities,
    NodeHeartbeat,
    NodeRegistration,
)
from flashnode.errors import (
    AttemptFailed,
    CheckpointRefused,
    CoordinatorError,
    CoordinatorUnavailable,
    CredentialsError,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    Unregistered,
)

OK_BODIES: dict[str, Any] = {
    "register": {"node_id": "n1", "status": "registered"},
    "complete": {"accepted": True},
    "upload": {"sha256": "0" * 64},
}


def client(handler: Callable[[httpx.Request], httpx.Response]) -> Coordinator:
    return Coordinator("http://coord.test", transport=httpx.MockTransport(handler))


def call(c: Coordinator, what: str) -> Any:
    registration = NodeRegistration(node_id="n1", hostname="h", capabilities=NodeCapabilities())
    calls: dict[str, Callable[[], Any]] = {
        "health": c.health,
        "nodes": lambda: c.node_view("n1"),
        "job": lambda: c.job_view("j1"),
        "register": lambda: c.register(registration),
        "node heartbeat": lambda: c.node_heartbeat(NodeHeartbeat(node_id="n1")),
        "claim": lambda: c.claim("n1"),
        "attempt heartbeat": lambda: c.attempt_heartbeat("ls-1"),
        "complete": lambda: c.complete("ls-1", "0" * 64, ExecutionEvidence()),
        "fail": lambda: c.fail("ls-1", "reason"),
        "upload": lambda: c.upload("jobs/j/t/metrics.json", io.BytesIO(b"{}"), 2),
        "download": lambda: c.download("shared/x", io.BytesIO(), 1 << 20),
        "checkpoint part": lambda: c.checkpoint_part(
            "j", "t", "ls-1", 1, CheckpointPart(key="k", sha256="0" * 64, size_bytes=1)
        ),
        "checkpoint commit": lambda: c.checkpoint_commit("j", "t", "ls-1", 1, [], "p/"),
        "checkpoint latest": lambda: c.checkpoint_latest("j", "t"),
    }
    return calls[what]()


CASES = [
    (what, status, meaning) for what, table in STATUS.items() for status, meaning in table.items()
]


@pytest.mark.parametrize(("what", "status", "meaning"), CASES)
def test_every_listed_status_means_what_the_table_says(
    what: str, status: int, meaning: type[Exception]
) -> None:
    c = client(lambda r: httpx.Response(status, json={"detail": "scripted"}))
    if meaning is Done:  # nothing more to do: the call returns
        assert call(c, what) is None
        return
    if what == "checkpoint latest" and meaning is NotFound:  # no checkpoint: None
        assert call(c, what) is None
        return
    with pytest.raises(meaning):
        call(c, what)


@pytest.mark.parametrize("what", list(STATUS))
@pytest.mark.parametrize(
    ("status", "meaning"),
    [(500, CoordinatorUnavailable), (503, CoordinatorUnavailable), (302, CoordinatorError)],
)
def test_unlisted_statuses_are_retried_or_refused(
    what: str, status: int, meaning: type[Exception]
) -> None:
    c = client(lambda r: httpx.Response(status, headers={"Location": "http://elsewhere/"}))
    if status in STATUS[what]:
        pytest.skip("listed")
    with pytest.raises(meaning):
        call(c, what)


def test_the_table_names_the_protocols_special_statuses() -> None:
    assert STATUS["attempt heartbeat"][410] is LeaseLost
    assert STATUS["claim"][403] is Unregistered and STATUS["node heartbeat"][404] is Unregistered
    assert STATUS["register"][403] is CredentialsError
    assert STATUS["upload"][413] is PayloadTooLarge and STATUS["upload"][403] is LeaseLost
    assert STATUS["download"][404] is NotFound
    assert STATUS["checkpoint commit"][409] is CheckpointRefused
    assert STATUS["fail"][410] is Done


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[" * 50_000 + b"]" * 50_000, b'"a string"', b"\xff\xfe"],
)
def test_broken_answers_become_coordinator_errors(body: bytes) -> None:
    c = client(lambda r: httpx.Response(200, content=body))
    for what in ("claim", "register", "complete"):
        with pytest.raises(CoordinatorError):
            call(c, what)


def test_transport_errors_are_worth_a_retry() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(CoordinatorUnavailable):
        call(client(refuse), "claim")


def test_ids_outside_the_protocols_charset_never_reach_a_url() -> None:
    seen: list[str] = []
    c = client(lambda r: (seen.append(str(r.url)), httpx.Response(200, json={}))[1])
    with pytest.raises(CoordinatorError, match="unsafe"):
        c.attempt_heartbeat("../../nodes/register")
    with pytest.raises(CoordinatorError, match="unsafe"):
        c.node_heartbeat(NodeHeartbeat(node_id="n1\nHost: x"))
    assert seen == []
    bad = client(lambda r: httpx.Response(200, json={"node_id": "a/b", "status": "registered"}))
    with pytest.raises(CoordinatorError, match="no usable node_id"):
        call(bad, "register")


def test_an_upload_sends_exactly_the_checked_size_and_refuses_a_short_file() -> None:
    got: list[bytes] = []

    def store(request: httpx.Request) -> httpx.Response:
        got.append(request.read())
        return httpx.Response(200, json={"sha256": hashlib.sha256(got[-1]).hexdigest()})

    c = client(store)
    c.upload("k", io.BytesIO(b"0123456789"), 4)  # a file that grew: only what was checked
    assert got == [b"0123"]
    with pytest.raises(AttemptFailed, match="shrank"):
        c.upload("k", io.BytesIO(b"01"), 4)


def test_error_answers_are_read_capped_and_one_line() -> None:
    c = client(lambda r: httpx.Response(500, content=b"<html>\n" + b"x" * 100 + b"</html>"))
    with pytest.raises(CoordinatorUnavailable) as info:
        call(c, "claim")
    assert "HTML page" in str(info.value) and "\n" not in str(info.value)
    huge = client(lambda r: httpx.Response(500, content=b"x" * (5 << 20)))
    with pytest.raises(CoordinatorError, match="larger than"):
        call(huge, "claim")


def test_download_streams_and_stops_at_its_cap() -> None:
    c = client(lambda r: httpx.Response(200, content=b"y" * 100))
    out = io.BytesIO()
    assert c.download("a/b", out, 1000) == 100 and out.getvalue() == b"y" * 100
    with pytest.raises(CoordinatorError, match="larger than"):
        c.download("a/b", io.BytesIO(), 10)


def test_the_node_view_is_this_nodes_entry_and_a_strange_answer_an_error() -> None:
    nodes = [{"node_id": "other"}, {"node_id": "n1", "accepted_tasks": 3}]
    c = client(lambda r: httpx.Response(200, json=nodes))
    view = c.node_view("n1")
    assert view is not None and view["accepted_tasks"] == 3
    assert c.node_view("n2") is None
    for body in ({"node_id": "n1"}, "[", [1, "x", None]):
        answer = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        strange = client(lambda r, a=answer: httpx.Response(200, content=a))  # type: ignore[misc]
        if body == [1, "x", None]:
            assert strange.node_view("n1") is None
        else:
            with pytest.raises(CoordinatorError):
                strange.node_view("n1")


def _tls_contexts() -> int:
    return sum(isinstance(o, ssl.SSLContext) for o in gc.get_objects())


def test_a_plain_http_coordinator_is_reached_without_any_tls_context(
    coordinator: CoordinatorServer,
) -> None:
    """Plain http has no certificate to verify: its client builds no OpenSSL context (0.5 MB of
    an idle agent's memory), and an https URL is refused before anything connects."""
    gc.collect()
    before = _tls_contexts()
    c = Coordinator(coordinator.url)
    try:
        c.health()
        assert c.node_view("no-such-node") is None
        gc.collect()
        assert _tls_contexts() == before
    finally:
        c.close()
    with PlainHttp() as transport, pytest.raises(httpx.UnsupportedProtocol, match="refused"):
        transport.handle_request(httpx.Request("GET", f"https://127.0.0.1:{free_port()}/"))
