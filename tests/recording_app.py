"""The real coordinator app behind a thin ASGI wrapper that records what nodes send to
register, complete and the checkpoint writes (the coordinator itself ignores evidence, and keeps
no trace of a refused checkpoint write): one JSON line per request in the file named by
$FLASHNODE_TEST_RECORD, with the answer's status and the time the request arrived."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from flashruntime.service.app import app as inner

RECORDED = ("/nodes/register", "/complete", "/checkpoints/parts", "/checkpoints/commit")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(RECORDED):
        return await inner(scope, receive, send)
    arrived = time.time()
    messages, body = [], b""
    while True:
        message = await receive()
        messages.append(message)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    status = [0]

    async def replay() -> Any:
        return messages.pop(0) if messages else await receive()

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        await send(message)

    try:
        return await inner(scope, replay, sending)
    finally:
        with open(os.environ["FLASHNODE_TEST_RECORD"], "a") as fh:
            line = {
                "path": scope["path"],
                "body": json.loads(body or b"null"),
                "status": status[0],
                "t": arrived,
            }
            fh.write(json.dumps(line) + "\n")
