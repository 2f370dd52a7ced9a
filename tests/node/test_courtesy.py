"""The owner's courtesy, under a fake clock: a GPU the owner uses pauses its own tasks only, runs
them again after it stayed free, stops them when the use lasts; heat holds without flapping;
the watch tells the owner's processes from the tasks' and the ignored programs; the power limit
follows the GPUs held and is set back after a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeNvml
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease
from harness import wait_for

from flashnode.attempt import Attempt, Outcome
from flashnode.attempt.record import State
from flashnode.coordinator.messages import GpuInfo
from flashnode.errors import Stopped
from flashnode.evidence.gpu import Nvml
from flashnode.evidence.gpupool import Device, GpuPool, PowerLimit
from flashnode.evidence.sensors import process_name
from flashnode.node.courtesy.power import RECORD, PowerCap
from flashnode.node.courtesy.rules import Courtesy, CourtesyRules, GpuSeen
from flashnode.node.courtesy.watch import FAST_S, SLOW_S, CourtesyWatch, Readers
from flashnode.owner.status import describe_facts

RULES = CourtesyRules(stop_seconds=300, resume_seconds=30, gpu_limit_c=85, cpu_limit_c=95)


def seen(
    label: str, others: dict[int, str] | None = None, celsius: float = 50, computing: bool = True
) -> GpuSeen:
    return GpuSeen(label, others if others is not None else {}, celsius, computing and bool(others))


def test_the_owners_process_pauses_only_that_gpus_tasks_and_they_run_again_after_it_stayed_free() -> (
    None
):
    clock = FakeClock()
    c = Courtesy(RULES, clock)
    v = c.evaluate({"0": seen("GPU 0", {77: "blender"}), "1": seen("GPU 1")}, None)
    assert v.owner_reason(["0"]) == "the owner uses GPU 0: blender (pid 77)"
    assert v.owner_reason(["1"]) is None and set(v.blocked) == {"0"}
    clock.now += 10
    v = c.evaluate({"0": seen("GPU 0"), "1": seen("GPU 1")}, None)  # the owner's use ended
    assert v.owner_reason(["0"]) is not None and "0" in v.blocked  # not free long enough yet
    clock.now += 29
    assert c.evaluate({"0": seen("GPU 0"), "1": seen("GPU 1")}, None).owner_reason(["0"])
    clock.now += 1
    v = c.evaluate({"0": seen("GPU 0"), "1": seen("GPU 1")}, None)
    assert v.owner_reason(["0"]) is None and not v.blocked and not v.stop


def test_the_owners_use_lasting_past_the_stop_delay_stops_its_tasks_and_a_short_break_does_not_reset_it() -> (
    None
):
    clock = FakeClock()
    c = Courtesy(RULES, clock)
    owner = {"0": seen("GPU 0", {77: "game"})}
    c.evaluate(owner, None)
    clock.now += 200
    c.evaluate({"0": seen("GPU 0")}, None)  # a break of 20 s: shorter than the resume delay
    clock.now += 20
    assert not c.evaluate(owner, None).stop
    clock.now += 80  # 300 s since the owner's use began
    v = c.evaluate(owner, None)
    assert "stopped to free the GPU's memory" in (v.stop_reason(["0"]) or "")
    assert v.stop_reason(["1"]) is None
    clock.now += 1
    v = c.evaluate({"0": seen("GPU 0")}, None)  # the owner left: the task waits, never stops
    assert v.owner_reason(["0"]) is not None and not v.stop


def test_a_window_that_draws_on_the_gpu_pauses_its_tasks_but_never_stops_them() -> None:
    clock = FakeClock()
    c = Courtesy(RULES, clock)
    browser = {"0": seen("GPU 0", {55: "firefox"}, computing=False)}
    c.evaluate(browser, None)
    clock.now += 3600
    v = c.evaluate(browser, None)
    assert v.owner_reason(["0"]) == "the owner uses GPU 0: firefox (pid 55)" and not v.stop


def test_a_hot_gpu_pauses_its_tasks_until_well_below_the_limit_and_never_flaps() -> None:
    clock = FakeClock()
    c = Courtesy(RULES, clock)

    def hot(celsius: float) -> bool:
        clock.now += 1  # a reading a second
        return (
            c.evaluate({"1": seen("GPU 1", celsius=celsius)}, None).heat_reason(["1"]) is not None
        )

    assert [hot(t) for t in (84, 84.9)] == [False, False]
    assert [hot(t) for t in (95, 80)] == [False, False]  # one spike is not heat
    assert [hot(t) for t in (95, 95)] == [False, True]
    # Hovering at the limit keeps the pause: no flapping.
    assert all(hot(t) for t in (86, 84, 85.5, 80, 76, 75))
    # Below the limit less 10 °C, but at the limit 4 s ago: a fast fall does not flap it.
    assert hot(74)
    clock.now += 5
    assert not hot(74)
    assert [hot(t) for t in (80, 84, 85, 85, 84)] == [False, False, False, True, True]
    clock.now -= 1
    assert "GPU 1 at 95 °C" in (
        c.evaluate({"1": seen("GPU 1", celsius=95)}, None).heat_reason(["1"]) or ""
    )


def test_a_hot_cpu_pauses_every_task_and_unreadable_readings_never_hold() -> None:
    c = Courtesy(RULES, FakeClock())
    c.evaluate({"0": seen("GPU 0")}, 97.0)
    v = c.evaluate({"0": seen("GPU 0")}, 97.0)
    assert v.heat_reason([]) is not None and v.heat_reason(["0"]) is not None
    clock = FakeClock()
    c = Courtesy(RULES, clock)
    v = c.evaluate({"0": GpuSeen("GPU 0", None, None)}, None)
    assert v.heat_reason(["0"]) is None and not v.blocked and v.cpu_hot is None
    c.evaluate({}, 97.0)
    assert c.evaluate({}, 97.0).cpu_hot is not None
    clock.now += 59
    assert c.evaluate({}, None).cpu_hot is not None  # hot until read otherwise, a minute at most
    clock.now += 1
    assert c.evaluate({}, None).cpu_hot is None


def test_turned_off_the_courtesy_holds_nothing() -> None:
    rules = CourtesyRules(gpu_yield=False, gpu_limit_c=None, cpu_limit_c=None)
    v = Courtesy(rules, FakeClock()).evaluate({"0": seen("GPU 0", {77: "game"}, 120)}, 130)
    assert not v.blocked and v.cpu_hot is None


# --- the watch: whose process, applied to the attempts ---------------------------------------


def device(index: int) -> Device:
    handle = object()  # its NVML handle: the whole GPU (no MIG)
    info = GpuInfo(index=index, name="Stand-in")
    return Device(info, visible=str(index), instance=handle, board=handle)


@dataclass
class FakeHandle:
    ours: set[int]
    asked: int = 0

    def pids(self) -> set[int]:
        self.asked += 1
        return self.ours


@dataclass
class FakeRecord:
    state: State = State.RUNNING


@dataclass
class FakeAttempt:
    devices: list[Device]
    handle: FakeHandle
    record: FakeRecord = field(default_factory=FakeRecord)
    suspended: dict[str, str] = field(default_factory=dict)
    cancelled: list[Any] = field(default_factory=list)
    result: Any = None  # how its task ended, once it has

    def request_suspension(self, reason: str | None, source: str = "owner") -> None:
        if reason is None:
            self.suspended.pop(source, None)
        else:
            self.suspended[source] = reason

    def cancel(self, ending: Any, grace: float) -> None:
        self.cancelled.append(ending)


def make_watch(
    clock: FakeClock, on_gpu: dict[str, set[int]], names: dict[int, str], **rules: Any
) -> tuple[CourtesyWatch, GpuPool]:
    pool = GpuPool([device(0), device(1)])
    readers = Readers(
        processes=lambda d, since: dict.fromkeys(on_gpu.get(d.visible, set()), True),
        temperature=lambda d: 50.0,
        process_name=names.get,
    )
    return CourtesyWatch(CourtesyRules(**rules), readers, clock, pool), pool


def test_the_watch_pauses_for_the_owners_process_not_for_the_tasks_own_nor_an_ignored_program() -> (
    None
):
    clock = FakeClock()
    on_gpu = {"0": {10, 500}, "1": {11, 600}}  # 10, 11: the tasks'; 500: Xorg; 600: gone
    names = {10: "python3", 11: "python3", 500: "Xorg"}
    watch, pool = make_watch(clock, on_gpu, names, ignore=frozenset({"Xorg"}))
    a0 = FakeAttempt([pool.acquire(1)[0]], FakeHandle({10}))
    a1 = FakeAttempt([pool.acquire(1)[0]], FakeHandle({11}))
    attempts: list[Any] = [a0, a1]
    assert watch.tick(attempts, 5.0) == FAST_S
    assert not a0.suspended and not a1.suspended and not pool.blocked
    on_gpu["0"].add(900)
    names[900] = "owner-train.py"  # the comm of a process of the owner's
    watch.tick(attempts, 5.0)
    assert a0.suspended == {"gpu": "the owner uses GPU 0: owner-train.py (pid 900)"}
    assert not a1.suspended and set(pool.blocked) == {"0"}
    assert not watch.holds()  # GPU 1 is free: the node may still claim for it
    on_gpu["0"].discard(900)
    clock.now += 31
    watch.tick(attempts, 5.0)
    clock.now += 31
    watch.tick(attempts, 5.0)
    assert not a0.suspended and not pool.blocked


def test_the_tasks_pids_are_asked_again_only_for_a_pid_not_known_as_theirs() -> None:
    clock = FakeClock()
    on_gpu = {"0": {10, 500}}  # the task's, and the desktop's Xorg (ignored)
    names = {10: "python3", 500: "Xorg", 900: "game"}
    watch, pool = make_watch(clock, on_gpu, names, ignore=frozenset({"Xorg"}))
    handle = FakeHandle({10})
    attempts: list[Any] = [FakeAttempt([pool.acquire(1)[0]], handle)]
    for _ in range(4):
        watch.tick(attempts, 5.0)
        clock.now += FAST_S
    assert handle.asked == 1  # neither its own pid nor Xorg's asks again
    on_gpu["0"].add(900)  # a pid never seen: asked once more, then known as another's
    for _ in range(3):
        watch.tick(attempts, 5.0)
        clock.now += FAST_S
    assert handle.asked == 2
    clock.now += 5  # and again after a while: a pid may have changed hands
    watch.tick(attempts, 5.0)
    assert handle.asked == 3


def test_the_owners_long_use_stops_the_task_and_blocks_claims_until_the_gpu_is_free() -> None:
    clock = FakeClock()
    watch, pool = make_watch(clock, {"0": {10, 900}}, {10: "python3", 900: "game"}, stop_seconds=60)
    attempt = FakeAttempt([pool.acquire(1)[0]], FakeHandle({10}))
    watch.tick([attempt], 5.0)
    assert not attempt.cancelled
    clock.now += 60
    watch.tick([attempt], 5.0)
    [ending] = attempt.cancelled
    assert isinstance(ending, Stopped) and "the lease lapses" in str(ending)
    pool.release(attempt.devices)
    assert pool.free == 1  # GPU 0 stays the owner's
    with pytest.raises(Exception, match="1 of this node's are free"):
        pool.acquire(2)
    assert watch.tick([], 5.0) == SLOW_S


def test_every_gpu_the_owners_is_a_hold_on_claiming_with_its_reason() -> None:
    clock = FakeClock()
    watch, _ = make_watch(clock, {"0": {900}, "1": {901}}, {900: "game", 901: "game"})
    watch.tick([], 5.0)
    [hold] = watch.holds()
    assert hold.rule == "courtesy" and "GPU 0" in hold.reason and "GPU 1" in hold.reason


# --- the power limit ---------------------------------------------------------------------


class FakePower:
    def __init__(self) -> None:
        self.now = {"0": 300_000, "1": 250_000}
        self.calls: list[tuple[str, int]] = []

    def power_limit(self, d: Device) -> PowerLimit:
        return PowerLimit(self.now[d.visible], 350_000, 100_000, 400_000)

    def set_power_limit(self, d: Device, milliwatts: int) -> str | None:
        self.calls.append((d.visible, milliwatts))
        self.now[d.visible] = milliwatts
        return None


def test_the_power_limit_follows_the_gpus_held_and_the_owners_is_set_back(tmp_path: Path) -> None:
    gpu = FakePower()
    devices = [device(0), device(1)]
    cap = PowerCap(gpu, tmp_path, lambda: 50.0)
    cap.follow(devices, {"0"})
    assert gpu.now == {"0": 175_000, "1": 250_000}
    assert json.loads((tmp_path / RECORD).read_text()) == {"0": 300_000}
    cap.follow(devices, {"0"})
    assert len(gpu.calls) == 1  # once, not at every turn
    cap.follow(devices, set())
    assert gpu.now == {"0": 300_000, "1": 250_000} and not (tmp_path / RECORD).exists()


def test_after_a_crash_the_next_start_sets_the_owners_limit_back(tmp_path: Path) -> None:
    gpu = FakePower()
    devices = [device(0), device(1)]
    PowerCap(gpu, tmp_path, lambda: 10.0).follow(devices, {"0", "1"})  # then killed
    assert gpu.now == {"0": 100_000, "1": 100_000}  # the least the GPUs allow
    cap = PowerCap(gpu, tmp_path, lambda: None)  # the next start
    cap.restore_left(devices, held={"1"})  # a rejoined task runs on GPU 1
    assert gpu.now == {"0": 300_000, "1": 100_000}
    cap.follow(devices, set())  # that task ended
    assert gpu.now == {"0": 300_000, "1": 250_000} and not (tmp_path / RECORD).exists()


def test_a_power_record_that_is_not_the_agents_is_ignored(tmp_path: Path) -> None:
    (tmp_path / RECORD).write_text('{"0": "rm -rf /", "1": -5, "2": true}')
    gpu = FakePower()
    PowerCap(gpu, tmp_path, lambda: None).restore_left([device(0), device(1)], set())
    assert gpu.calls == []


def test_status_and_history_say_how_often_how_long_and_why_a_task_was_paused() -> None:
    pauses = {"count": 2, "seconds": 75, "list": [{"why": "a"}, {"why": "GPU 1 at 95 °C"}]}
    assert describe_facts({"pauses": pauses}) == "paused 2x 1m15s (last: GPU 1 at 95 °C)"


def test_a_gpus_processes_are_its_compute_processes_and_graphics_ones_only_while_they_draw(
    fake_nvml: FakeNvml, drop_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (drop_dir / "compute").write_text("4343\n")
    (drop_dir / "graphics").write_text("4242\n")  # a browser's window
    script = f"devices 1\nprocfile 0 {drop_dir / 'compute'} 0\n"
    env = fake_nvml.script(script + f"graphicsfile 0 {drop_dir / 'graphics'} 0\n")  # idle
    monkeypatch.setenv("FAKE_NVML_CONFIG", env["FAKE_NVML_CONFIG"])
    nvml = Nvml.open(env["FLASHNODE_NVML_LIBRARY"])
    assert nvml is not None
    [gpu] = nvml.devices
    assert nvml.processes(gpu, 0) == {4343: True}
    fake_nvml.script(script + f"graphicsfile 0 {drop_dir / 'graphics'} 30\n")  # it draws
    assert nvml.processes(gpu, 0) == {4343: True, 4242: False}
    (drop_dir / "compute").write_text("")
    assert nvml.processes(gpu, 0) == {4242: False}
    nvml.close()


class FailingPower(FakePower):
    def __init__(self) -> None:
        super().__init__()
        self.refuse = False

    def set_power_limit(self, d: Device, milliwatts: int) -> str | None:
        if self.refuse:
            return "Insufficient Permissions"
        return super().set_power_limit(d, milliwatts)


def test_a_power_limit_that_cannot_be_set_back_is_kept_and_tried_again(tmp_path: Path) -> None:
    gpu, devices = FailingPower(), [device(0)]
    percent = [50.0]
    cap = PowerCap(gpu, tmp_path, lambda: percent[0])
    cap.follow(devices, {"0"})
    gpu.refuse = True
    cap.follow(devices, set())  # the task ended; setting it back fails
    assert gpu.now["0"] == 175_000 and (tmp_path / RECORD).exists()
    gpu.refuse = False
    cap.follow(devices, set())
    assert gpu.now["0"] == 300_000 and not (tmp_path / RECORD).exists()
    # A reload to another cap that cannot be set keeps the owner's limit recorded.
    cap.follow(devices, {"0"})
    gpu.refuse, percent[0] = True, 80.0
    cap.follow(devices, {"0"})
    assert gpu.now["0"] == 175_000 and json.loads((tmp_path / RECORD).read_text()) == {"0": 300_000}
    gpu.refuse = False
    cap.follow(devices, set())
    assert gpu.now["0"] == 300_000


def test_a_mig_device_is_never_power_capped(tmp_path: Path) -> None:
    gpu = FakePower()
    parent = object()
    mig = Device(GpuInfo(index=0, name="MIG"), visible="MIG-1", instance=object(), board=parent)
    PowerCap(gpu, tmp_path, lambda: 50.0).follow([mig], {"MIG-1"})
    assert gpu.calls == [] and not (tmp_path / RECORD).exists()


def test_a_process_name_is_printable_and_a_zombie_is_no_ones_use() -> None:
    renamed = subprocess.Popen(
        [sys.executable, "-c", "open('/proc/self/comm', 'w').write('Xorg\\nFAKE'); input()"],
        stdin=subprocess.PIPE,
    )
    try:
        wait_for("its new name", lambda: (process_name(renamed.pid) or "").startswith("X"))
        assert process_name(renamed.pid) == "Xorg?FAKE"
    finally:
        renamed.communicate(b"\n")
    exited = subprocess.Popen(["true"])
    wait_for("a zombie", lambda: " Z " in Path(f"/proc/{exited.pid}/stat").read_text())
    assert process_name(exited.pid) is None
    exited.wait()
    assert process_name(exited.pid) is None


def test_the_tasks_pids_are_asked_once_a_turn_whatever_the_gpus_list() -> None:
    clock = FakeClock()
    on_gpu = {"0": {10, 900}, "1": {11, 901}}  # each GPU: a task's pid and one of the owner's
    watch, pool = make_watch(clock, on_gpu, {n: "p" for n in (10, 11, 900, 901)})
    a0, a1 = (FakeAttempt([pool.acquire(1)[0]], FakeHandle({pid})) for pid in (10, 11))
    for _ in range(4):
        watch.tick([a0, a1], 5.0)
        clock.now += FAST_S
    assert a0.handle.asked == a1.handle.asked == 1


class SilentHandle(FakeHandle):
    def pids(self) -> set[int]:
        self.asked += 1
        if self.asked > 1:
            raise OSError("the engine does not answer")
        return self.ours


def test_a_gpu_whose_tasks_pids_cannot_be_read_is_not_judged_meanwhile() -> None:
    clock = FakeClock()
    on_gpu = {"0": {10}}
    watch, pool = make_watch(clock, on_gpu, {10: "python3", 11: "python3"})
    attempt = FakeAttempt([pool.acquire(1)[0]], SilentHandle({10}))
    watch.tick([attempt], 5.0)
    on_gpu["0"].add(11)  # its new child, perhaps: its handle cannot say now
    for _ in range(3):
        clock.now += FAST_S
        watch.tick([attempt], 5.0)
    assert attempt.handle.asked == 4  # asked again each turn, never taken as the owner's
    assert "gpu" not in attempt.suspended


def test_a_power_limit_the_owner_sets_while_a_task_runs_is_theirs_to_keep(tmp_path: Path) -> None:
    gpu, devices = FakePower(), [device(0)]
    cap = PowerCap(gpu, tmp_path, lambda: 50.0)
    cap.follow(devices, {"0"})
    gpu.now["0"] = 175_400  # the driver rounds: still the cap
    cap.follow(devices, {"0"})
    assert gpu.calls == [("0", 175_000)]
    gpu.now["0"] = 200_000  # nvidia-smi -pl 200 by the owner
    for _ in range(3):
        cap.follow(devices, {"0"})
    cap.follow(devices, set())
    assert gpu.calls == [("0", 175_000)] and gpu.now["0"] == 200_000
    assert not (tmp_path / RECORD).exists()


def test_a_task_asking_for_a_gpu_the_owner_has_lapses_without_counting_against_the_node(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = replace(
        context(tmp_path, clock, coord, FakeRunner()), gpus=GpuPool([device(0), device(1)])
    )
    ctx.gpus.block({"0": "the owner uses GPU 0: game (pid 9)"})
    attempt = Attempt(ctx, lease(gpus=2))
    assert attempt.run() is Outcome.LAPSED
    assert attempt.node_fault is False  # the black-hole guard does not count it
    assert "the owner uses GPU 0" in (attempt.ended or ("", ""))[1]
    assert [c[1] for c in coord.calls if c[1] == "fail"] == []
