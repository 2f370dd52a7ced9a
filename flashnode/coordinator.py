"""The coordinator client: the only module that imports httpx.

One method per endpoint (PROTOCOL.md §3); each translates statuses into a return value or one of
the exceptions of ``flashnode.errors``. Answers are read with a size cap and a total deadline, so
a huge or dripping response cannot exhaust memory or hang the agent. Redirects are never followed,
so credentials never leave for another host.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx

from flashnode import __version__
from flashnode.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    CredentialsError,
    LeaseLost,
    PayloadTooLarge,
    Unregistered,
)
from flashnode.wire import CompleteRequest, ExecutionEvidence, NodeHeartbeat, NodeRegistration

API = "/v1alpha1"
MAX_ANSWER_BYTES = 4 * 1024 * 1024
ANSWER_DEADLINE_S = 60.0
CHUNK = 1024 * 1024


class NotFound(CoordinatorError):
    """The artifact or lease does not exist."""


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
        self._client = httpx.Client(
            base_url=base_url + API,
            headers=headers,
            transport=transport,
            follow_redirects=False,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            verify=True,
            trust_env=False,
        )

    def close(self) -> None:
        self._client.close()

    def health(self) -> None:
        """GET /healthz: raises CoordinatorError unless the coordinator answers 200."""
        status, body = self._call("GET", self._root + "/healthz")
        self._expect(status, body, "health check")

    # --- nodes --------------------------------------------------------------------------------

    def register(self, registration: NodeRegistration) -> str:
        """Register (or re-register) this node; returns the effective node id."""
        headers = {"X-FlashML-Join-Code": self._join_code} if self._join_code else {}
        status, body = self._call(
            "POST", "/nodes/register", json=registration.model_dump(mode="json"), headers=headers
        )
        if status in (401, 403):
            raise CredentialsError(f"registration refused ({status}: {_detail(body)})")
        self._expect(status, body, "register")
        node_id = _json(body, "register").get("node_id")
        if not isinstance(node_id, str) or not node_id:
            raise CoordinatorError("register answer carries no node_id")
        return node_id

    def node_heartbeat(self, heartbeat: NodeHeartbeat) -> None:
        status, body = self._call(
            "POST",
            f"/nodes/{heartbeat.node_id}/heartbeat",
            json=heartbeat.model_dump(mode="json"),
        )
        if status == 404:
            raise Unregistered("coordinator does not know this node", status)
        if status in (401, 403):
            raise CredentialsError(f"node heartbeat refused ({status}: {_detail(body)})")
        self._expect(status, body, "node heartbeat")

    # --- leases -------------------------------------------------------------------------------

    def claim(self, node_id: str) -> dict[str, Any] | None:
        """Claim a lease: the raw lease object, or None when nothing is eligible for this node."""
        status, body = self._call(
            "POST", "/leases/claim", json={"node_id": node_id, "job_id": None}
        )
        if status == 204:
            return None
        if status == 403:
            raise Unregistered(f"claim refused ({_detail(body)})", status)
        if status == 401:
            raise CredentialsError(f"claim refused ({status}: {_detail(body)})")
        self._expect(status, body, "claim")
        return _json(body, "claim")

    def attempt_heartbeat(self, lease_id: str) -> None:
        status, body = self._call("POST", f"/attempts/{lease_id}/heartbeat")
        if status in (403, 404, 410):
            raise LeaseLost(_detail(body), status)
        self._expect(status, body, "attempt heartbeat")

    def complete(
        self, lease_id: str, output_sha256: str, evidence: ExecutionEvidence
    ) -> tuple[bool, str]:
        """Commit; returns (accepted, detail). ``accepted`` False is final."""
        req = CompleteRequest(output_sha256=output_sha256, evidence=evidence)
        status, body = self._call(
            "POST", f"/attempts/{lease_id}/complete", json=req.model_dump(mode="json")
        )
        if status in (403, 404, 410):
            raise LeaseLost(_detail(body), status)
        self._expect(status, body, "complete")
        answer = _json(body, "complete")
        detail = answer.get("detail")
        return answer.get("accepted") is True, detail if isinstance(detail, str) else ""

    def fail(self, lease_id: str, reason: str) -> None:
        """Report a failed attempt. A dead or unknown lease needs nothing more."""
        status, body = self._call("POST", f"/attempts/{lease_id}/fail", json={"reason": reason})
        if status in (403, 404, 410):
            return
        self._expect(status, body, "fail")

    # --- artifacts ----------------------------------------------------------------------------

    def upload(self, key: str, path: Path) -> str:
        """PUT a file as a stream, hashing it on the way; returns its sha256 after checking that
        the coordinator stored the same bytes."""
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            size = _size(fh)
            status, body = self._call(
                "PUT",
                f"/artifacts/{quote(key, safe='/')}",
                content=_hashing(fh, digest),
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            )
        if status == 413:
            raise PayloadTooLarge(f"{key}: {_detail(body)}", status)
        if status in (403, 410):
            raise LeaseLost(_detail(body), status)
        self._expect(status, body, "upload")
        local = digest.hexdigest()
        remote = _json(body, "upload").get("sha256")
        if remote != local:
            raise CoordinatorUnavailable(f"upload of {key} arrived corrupted (sha256 mismatch)")
        return local

    def download(self, key: str, dest: Path, max_bytes: int) -> int:
        """GET an artifact into ``dest`` as a stream; returns its size. NotFound if missing."""
        deadline = time.monotonic() + 3600.0
        try:
            with self._client.stream("GET", f"/artifacts/{quote(key, safe='/')}") as resp:
                if resp.status_code == 404:
                    raise NotFound(f"no artifact at {key}", 404)
                if resp.status_code != 200:
                    resp.read()
                    self._expect(resp.status_code, resp.content, "download")
                size = 0
                with dest.open("wb") as out:
                    for chunk in resp.iter_bytes(CHUNK):
                        size += len(chunk)
                        if size > max_bytes:
                            raise CoordinatorError(f"input {key} is larger than {max_bytes} bytes")
                        if time.monotonic() > deadline:
                            raise CoordinatorUnavailable(f"download of {key} took too long")
                        out.write(chunk)
                return size
        except httpx.HTTPError as exc:
            raise CoordinatorUnavailable(f"download of {key}: {_describe(exc)}") from None

    # --- plumbing -----------------------------------------------------------------------------

    def _call(self, method: str, path: str, **kwargs: Any) -> tuple[int, bytes]:
        """One request; the body is read with a size cap and a total deadline."""
        deadline = time.monotonic() + self._answer_deadline
        try:
            with self._client.stream(method, path, **kwargs) as resp:
                chunks: list[bytes] = []
                size = 0
                for chunk in resp.iter_bytes():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise CoordinatorError(
                            f"{method} {path}: answer larger than {MAX_ANSWER_BYTES} bytes"
                        )
                    if time.monotonic() > deadline:
                        raise CoordinatorUnavailable(f"{method} {path}: answer too slow")
                    chunks.append(chunk)
                return resp.status_code, b"".join(chunks)
        except httpx.HTTPError as exc:
            raise CoordinatorUnavailable(f"{method} {path}: {_describe(exc)}") from None

    @staticmethod
    def _expect(status: int, body: bytes, what: str) -> None:
        if status >= 500:
            raise CoordinatorUnavailable(f"{what}: {status} {_detail(body)}", status)
        if 300 <= status < 400:
            raise CoordinatorError(f"{what}: redirect {status} refused", status)
        if status not in (200, 201):
            raise CoordinatorError(f"{what}: {status} {_detail(body)}", status)


def _json(body: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        raise CoordinatorError(f"{what} answer is not JSON") from None
    if not isinstance(value, dict):
        raise CoordinatorError(f"{what} answer is not a JSON object")
    return value


def _detail(body: bytes) -> str:
    """The ``detail`` of an error answer, on one line; never a page of HTML."""
    try:
        detail = json.loads(body).get("detail", "")
    except (ValueError, AttributeError):
        head = body[:200].decode("utf-8", "replace").lstrip()
        if head[:1] == "<":
            return "an HTML page, not a coordinator's answer"
        detail = head
    return " ".join(str(detail).split())[:300]


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__


def _size(fh: BinaryIO) -> int:
    fh.seek(0, 2)
    size = fh.tell()
    fh.seek(0)
    return size


def _hashing(fh: BinaryIO, digest: Any) -> Iterator[bytes]:
    while chunk := fh.read(CHUNK):
        digest.update(chunk)
        yield chunk
