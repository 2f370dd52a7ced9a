"""The real coordinator app behind a wrapper that counts requests: one line per request
("<monotonic time> <method> <path>") in the file named by $FLASHNODE_BENCH_COUNT."""

from __future__ import annotations

import os
import time
from typing import Any

from flashruntime.service.app import app as inner

_out = open(os.environ["FLASHNODE_BENCH_COUNT"], "a", buffering=1)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        _out.write(f"{time.monotonic():.4f} {scope['method']} {scope['path']}\n")
    await inner(scope, receive, send)
