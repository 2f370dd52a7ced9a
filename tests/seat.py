"""What the end-to-end tests of the owner's controls share: a stand-in seat (``loginctl``) and
the agent's live view (status.json).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness import AgentProcess

from flashnode.owner import status

# A task that prints a tick every 0.1 s until the test lets it end (``release``), at most
# 5 min: a pause the test waits for never races the task's own end.
TICKING = (
    "i=0; while [ ! -e /tmp/release ] && [ $i -lt 3000 ]; do i=$((i+1)); echo tick $i; "
    "sleep 0.1; done; echo '{}' > /work/out/metrics.json"
)


def release(container: Any) -> None:
    """Let a container's ``TICKING`` task end (its ``/tmp`` is the task's own tmpfs)."""
    code, out = container.exec_run(["touch", "/tmp/release"])
    assert code == 0, out


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
