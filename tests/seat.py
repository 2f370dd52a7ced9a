"""What the end-to-end tests of the owner's controls share: a stand-in seat (``loginctl``) and
the agent's live view (status.json).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness import AgentProcess, wait_for

from flashnode.owner import status

# A task that prints a tick every 0.1 s until the test lets it end (``release``), at most
# 5 min: a pause the test waits for never races the task's own end.
TICKING = (
    "trap 'stop=1' USR1; i=0; while [ -z \"$stop\" ] && [ $i -lt 3000 ]; do i=$((i+1));"
    " echo tick $i; sleep 0.1; done; echo '{}' > /work/out/metrics.json"
)


def release(container: Any) -> None:
    """Let a container's ``TICKING`` task end: SIGUSR1 to its first process (the task's shell,
    or the init that passes it on). Not a ``docker exec``: under gVisor one made right after an
    unpause once hung for good (its answer never came), and the agent itself never execs."""
    container.kill(signal="SIGUSR1")


def last_tick(container: Any) -> int:
    """The number of the last tick the container printed, as the engine logged it (0: none)."""
    words = container.logs(tail=1).split()
    return int(words[1]) if len(words) == 2 and words[1].isdigit() else 0


def goes_on(container: Any, paused_at: int) -> None:
    """Wait until a container paused after its tick ``paused_at`` prints ticks again (one
    printed as the freeze came may still have been on its way to the log)."""
    wait_for("a tick printed after the pause", lambda: last_tick(container) > paused_at + 1)


def snapshot(agent: AgentProcess) -> dict[str, Any]:
    return status.read(agent.state_dir) or {}


def running(agent: AgentProcess) -> dict[str, Any] | None:
    attempts = snapshot(agent).get("running") or []
    return attempts[0] if attempts else None


class Seat:
    """A stand-in ``loginctl`` first on the agent's PATH, answering for seat0 what the test
    says: the owner at the keyboard, or idle since boot."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "fakebin"
        self.bin.mkdir()
        self.answer = root / "seat"
        script = self.bin / "loginctl"
        script.write_text(f"#!/bin/sh\ncat {self.answer}\n")
        script.chmod(0o755)
        self.idle()

    def active(self) -> None:
        self.answer.write_text("IdleHint=no\nIdleSinceHintMonotonic=0\n")

    def idle(self) -> None:
        self.answer.write_text("IdleHint=yes\nIdleSinceHintMonotonic=1\n")

    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "FLASHNODE_HOLD_WHEN_ACTIVE": "true",
            "FLASHNODE_ACTIVE_IDLE_SECONDS": "1",
            "FLASHNODE_SUSPEND_WHEN": "active",
        }
