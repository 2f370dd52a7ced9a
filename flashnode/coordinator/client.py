"""The coordinator client: the only module that imports httpx.

One method per endpoint (docs/protocol.md §3). What each status means is written once, in
``STATUS``; everything a hostile or broken answer can raise (transport and protocol errors, invalid
JSON, absurd nesting, a bad URL) becomes one of the exceptions of ``flashnode.errors`` here, at the
boundary. Every answer, error answers included, is read with a size cap and a total deadline, so a
huge or dripping response cannot exhaust memory or hang the agent. Redirects are never followed, so
credentials never leave for another host. Ids are checked before they go into a URL. What an
answer means is ``answers``; who may listen on a loopback port is ``listener``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit

import httpcore
import httpx

from flashnode import __version__
from flashnode.allocator import STREAM_CHUNK
from flashnode.config.urls import is_loopback
from flashnode.coordinator.answers import Done, check, detail_of, json_object
from flashnode.coordinator.ids import SAFE_ID
from flashnode.coordinator.listener import check_listener
from flashnode.coordinator.messages import (
    CheckpointManifest,
    CheckpointPart,
    CompleteRequest,
    ExecutionEvidence,
    NodeHeartbeat,
    NodeRegistration,
)
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    CoordinatorError,
    CoordinatorUnavailable,
    FlashnodeError,
    NotFound,
    disk_full,
    disk_full_error,
)
from flashnode.sanitise import sanitise

API = "/v1alpha1"
MAX_ANSWER_BYTES = 4 * 1024 * 1024
ANSWER_DEADLINE_S = 60.0


def _segment(value: str, what: str) -> str:
    """An id for a URL path segment, checked against the protocol's charset."""
    if not SAFE_ID.match(value):
        raise CoordinatorError(f"refusing to put an unsafe {what} in a URL")
    return value


def _key(key: str) -> str:
    return quote(key, safe="/")


class PlainHttp(httpx.HTTPTransport):
    """The transport to a plain-http coordinator (a loopback one): httpx's request handling and
    error mapping, over a connection pool with no TLS context at all. Plain http has no
    certificate to verify, and an https URL is refused before any connection (fails closed), so
    neither the trust store (3 MB of an idle agent's memory) nor even an empty OpenSSL context
    (0.5 MB) is built for a scheme it never speaks."""

    def __init__(self) -> None:
        # Not httpx's own __init__, which builds a context whatever the scheme: its pool (the
        # ``_pool`` its request handling uses, as caches.origins.CheckedTransport relies on
        # too), with httpx's default limits and no context.
        self._pool = httpcore.ConnectionPool(
            ssl_context=None,
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"{request.url.scheme} to a plain-http coordinator: refused (nothing verifies"
                " a certificate here)",
                request=request,
            )
        return super().handle_request(request)


class Coordinator:
    """A client for one coordinator. Thread-safe: httpx.Client may be shared between threads."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        join_code: str | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        answer_deadline: float = ANSWER_DEADLINE_S,
    ) -> None:
        self._answer_deadline = answer_deadline
        self._root = base_url
        headers = {"User-Agent": f"flashnode/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._join_code = join_code
        # Credentials in clear text to a loopback port: whoever holds the port gets them, and
        # any local user can take it while the coordinator is down. Each new connection first
        # checks who listens there (transport None: a real socket, not a test's stand-in).
        parts = urlsplit(base_url)
        self._loopback = (
            (parts.hostname or "", parts.port or 80)
            if transport is None and parts.scheme == "http" and is_loopback(parts.hostname or "")
            else None
        )
        self._guard = self._loopback if token or join_code else None
        if transport is None and parts.scheme == "http":
            transport = PlainHttp()
        self._client = httpx.Client(
            base_url=base_url + API,
            headers=headers,
            transport=transport,
            follow_redirects=False,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            trust_env=False,
        )

    def close(self) -> None:
        self._client.close()

    def set_credentials(self, token: str | None, join_code: str | None) -> None:
        """Present these from the next request on: the node read its stored credentials
        again after the coordinator refused the ones it had."""
        if token:
            self._client.headers["Authorization"] = f"Bearer {token}"
        else:
            self._client.headers.pop("Authorization", None)
        self._join_code = join_code
        self._guard = self._loopback if token or join_code else None

    def health(self) -> None:
        """GET /healthz: raises CoordinatorError unless the coordinator answers 200."""
        self._call("health", "GET", self._root + "/healthz")

    def stranger(self) -> str | None:
        """What answers at this URL, when it is not a flashruntime coordinator; None when it is
        one (``GET /healthz`` answers 200 ``{"status": "ok", …}``, docs/protocol.md §1). Names
        the answer: its status, its type and the ``Server`` that sent it (escaped). Raises
        CoordinatorUnavailable when nothing answers (a transport error, a 5xx): that says
        nothing about what the URL is."""
        try:
            with self._client.stream("GET", self._root + "/healthz") as resp:
                body = _read_capped(resp, "GET", "/healthz", self._answer_deadline)
                status, headers = resp.status_code, resp.headers
        except FlashnodeError:
            raise
        except Exception as exc:
            raise _mapped(exc, "GET /healthz") from None
        if status >= 500:
            raise CoordinatorUnavailable(f"GET /healthz: {status} {detail_of(body)}", status)
        with contextlib.suppress(ValueError, RecursionError):
            value = json.loads(body)
            if status == 200 and isinstance(value, dict) and value.get("status") == "ok":
                return None
        kind = headers.get("content-type", "").split(";")[0].strip() or "no content type"
        server = headers.get("server", "").strip()
        sent = f"from Server: {sanitise(server, limit=80)}" if server else "with no Server header"
        console = " (a flashnode agent's console)" if server.startswith("flashnode") else ""
        return f"GET /healthz answered {status} ({sanitise(kind, limit=60)}) {sent}{console}"

    # --- nodes --------------------------------------------------------------------------------

    def register(self, registration: NodeRegistration) -> str:
        """Register (or re-register) this node; returns the effective node id."""
        headers = {"X-FlashML-Join-Code": self._join_code} if self._join_code else {}
        _, body = self._call(
            "register",
            "POST",
            "/nodes/register",
            json=registration.model_dump(mode="json"),
            headers=headers,
        )
        node_id = json_object(body, "register").get("node_id")
        if not isinstance(node_id, str) or not SAFE_ID.match(node_id):
            raise CoordinatorError("register answer carries no usable node_id")
        return node_id

    def node_heartbeat(self, heartbeat: NodeHeartbeat) -> None:
        node = _segment(heartbeat.node_id, "node id")
        self._call(
            "node heartbeat",
            "POST",
            f"/nodes/{node}/heartbeat",
            json=heartbeat.model_dump(mode="json"),
        )

    def node_view(self, node_id: str) -> dict[str, Any] | None:
        """The coordinator's view of one node (``GET /nodes``: its record, accepted tasks,
        reliability, placement tier), as the coordinator sent it; None when it lists no such
        node. What it holds is the coordinator's text: check and escape before showing it."""
        _, body = self._call("nodes", "GET", "/nodes")
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            raise CoordinatorError("nodes answer is not JSON") from None
        if not isinstance(value, list):
            raise CoordinatorError("nodes answer is not a list")
        for node in value:
            if isinstance(node, dict) and node.get("node_id") == node_id:
                return node
        return None

    def job_view(self, job_id: str) -> dict[str, Any]:
        """A job's record as its submitter sees it (``GET /jobs/{id}``: its name, its state),
        as the coordinator sent it; NotFound when it knows no such job. The coordinator's
        text: check and escape before showing it."""
        _, body = self._call("job", "GET", f"/jobs/{_segment(job_id, 'job id')}")
        return json_object(body, "job")

    # --- leases -------------------------------------------------------------------------------

    def claim(self, node_id: str) -> dict[str, Any] | None:
        """Claim a lease: the raw lease object, or None when nothing is eligible for this node."""
        status, body = self._call(
            "claim", "POST", "/leases/claim", json={"node_id": node_id, "job_id": None}
        )
        if status == 204:
            return None
        return json_object(body, "claim")

    def attempt_heartbeat(self, lease_id: str) -> None:
        self._call(
            "attempt heartbeat", "POST", f"/attempts/{_segment(lease_id, 'lease id')}/heartbeat"
        )

    def complete(
        self, lease_id: str, output_sha256: str, evidence: ExecutionEvidence
    ) -> tuple[bool, str]:
        """Commit; returns (accepted, detail). ``accepted`` False is final."""
        req = CompleteRequest(output_sha256=output_sha256, evidence=evidence)
        _, body = self._call(
            "complete",
            "POST",
            f"/attempts/{_segment(lease_id, 'lease id')}/complete",
            json=req.model_dump(mode="json"),
        )
        answer = json_object(body, "complete")
        detail = answer.get("detail")
        return answer.get("accepted") is True, detail[:300] if isinstance(detail, str) else ""

    def fail(self, lease_id: str, reason: str) -> None:
        """Report a failed attempt. A dead or unknown lease needs nothing more."""
        try:
            self._call(
                "fail",
                "POST",
                f"/attempts/{_segment(lease_id, 'lease id')}/fail",
                json={"reason": reason},
            )
        except Done:
            return

    # --- artifacts ----------------------------------------------------------------------------

    def upload(self, key: str, fh: BinaryIO, size: int) -> str:
        """PUT exactly ``size`` bytes read from ``fh`` (an open file the caller checked), hashing
        them on the way; returns their sha256 after checking that the coordinator stored the same
        bytes. A file that ends early is AttemptFailed: it changed after it was checked."""
        digest = hashlib.sha256()
        _, body = self._call(
            "upload",
            "PUT",
            f"/artifacts/{_key(key)}",
            content=_exactly(fh, size, digest, key),
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
        )
        local = digest.hexdigest()
        if json_object(body, "upload").get("sha256") != local:
            raise CoordinatorUnavailable(f"upload of {key} arrived corrupted (sha256 mismatch)")
        return local

    def download(
        self, key: str, out: BinaryIO, max_bytes: int, stop: threading.Event | None = None
    ) -> int:
        """GET an artifact into ``out`` as a stream; returns its size. NotFound if missing;
        CoordinatorError past ``max_bytes``; CoordinatorUnavailable when ``stop`` is set or the
        transfer stalls (no byte for the client's read timeout); AttemptLapsed (``DiskFull``)
        when ``out`` cannot be written: this node's fault, not the coordinator's."""
        size = 0
        try:
            with self._client.stream("GET", f"/artifacts/{_key(key)}") as resp:
                if resp.status_code != 200:
                    check("download", resp.status_code, _read_capped(resp, "GET", key))
                    raise CoordinatorError(f"download: unexpected {resp.status_code}")
                for chunk in resp.iter_bytes():  # as it arrives: a stop is seen between reads
                    size += len(chunk)
                    if size > max_bytes:
                        raise CoordinatorError(f"input {key} is larger than {max_bytes} bytes")
                    if stop is not None and stop.is_set():
                        raise CoordinatorUnavailable(f"download of {key} stopped")
                    try:
                        out.write(chunk)
                    except OSError as exc:  # this node's disk, not the coordinator
                        full = disk_full(exc)
                        if full is not None:
                            raise disk_full_error(full) from None
                        raise AttemptLapsed(f"cannot write {key}: {exc.strerror}") from None
                return size
        except FlashnodeError:
            raise
        except Exception as exc:
            raise _mapped(exc, f"download of {key}") from None

    # --- checkpoints (docs/protocol.md §8) -------------------------------------------------------

    def checkpoint_part(
        self, job_id: str, task_id: str, lease_id: str, step: int, part: CheckpointPart
    ) -> None:
        self._call(
            "checkpoint part",
            "POST",
            f"{_task_path(job_id, task_id)}/checkpoints/parts",
            json={"attempt_id": lease_id, "step": step, "part": part.model_dump(mode="json")},
        )

    def checkpoint_commit(
        self,
        job_id: str,
        task_id: str,
        lease_id: str,
        step: int,
        parts: list[CheckpointPart],
        storage_prefix: str,
        world_size: int = 1,
        framework: str = "",
    ) -> None:
        self._call(
            "checkpoint commit",
            "POST",
            f"{_task_path(job_id, task_id)}/checkpoints/commit",
            json={
                "attempt_id": lease_id,
                "step": step,
                "expected_parts": [p.model_dump(mode="json") for p in parts],
                "storage_prefix": storage_prefix,
                "world_size": world_size,
                "framework": framework,
            },
        )

    def checkpoint_latest(self, job_id: str, task_id: str) -> CheckpointManifest | None:
        """The task's newest valid checkpoint, None when it has none (or says nonsense)."""
        try:
            _, body = self._call(
                "checkpoint latest", "GET", f"{_task_path(job_id, task_id)}/checkpoints/latest"
            )
        except NotFound:
            return None
        return CheckpointManifest.parse(json_object(body, "checkpoint latest"))

    # --- plumbing -----------------------------------------------------------------------------

    def _call(self, what: str, method: str, path: str, **kwargs: Any) -> tuple[int, bytes]:
        """One request; the answer is read with a size cap and a total deadline and its status
        checked against ``STATUS``."""
        if self._guard is not None:
            check_listener(*self._guard)
        try:
            with self._client.stream(method, path, **kwargs) as resp:
                body = _read_capped(resp, method, path, self._answer_deadline)
                status = resp.status_code
        except FlashnodeError:
            raise
        except Exception as exc:
            raise _mapped(exc, f"{method} {path}") from None
        check(what, status, body)
        return status, body


def _task_path(job_id: str, task_id: str) -> str:
    return f"/jobs/{_segment(job_id, 'job id')}/tasks/{_segment(task_id, 'task id')}"


def _read_capped(
    resp: httpx.Response, method: str, path: str, deadline_s: float = ANSWER_DEADLINE_S
) -> bytes:
    deadline = time.monotonic() + deadline_s
    chunks: list[bytes] = []
    size = 0
    for chunk in resp.iter_bytes():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise CoordinatorError(f"{method} {path}: answer larger than {MAX_ANSWER_BYTES} bytes")
        if time.monotonic() > deadline:
            raise CoordinatorUnavailable(f"{method} {path}: answer too slow")
        chunks.append(chunk)
    return b"".join(chunks)


def _mapped(exc: Exception, what: str) -> CoordinatorError:
    """Transport and protocol errors are worth a retry; anything else the HTTP stack raised (an
    invalid URL, a protocol violation of our own making) is not."""
    text = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__
    if isinstance(exc, (httpx.TransportError, httpx.StreamError, OSError)):
        return CoordinatorUnavailable(f"{what}: {text}")
    return CoordinatorError(f"{what}: {text}")


def _exactly(fh: BinaryIO, size: int, digest: Any, key: str) -> Iterator[bytes]:
    left = size
    while left > 0:
        chunk = fh.read(min(STREAM_CHUNK, left))
        if not chunk:
            raise AttemptFailed(f"{key.rsplit('/', 1)[-1]} shrank while it was uploaded")
        digest.update(chunk)
        left -= len(chunk)
        yield chunk
