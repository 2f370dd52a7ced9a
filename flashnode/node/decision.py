"""What the loop does this turn (``Decision``): the holds on claiming (``Hold``: the owner's
rules and the node's own), whether running tasks must be suspended or stopped, and the owner's
pause in force.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from flashnode.config.schedule import Pause


@dataclass(frozen=True)
class Hold:
    """One rule holding claiming, why, what the owner can do about it (``fix``), and whether
    it also suspends running tasks."""

    # The owner's rules, and the node's own holds: a full disk, the black-hole guard's
    # quarantine, the backoff after a revoked lease (guard.py); the owner's courtesy (every GPU
    # the owner's or too hot, or the CPU too hot: courtesy/); the coordinator refusing the
    # node's credentials (session.py).
    rule: Literal[
        "pause",
        "window",
        "battery",
        "active",
        "load",
        "disk",
        "quarantine",
        "revoked",
        "courtesy",
        "credentials",
    ]
    reason: str
    suspends: bool = False
    fix: str = ""


@dataclass(frozen=True)
class Decision:
    """What the loop does this turn.

    * ``may_claim``: no rule holds. ``hold_reason`` says why not.
    * ``suspend_reason``: running tasks must be suspended now (None: let them run, and resume
      any that were suspended).
    * ``stop_reason``: running tasks must be stopped now, an ending that is not the task's fault
      (``flashnode pause --now``); it stays set while that pause lasts.
    * ``paused``: the owner's explicit pause in force, if any (status, metrics).
    """

    holds: tuple[Hold, ...] = ()
    stop_reason: str | None = None
    paused: Pause | None = None

    @property
    def may_claim(self) -> bool:
        return not self.holds

    @property
    def hold_reason(self) -> str | None:
        return "; ".join(h.reason for h in self.holds) or None

    @property
    def suspend_reason(self) -> str | None:
        return "; ".join(h.reason for h in self.holds if h.suspends) or None

    def holding(self, *more: Hold | None) -> Decision:
        """This decision with the node's own holds added (those that hold: not None)."""
        extra = tuple(h for h in more if h is not None)
        return replace(self, holds=self.holds + extra) if extra else self

    def snapshot(self) -> dict[str, Any]:
        """For status.json."""
        return {
            "paused": self.paused.to_json() if self.paused else None,
            "held_by": [
                {"rule": h.rule, "reason": h.reason, "fix": h.fix, "suspends": h.suspends}
                for h in self.holds
            ],
            "stop_reason": self.stop_reason,
        }
