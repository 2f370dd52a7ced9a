"""The real coordinator app behind a thin ASGI wrapper that records what nodes send to
register and complete (the coordinator itself ignores evidence): one JSON line per request in
the file named by $FLASHNODE_TEST_RECORD."""

from __future__ import annotations

import json
import os
from typing import Any

from flashruntime.service.app import app as inner

RECORDED = ("/nodes/register", "/complete")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(RECORDED):
        return await inner(scope, receive, send)
    messages, body = [], b""
    while True:
        message = await receive()
        messages.append(message)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    with open(os.environ["FLASHNODE_TEST_RECORD"], "a") as fh:
        fh.write(json.dumps({"path": scope["path"], "body": json.loads(body or b"null")}) + "\n")

    async def replay() -> Any:
        return messages.pop(0) if messages else await receive()

    return await inner(scope, replay, send)
