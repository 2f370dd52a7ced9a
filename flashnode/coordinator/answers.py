"""What a coordinator's answer means: the one status table (``STATUS``: what each status means,
per endpoint), ``check`` that turns a status into an answer or one of the exceptions of
``flashnode.errors``, the ``detail`` of an error answer (one line, never a page of HTML) and an
answer's JSON object. The bytes only: reading them off the wire is the client's.
"""

from __future__ import annotations

import json
from typing import Any

from flashnode.errors import (
    CheckpointRefused,
    CoordinatorError,
    CoordinatorUnavailable,
    CredentialsError,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    Unregistered,
)


class Done(Exception):
    """In ``STATUS``: the call needs nothing more (``fail`` on a lease already dead)."""


# What a status means, per endpoint (docs/protocol.md §3.0). Not listed: 200/201/204 are answers,
# 5xx is CoordinatorUnavailable (retry with backoff), 3xx a refused redirect, else CoordinatorError.
STATUS: dict[str, dict[int, type[Exception]]] = {
    "health": {},
    "nodes": {},
    "job": {404: NotFound},
    "register": {401: CredentialsError, 403: CredentialsError},
    "node heartbeat": {401: CredentialsError, 403: CredentialsError, 404: Unregistered},
    "claim": {401: CredentialsError, 403: Unregistered},
    "attempt heartbeat": {401: CredentialsError, 403: LeaseLost, 404: LeaseLost, 410: LeaseLost},
    "complete": {401: CredentialsError, 403: LeaseLost, 404: LeaseLost, 410: LeaseLost},
    "fail": {401: CredentialsError, 403: Done, 404: Done, 410: Done},
    "upload": {401: CredentialsError, 403: LeaseLost, 410: LeaseLost, 413: PayloadTooLarge},
    "download": {404: NotFound},
    "checkpoint part": {401: CredentialsError, 403: LeaseLost, 410: LeaseLost},
    "checkpoint commit": {
        401: CredentialsError,
        403: LeaseLost,
        409: CheckpointRefused,
        410: LeaseLost,
    },
    "checkpoint latest": {404: NotFound},
}


def check(what: str, status: int, body: bytes) -> None:
    if status in (200, 201, 204):
        return
    meaning = STATUS[what].get(status)
    detail = detail_of(body)
    if meaning is Done:
        raise Done()
    if meaning is not None:
        if issubclass(meaning, CoordinatorError):
            raise meaning(f"{what}: {status} {detail}", status)
        raise meaning(f"{what} refused ({status}: {detail})")
    if status >= 500:
        raise CoordinatorUnavailable(f"{what}: {status} {detail}", status)
    if 300 <= status < 400:
        raise CoordinatorError(f"{what}: redirect {status} refused", status)
    raise CoordinatorError(f"{what}: {status} {detail}", status)


def json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        raise CoordinatorError(f"{what} answer is not JSON") from None
    if not isinstance(value, dict):
        raise CoordinatorError(f"{what} answer is not a JSON object")
    return value


def detail_of(body: bytes) -> str:
    """The ``detail`` of an error answer, on one line; never a page of HTML."""
    try:
        value = json.loads(body)
        detail = value.get("detail", "") if isinstance(value, dict) else ""
    except (ValueError, RecursionError):
        head = body[:200].decode("utf-8", "replace").lstrip()
        if head[:1] == "<":
            return "an HTML page, not a coordinator's answer"
        detail = head
    text = detail if isinstance(detail, str) else json.dumps(detail)[:300]
    return " ".join(text.split())[:300]
