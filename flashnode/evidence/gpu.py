"""NVIDIA GPUs through NVML: the only module that imports pynvml (the nvidia-ml-py binding),
and only where the NVML library loads (the binding costs an agent without GPUs 2 MB).

No NVML library or no driver means no GPUs (and one log line), never a crash. Every reading
that fails is None, never 0.

MIG: a GPU with MIG mode enabled is not handed out whole. Each of its MIG devices becomes one
GPU of this node (name "<GPU name> MIG <n>", its own memory), handed to tasks by its UUID in
``CUDA_VISIBLE_DEVICES``. NVML reports no utilisation for MIG devices, so their figures are None;
their processes are their own, their temperature and power limit their GPU's.

What the owner's courtesy reads (``node/courtesy``): each GPU's processes, its temperature, and
its power limit, which it may set (as root).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any

from flashnode.coordinator.messages import GpuInfo
from flashnode.evidence.gpupool import Device, PowerLimit

log = logging.getLogger(__name__)

LIBRARY = "libnvidia-ml.so.1"  # what pynvml itself loads on Linux


class Nvml:
    """An initialised NVML session. ``Nvml.open`` returns None where there is no NVML."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.devices: list[Device] = []

    @classmethod
    def open(cls, library: str | None = None) -> Nvml | None:
        try:
            lib = ctypes.CDLL(library or LIBRARY)
        except OSError as exc:
            log.info("no NVIDIA GPUs: NVML is not available (%s)", _describe(exc))
            return None
        import pynvml

        try:
            if pynvml.nvmlLib is None:
                pynvml.nvmlLib = lib
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            log.info("no NVIDIA GPUs: NVML is not available (%s)", _describe(exc))
            return None
        nvml = cls()
        nvml.devices = nvml._read_devices()
        return nvml

    def close(self) -> None:
        import pynvml

        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def refresh(self) -> list[Device]:
        """Read the devices again (on re-registration)."""
        with self._lock:
            self.devices = self._read_devices()
        return self.devices

    def _read_devices(self) -> list[Device]:
        import pynvml

        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.warning("NVML cannot count GPUs (%s): reporting none", _describe(exc))
            return []
        driver = _read(pynvml.nvmlSystemGetDriverVersion) or ""
        devices: list[Device] = []
        for i in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            except pynvml.NVMLError as exc:
                log.warning("NVML cannot open GPU %d (%s): skipping it", i, _describe(exc))
                continue
            name = _read(pynvml.nvmlDeviceGetName, handle) or ""
            mig = _read(pynvml.nvmlDeviceGetMigMode, handle)
            if mig and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                devices.extend(self._mig_devices(handle, name, driver, len(devices)))
                continue
            devices.append(
                Device(
                    GpuInfo(
                        index=len(devices),
                        name=name,
                        memory_total_mb=_memory_mb(handle),
                        driver_version=driver,
                        compute_capability=_capability(handle),
                    ),
                    visible=str(i),
                    handle=handle,
                    minor=_read(pynvml.nvmlDeviceGetMinorNumber, handle),
                    instance=handle,
                    board=handle,
                )
            )
        return devices

    def _mig_devices(self, parent: Any, name: str, driver: str, first: int) -> list[Device]:
        import pynvml

        found: list[Device] = []
        for m in range(_read(pynvml.nvmlDeviceGetMaxMigDeviceCount, parent) or 0):
            handle = _read(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, parent, m)
            uuid = handle is not None and _read(pynvml.nvmlDeviceGetUUID, handle)
            if not uuid:
                continue
            found.append(
                Device(
                    GpuInfo(
                        index=first + len(found),
                        name=f"{name} MIG {m}",
                        memory_total_mb=_memory_mb(handle),
                        driver_version=driver,
                        compute_capability=_capability(parent),
                    ),
                    visible=str(uuid),
                    handle=None,  # no utilisation for MIG devices
                    minor=_read(pynvml.nvmlDeviceGetMinorNumber, parent),
                    instance=handle,
                    board=parent,
                )
            )
        return found

    # --- readings (None when unreadable) ----------------------------------------------------

    def utilization(self, device: Device) -> float | None:
        import pynvml

        if device.handle is None:
            return None
        rates = _read(pynvml.nvmlDeviceGetUtilizationRates, device.handle)
        return float(rates.gpu) if rates is not None else None

    def process_utilization(
        self, device: Device, since_us: int
    ) -> list[tuple[int, float, int]] | None:
        """(pid, SM utilisation %, timestamp µs) samples newer than ``since_us``; [] when no
        process used the GPU meanwhile; None when unreadable."""
        import pynvml

        if device.handle is None:
            return None
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(device.handle, since_us)
        except pynvml.NVMLError as exc:
            if isinstance(exc, pynvml.NVMLError_NotFound):
                return []
            return None
        return [(int(s.pid), float(s.smUtil), int(s.timeStamp)) for s in samples]

    def processes(self, device: Device, since_us: int) -> dict[int, bool] | None:
        """The pids that use ``device`` now, each with whether it computes on it: its compute
        processes (True: they hold its memory), and (False) those with utilisation samples
        newer than ``since_us`` (µs of the wall clock: a graphics process, such as a browser's
        window, counts only while it draws); None when unreadable."""
        import pynvml

        if device.instance is None:
            return None
        try:
            running = pynvml.nvmlDeviceGetComputeRunningProcesses(device.instance)
        except pynvml.NVMLError:
            return None
        samples = self.process_utilization(device, since_us)
        found = {int(pid): False for pid, sm, ts in samples or () if sm > 0 and ts > since_us}
        found.update((int(p.pid), True) for p in running)
        return found

    def temperature(self, device: Device) -> float | None:
        """The GPU's core temperature in °C (a MIG device: its GPU's)."""
        import pynvml

        if device.board is None:
            return None
        value = _read(pynvml.nvmlDeviceGetTemperature, device.board, pynvml.NVML_TEMPERATURE_GPU)
        return float(value) if value is not None else None

    def power_limit(self, device: Device) -> PowerLimit | None:
        """The GPU's power limit now, its default and the range it may be set in (mW)."""
        import pynvml

        board = device.board
        if board is None:
            return None
        now = _read(pynvml.nvmlDeviceGetPowerManagementLimit, board)
        default = _read(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, board)
        bounds = _read(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, board)
        if now is None or default is None or not bounds:
            return None
        return PowerLimit(int(now), int(default), int(bounds[0]), int(bounds[1]))

    def set_power_limit(self, device: Device, milliwatts: int) -> str | None:
        """Set the GPU's power limit; None once set, else why not (not root, not supported)."""
        import pynvml

        if device.board is None:
            return "no NVML handle for the whole GPU"
        try:
            pynvml.nvmlDeviceSetPowerManagementLimit(device.board, milliwatts)
        except pynvml.NVMLError as exc:
            return _describe(exc)
        return None


def _read(fn: Any, *args: Any) -> Any:
    import pynvml

    try:
        value = fn(*args)
    except pynvml.NVMLError:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _memory_mb(handle: Any) -> int | None:
    import pynvml

    info = _read(pynvml.nvmlDeviceGetMemoryInfo, handle)
    return int(info.total) // (1024 * 1024) if info is not None else None


def _capability(handle: Any) -> str:
    import pynvml

    cc = _read(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    return f"{cc[0]}.{cc[1]}" if cc else ""


def _describe(exc: BaseException) -> str:
    try:
        return str(exc) or type(exc).__name__
    except Exception:  # pynvml's __str__ can itself call into a missing library
        return type(exc).__name__
