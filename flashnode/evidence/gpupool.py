"""The node's GPUs as a pool: each handed to at most one running attempt at a time, and none
while it is blocked (the owner uses it, or it runs too hot: ``node/courtesy``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from flashnode.coordinator.messages import GpuInfo
from flashnode.errors import AttemptFailed


@dataclass(frozen=True)
class Device:
    """One GPU of this node: what is registered, and how a task is pointed at it."""

    info: GpuInfo
    visible: str  # its CUDA_VISIBLE_DEVICES name: the NVML index, or a MIG device's UUID
    handle: Any = None  # the NVML handle, None where NVML reports no utilisation
    minor: int | None = None  # its /dev/nvidia<minor> (a MIG device: its GPU's), where known
    instance: Any = None  # the NVML handle whose processes are this GPU's (a MIG device's own)
    board: Any = None  # the whole GPU's NVML handle: temperature, power (a MIG device's parent)

    @property
    def device_file(self) -> str | None:
        """The device file that opens this GPU, where known."""
        if self.minor is not None:
            return f"/dev/nvidia{self.minor}"
        return f"/dev/nvidia{self.visible}" if self.visible.isdigit() else None


@dataclass(frozen=True)
class PowerLimit:
    """A GPU's power limits, in mW: now, its default, and the range it may be set in."""

    now: int
    default: int
    low: int
    high: int


class GpuPool:
    def __init__(self, devices: list[Device] | None = None) -> None:
        self._lock = threading.Lock()
        self.devices: list[Device] = list(devices or [])
        self._held: set[str] = set()
        self._blocked: dict[str, str] = {}  # visible -> why no attempt may take it now

    def set_devices(self, devices: list[Device]) -> None:
        """Take a fresh inventory; GPUs still held stay held."""
        with self._lock:
            self.devices = list(devices)

    def block(self, blocked: dict[str, str]) -> None:
        """The GPUs no attempt may take now, each with why (all others may be taken)."""
        with self._lock:
            self._blocked = dict(blocked)

    @property
    def blocked(self) -> dict[str, str]:
        with self._lock:
            return dict(self._blocked)

    def held(self) -> set[str]:
        """The GPUs attempts hold now (by ``visible``)."""
        with self._lock:
            return set(self._held)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free())

    def _free(self) -> list[Device]:
        return [d for d in self.devices if d.visible not in self._held | self._blocked.keys()]

    def acquire(self, count: int) -> list[Device]:
        """``count`` GPUs no other attempt holds, or AttemptFailed with the reason."""
        if count <= 0:
            return []
        with self._lock:
            if count > len(self.devices):
                raise AttemptFailed(
                    f"task asks for {count} GPU(s); this node has {len(self.devices)}"
                )
            free = self._free()
            if count > len(free):
                raise AttemptFailed(
                    f"task asks for {count} GPU(s); {len(free)} of this node's are free now"
                )
            taken = free[:count]
            self._held.update(d.visible for d in taken)
            return taken

    def take(self, visible: list[str]) -> list[Device]:
        """Hold the GPUs named (a rejoined task's, held since before this agent started);
        a name this node no longer has is skipped."""
        with self._lock:
            taken = [d for d in self.devices if d.visible in visible]
            self._held.update(d.visible for d in taken)
            return taken

    def release(self, devices: list[Device]) -> None:
        with self._lock:
            self._held.difference_update(d.visible for d in devices)
