"""uv's failures: whose fault one is (``classify``: the job's lines or the node), and what of
uv's output the owner and the job are told (``summarize``: redacted, bounded, without what a
server answered).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from flashnode.caches.envlines import redact

TAIL_LINES = 10
MAX_REASON_CHARS = 1000


Fault = Literal["job", "node"]

NODE_RESOURCE = re.compile(
    r"No space left on device|os error 28\)|Disk quota exceeded|os error 122\)"
    r"|Read-only file system|os error 30\)|Too many open files|Cannot allocate memory"
    r"|Permission denied \(os error 13\)"
)
JOB_RESOLUTION = re.compile(r"No solution found when resolving|Failed to build|Failed to parse")
NODE_NETWORK = re.compile(
    r"error sending request|tcp connect error|dns error|failed to lookup address"
    r"|Connection refused|Connection reset|connection closed|network timeout|operation timed out"
    r"|HTTP status server error|invalid peer certificate|certificate verify failed"
    r"|Network is unreachable|No route to host|HTTP status client error \((407|408|429)\b"
)


def unreachable(output: str) -> bool:
    """Whether uv failed for want of an index (connection, DNS, TLS, 5xx, timeouts), not of a
    resource of this node's."""
    return not NODE_RESOURCE.search(output) and bool(NODE_NETWORK.search(output))


def classify(returncode: int, output: str) -> Fault:
    """Whose fault a failed uv run is, from its exit status and its output.

    The node's: killed by a signal it did not ask for, out of disk or memory, an index it cannot
    reach (connection, DNS, TLS, 5xx, timeouts). The job's: everything else, chiefly what the
    resolver or a build says about the job's lines (no such version, a conflict, no wheel for
    this Python, a line uv cannot parse).
    """
    if returncode < 0:
        return "node"
    if NODE_RESOURCE.search(output):
        return "node"
    if JOB_RESOLUTION.search(output):
        return "job"
    if NODE_NETWORK.search(output):
        return "node"
    return "job"


NOISE = re.compile(
    r"^(Using (CPython|Python)|Creating virtual environment|Activate with|Resolved |Prepared |"
    r"Installed |Uninstalled |Audited |Bytecode compiled| [+-] |\s*hint:)"
)
# What a server answered (a status line, its reason phrase): never told back to a job, whose
# lines may name any server it likes; the kind of failure (client or server error) stays.
HTTP_STATUS = re.compile(r"HTTP status (client|server) error \([^)]*\)")


def summarize(output: str, hidden: Sequence[str] = ()) -> str:
    """The last meaningful lines of uv's output, redacted, bounded, one per line; without uv's
    hints and without what a server answered (``HTTP_STATUS``, git's stderr)."""
    lines = [
        HTTP_STATUS.sub(r"HTTP \1 error", redact(line.rstrip(), hidden))
        for line in output.splitlines()
    ]
    if "Git operation failed" in output:  # git's stderr tells what a host answered: not shown
        lines = lines[
            : next((i for i, line in enumerate(lines) if line.strip() == "--- stderr"), None)
        ]
    lines = [line for line in lines if line.strip() and not NOISE.match(line)]
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if start is not None:
        lines = lines[start:]
    lines = [line[:300] for line in lines[-TAIL_LINES:]]
    text = "\n".join(lines)
    if len(text) > MAX_REASON_CHARS:
        text = text[:300] + " … " + text[-(MAX_REASON_CHARS - 305) :]
    return text
