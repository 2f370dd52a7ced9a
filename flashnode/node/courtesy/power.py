"""``gpu_power_limit_percent``: while an attempt holds a GPU (and the owner does not use it),
its power limit is that share of its default limit (within what the GPU allows); once none
holds it, the limit the owner had is set again. MIG devices are left alone (their GPU's limit
is shared by all of them). The owner's limit is written to the state dir (``gpu-power.json``)
before the first change, so that an agent that was killed sets it again at its next start."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from flashnode import statefile
from flashnode.evidence.gpupool import Device, PowerLimit

log = logging.getLogger(__name__)

RECORD = "gpu-power.json"
TOLERANCE_MW = 1000  # a limit read back this close to the one set is that one (drivers round)


class PowerPort(Protocol):
    def power_limit(self, device: Device) -> PowerLimit | None: ...
    def set_power_limit(self, device: Device, milliwatts: int) -> str | None: ...


class PowerCap:
    """Used from one thread at a time (the courtesy's, then the shutdown's). A limit someone
    else sets while a task runs is theirs: it is neither capped nor set back after."""

    def __init__(self, port: PowerPort, state_dir: Path, percent: Callable[[], float | None]):
        """``percent``: the setting now (a reload may change it; None: off)."""
        self._port, self._path, self._percent = port, state_dir / RECORD, percent
        self._owners: dict[str, int] = self._read()  # visible -> the owner's limit (mW)
        self._applied: dict[str, int] = {}  # visible -> the limit this agent set
        self._failed: dict[str, float | None] = {}  # visible -> the percent that failed
        self._unrestored: set[str] = set()  # logged once; tried again every turn

    def restore_left(self, devices: Sequence[Device], held: set[str]) -> None:
        """At the start: the owner's limits an earlier run left changed (it was killed), set
        again on every GPU no rejoined task holds."""
        for device in devices:
            if device.visible in self._owners and device.visible not in held:
                self._restore(device)

    def follow(self, devices: Sequence[Device], held: set[str]) -> None:
        """Each GPU in ``held``: capped (as the setting says now); each other: the owner's
        limit, if this agent changed it (tried again each turn until it is set)."""
        percent = self._percent()
        for device in devices:
            if device.visible in held and percent is not None:
                self._cap(device, percent)
            elif device.visible in self._owners:
                self._restore(device)

    def close(self, devices: Sequence[Device], held: set[str]) -> None:
        """The agent leaves: the owner's limit again where no task runs on."""
        self.restore_left(devices, held)

    def _cap(self, device: Device, percent: float) -> None:
        key = device.visible
        if key in self._failed and self._failed[key] == percent:
            return  # said once; a reload to another percent tries again
        if device.board is not device.instance:  # its limit is its whole GPU's, shared
            self._fail(device, percent, "a MIG device shares its GPU's power limit")
            return
        limits = self._port.power_limit(device)
        if limits is None:
            self._fail(device, percent, "its power limit cannot be read")
            return
        want = min(max(int(limits.default * percent / 100), limits.low), limits.high)
        applied = self._applied.get(key)
        if applied is not None and abs(limits.now - applied) > TOLERANCE_MW:
            # Set by someone else meanwhile (the owner's nvidia-smi): theirs to keep.
            log.warning(
                "GPU %s: its power limit was changed to %.0f W outside flashnode: left so",
                device.info.index,
                limits.now / 1000,
            )
            self._applied.pop(key)
            self._owners.pop(key, None)
            self._write()
            self._failed[key] = percent
            return
        if applied == want:
            return
        recorded = key not in self._owners
        if recorded:
            self._owners[key] = limits.now
            if not self._write():
                self._owners.pop(key)
                self._fail(device, percent, f"its limit cannot be recorded in {self._path}")
                return
        why = self._port.set_power_limit(device, want)
        if why is not None:
            self._fail(device, percent, why)
            if recorded:  # nothing changed: nothing to set back
                self._owners.pop(key)
                self._write()
            return
        self._applied[key] = want
        self._failed.pop(key, None)
        log.info(
            "GPU %s: power limit %.0f W while tasks run (the owner's: %.0f W)",
            device.info.index,
            want / 1000,
            self._owners[key] / 1000,
        )

    def _restore(self, device: Device) -> None:
        key = device.visible
        owner = self._owners[key]
        why = self._port.set_power_limit(device, owner)
        if why is not None:
            if key not in self._unrestored:  # kept, and tried again at the next turn
                self._unrestored.add(key)
                log.error(
                    "GPU %s: cannot set its power limit back to the owner's %.0f W: %s",
                    device.info.index,
                    owner / 1000,
                    why,
                )
            return
        log.info("GPU %s: power limit back to the owner's %.0f W", device.info.index, owner / 1000)
        self._unrestored.discard(key)
        self._applied.pop(key, None)
        self._owners.pop(key, None)
        self._write()

    def _fail(self, device: Device, percent: float, why: str) -> None:
        self._failed[device.visible] = percent
        log.warning("GPU %s: gpu_power_limit_percent not applied: %s", device.info.index, why)

    def _read(self) -> dict[str, int]:
        try:
            data = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error(
                "%s is unreadable (%s): power limits it held are not restored", self._path, exc
            )
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            str(k): v
            for k, v in data.items()
            if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 10_000_000
        }

    def _write(self) -> bool:
        try:
            if self._owners:
                statefile.write(self._path, json.dumps(self._owners).encode(), durable=True)
            else:
                self._path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("cannot write %s: %s", self._path, exc)
            return False
        return True
