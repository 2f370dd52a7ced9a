"""ExecutionEvidence that holds up: CPU and GPU figures (through the real NVML binding against a
stand-in library), None never 0 when unmeasured, what the coordinator actually receives, and
GPU-aware slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest.mock import Mock

import pytest
from conftest import FakeNvml
from fakes import FakeClock
from harness import AgentProcess, CoordinatorServer, argv_job

from flashnode.attempt.guards.sampling import SamplingGuard
from flashnode.attempt.guards.supervisor import Supervisor
from flashnode.evidence.gpu import Nvml
from flashnode.evidence.sampler import Sampler

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
H200 = "devices 2\nname NVIDIA H200\nmemory_mb 143771\ndriver 550.54.15\ncc 9 0\nutil 0 30\nutil 1 70\n"


def test_busy_and_idle_tasks_give_honest_cpu_figures(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    # The busy task reports the CPU time it got itself: on a loaded machine that is less than a
    # whole core, and the agent's figures must agree with it, not with an ideal.
    busy = (
        "import time,json; t=time.time()\nwhile time.time()-t<3: pass\n"
        "json.dump({'cpu': time.process_time()}, open('metrics.json','w'))"
    )
    idle = "import time,json; time.sleep(3); json.dump({}, open('metrics.json','w'))"
    job = coordinator.submit(argv_job(["python3", "-c", busy]))
    coordinator.submit(argv_job(["python3", "-c", idle]))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
    assert agent.wait(60) == 0, agent.log
    busy_rec, idle_rec = agent.ledger()
    cores = os.cpu_count() or 1
    wall = busy_rec["evidence"]["wall_seconds"]
    reported = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))["cpu"]
    task_percent = busy_rec["task_usage"]["cpu_percent_mean"]
    assert abs(task_percent - reported / wall * 100) <= 10, (busy_rec, reported)
    # Host-wide covers at least the task's share of all cores (other programs add to it).
    host = busy_rec["evidence"]["cpu_percent_mean"]
    assert task_percent / cores - 10 <= host <= 100, busy_rec
    assert (
        idle_rec["task_usage"]["cpu_percent_mean"] is None
        or idle_rec["task_usage"]["cpu_percent_mean"] <= 5
    )
    assert 2.9 <= wall < 6


def test_sub_second_tasks_get_cpu_figures_within_what_the_machine_has(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    # Python's start-up is most of such a task's life; some spin briefly on two threads.
    short = (
        "import json, threading, time\n"
        "def spin(s):\n"
        "    t = time.time()\n"
        "    while time.time() - t < s: pass\n"
        "ts = [threading.Thread(target=spin, args=({n} * 0.02,)) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "json.dump({{}}, open('metrics.json', 'w'))"
    )
    quick = "echo '{{}}' > metrics.json"
    jobs = [
        coordinator.submit(argv_job(["python3", "-c", short], params=[{"n": n} for n in range(5)])),
        coordinator.submit(argv_job(["sh", "-c", quick], params=[{"n": n} for n in range(5)])),
    ]
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "10", env=FAST)
    assert agent.wait(120) == 0, agent.log
    for job in jobs:
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashnode",
            "history",
            "--json",
            "--state-dir",
            str(agent.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(records) == 10, done.stdout + done.stderr
    most = 100.0 * (os.cpu_count() or 1)
    for r in records:
        assert r["evidence"]["wall_seconds"] < 1.0, r
        cpu = r["task_usage"]["cpu_percent_mean"]
        assert cpu is None or 0 <= cpu <= most, r  # never 310 % or 4.62e+03 % on two cores
    table = subprocess.run(
        [sys.executable, "-m", "flashnode", "history", "--state-dir", str(agent.state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "e+" not in table, table


def test_task_cpu_figure_is_bounded_and_null_when_too_short_to_tell() -> None:
    from flashnode.evidence.sampler import MIN_WALL_S, task_cpu_percent

    assert task_cpu_percent(0.5, 1.0, 2) == 50.0
    assert task_cpu_percent(0.0, 1.0, 2) == 0.0  # measured zero, not "not measured"
    assert task_cpu_percent(9.0, 1.0, 2) == 200.0  # a counter's overshoot stays within the cores
    assert task_cpu_percent(0.2, MIN_WALL_S / 2, 2) is None
    assert task_cpu_percent(None, 1.0, 2) is None
    assert task_cpu_percent(-0.1, 1.0, 2) is None


def test_the_live_cpu_figure_stays_within_what_the_machine_has() -> None:
    """The live view's CPU figure (since the last sample) never shows more than the machine's
    cores: here the clock moves far less than the CPU this process burns between samples."""
    clock = FakeClock()
    sampler = Sampler(clock, Pids({os.getpid()}), cores=1)
    sampler.sample()
    assert sampler.live["cpu_percent"] is None  # no figure before a second sample
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    clock.now += 0.02  # the CPU burnt in 0.1 s of it would be 500 %
    sampler.sample()
    assert sampler.live["cpu_percent"] == 100.0
    assert isinstance(sampler.live["memory_bytes"], int) and sampler.live["memory_bytes"] > 0


def test_history_shows_a_figure_past_the_machines_cores_as_not_measured(tmp_path: Path) -> None:
    """Ledger lines an older agent wrote (CPU over no wall time) are not shown as figures."""
    from click.testing import CliRunner

    from flashnode.cli.main import main

    lines = [
        {"job_id": "j", "task_id": f"t{i}", "outcome": "committed", "task_usage": usage}
        for i, usage in enumerate(
            [{"cpu_percent_mean": 4620.0}, {"cpu_percent_mean": 97.25}, {"cpu_percent_mean": 0.4}]
        )
    ]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = CliRunner().invoke(main, ["history", "--state-dir", str(tmp_path)]).output
    header, *rows = out.splitlines()
    assert header.startswith("ended (")
    end = header.index(" cpu") + 4  # the column's figures end under the header's end
    assert [row[:end].split()[-1] for row in rows] == ["-", "97.2%", "0.4%"], out


def test_without_nvml_the_node_reports_no_gpus_and_null_not_zero(
    recording_coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = recording_coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    agent = start_agent(recording_coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    [registration] = recording_coordinator.recorded("/nodes/register")
    assert registration["capabilities"]["gpus"] == []
    [complete] = recording_coordinator.recorded("/complete")
    evidence = complete["evidence"]
    assert evidence["gpu_util_percent_mean"] is None and evidence["image_digest"] == ""
    assert evidence["exit_code"] == 0 and evidence["wall_seconds"] > 0
    assert "no NVIDIA GPUs" in agent.log


# --- through the real binding, in this process ---------------------------------------------


class Pids:
    def __init__(self, pids: set[int]) -> None:
        self._pids = pids

    def pids(self) -> set[int]:
        return self._pids


def test_inventory_and_means_through_the_real_binding(
    fake_nvml: FakeNvml, drop_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (drop_dir / "pids").write_text("4242\n")
    env = fake_nvml.script(H200 + f"procfile 0 {drop_dir / 'pids'} 55\n")
    monkeypatch.setenv("FAKE_NVML_CONFIG", env["FAKE_NVML_CONFIG"])
    nvml = Nvml.open(env["FLASHNODE_NVML_LIBRARY"])
    assert nvml is not None
    infos = [d.info for d in nvml.devices]
    assert [
        (i.index, i.name, i.memory_total_mb, i.driver_version, i.compute_capability) for i in infos
    ] == [
        (0, "NVIDIA H200", 143771, "550.54.15", "9.0"),
        (1, "NVIDIA H200", 143771, "550.54.15", "9.0"),
    ]
    sampler = Sampler(FakeClock(), Pids({4242}), nvml, nvml.devices, [nvml.devices[0]])
    for _ in range(3):
        sampler.sample()
    assert sampler.finish() == (50.0, 55.0)
    # A process that is not the task's is not counted.
    other = Sampler(FakeClock(), Pids({1}), nvml, nvml.devices, [nvml.devices[0]])
    assert other.finish() == (50.0, 0.0)
    nvml.close()


def test_a_task_is_quiet_only_idle_on_the_cpu_and_holding_no_gpu(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sleeping task (its process here: one that burns nothing between two readings) may be
    read less often; not before it was measured twice, not while it uses the CPU, never while
    the sampler reads a GPU."""
    clock = FakeClock()
    sleeping = Sampler(clock, Pids({os.getpid()}), cores=1)
    sleeping.sample()
    assert not sleeping.quiet()  # not measured yet
    clock.now += 3600.0  # what this process burns meanwhile is under 1 % of an hour
    sleeping.sample()
    assert sleeping.quiet()
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    clock.now += 1.0
    sleeping.sample()
    assert not sleeping.quiet()  # 10 % of a core
    env = fake_nvml.script(H200)
    monkeypatch.setenv("FAKE_NVML_CONFIG", env["FAKE_NVML_CONFIG"])
    nvml = Nvml.open(env["FLASHNODE_NVML_LIBRARY"])
    assert nvml is not None
    on_gpu = Sampler(clock, Pids({os.getpid()}), nvml, nvml.devices, [nvml.devices[0]])
    for _ in range(2):
        clock.now += 3600.0
        on_gpu.sample()
    assert not on_gpu.quiet()
    nvml.close()


def test_an_nvml_error_mid_run_gives_none_not_a_crash(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = fake_nvml.script(H200 + "fail_after 4\n")
    monkeypatch.setenv("FAKE_NVML_CONFIG", env["FAKE_NVML_CONFIG"])
    nvml = Nvml.open(env["FLASHNODE_NVML_LIBRARY"])
    assert nvml is not None
    sampler = Sampler(FakeClock(), Pids(set()), nvml, nvml.devices, [nvml.devices[1]])
    for _ in range(4):
        sampler.sample()
    assert sampler.finish() == (None, None)
    nvml.close()


def test_the_sampler_reads_at_its_interval_beside_the_task_until_it_ends(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = fake_nvml.script(H200)
    monkeypatch.setenv("FAKE_NVML_CONFIG", env["FAKE_NVML_CONFIG"])
    nvml = Nvml.open(env["FLASHNODE_NVML_LIBRARY"])
    assert nvml is not None
    clock = FakeClock()
    sampler = Sampler(clock, Pids(set()), nvml, nvml.devices, [])

    class TenSeconds:  # a task that runs 10 s of the fake clock
        def __init__(self) -> None:
            self.until = clock.now + 10.0

        def exited(self) -> bool:
            return clock.now >= self.until

    guard = SamplingGuard(sampler.sample, 1.0, clock.now)
    pauses = Mock()
    Supervisor(TenSeconds(), [guard], clock, threading.Event(), pauses, 0.0).run()  # type: ignore[arg-type]
    assert len(sampler.host_gpu.values) == 9  # at 1 s ... 9 s: at 10 s it has ended
    assert sampler.finish()[0] is not None and len(sampler.host_gpu.values) == 9
    nvml.close()


# --- end to end with stand-in GPUs ---------------------------------------------------------

GPU_TASK = (
    "import json, os, sys, time\n"
    "open(sys.argv[2], 'a').write(f'{os.getpid()}\\n')\n"
    "t0 = time.time(); time.sleep(3)\n"
    "json.dump({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), 'start': t0, 'end': time.time()}, open(sys.argv[1], 'w'))\n"
)


def test_two_slots_run_two_gpu_tasks_at_once_on_different_gpus_and_a_third_waits(
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: FakeNvml,
    drop_dir: Path,
) -> None:
    pids = drop_dir / "gpu-pids"
    pids.touch()
    pids.chmod(0o666)
    env = fake_nvml.script(H200 + f"procfile 0 {pids} 40\nprocfile 1 {pids} 40\n")
    spec = argv_job(
        ["python3", "-c", GPU_TASK, "/work/out/metrics.json", str(pids)], params=[{}, {}, {}]
    )
    spec["spec"]["resources"] = {"gpuPerTask": 1}
    job = recording_coordinator.submit(spec)
    agent = start_agent(
        recording_coordinator.url,
        *TRUSTED,
        "--max-tasks",
        "3",
        "--slots",
        "auto",
        env={**FAST, **env},
    )
    assert agent.wait(90) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    runs = [
        json.loads(recording_coordinator.artifact(f"jobs/{job}/task-00{i}/metrics.json"))
        for i in range(3)
    ]
    first, second, third = sorted(runs, key=lambda r: r["start"])
    assert first["start"] < second["end"] and second["start"] < first["end"]  # ran at once
    assert {first["cvd"], second["cvd"]} == {"0", "1"}
    assert third["start"] >= min(first["end"], second["end"]) - 0.05  # waited for a free slot
    [registration] = recording_coordinator.recorded("/nodes/register")
    assert [g["name"] for g in registration["capabilities"]["gpus"]] == ["NVIDIA H200"] * 2
    for complete in recording_coordinator.recorded("/complete"):
        assert complete["evidence"]["gpu_util_percent_mean"] == 50.0  # host-wide: (30 + 70) / 2
    for record in agent.ledger():
        assert record["task_usage"]["gpu_util_percent_mean"] == 40.0
        assert len(record["gpus"]) == 1
