"""The real coordinator app behind a wrapper that counts requests: one line per answered request
("<monotonic time it arrived> <method> <path> <status> <seconds to the answer's start>") in the
file named by $FLASHNODE_BENCH_COUNT."""

from __future__ import annotations

import os
import time
from typing import Any

from flashruntime.service.app import app as inner

_out = open(os.environ["FLASHNODE_BENCH_COUNT"], "a", buffering=1)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        await inner(scope, receive, send)
        return
    arrived = time.monotonic()

    async def counted(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            took = time.monotonic() - arrived
            status = message["status"]
            _out.write(f"{arrived:.4f} {scope['method']} {scope['path']} {status} {took:.4f}\n")
        await send(message)

    await inner(scope, receive, counted)
