"""The owner's courtesy end to end: a real agent (trusted runner) on two stand-in GPUs (the real
NVML binding on tests/fake_nvml.c), real tasks and a real coordinator. A process of the owner's
on a GPU pauses that GPU's task only and both commit once it ends; a long use stops the task, its
lease lapses and it resumes from its checkpoint; a hot GPU pauses its task without flapping; a
power limit holds while a task runs and the owner's comes back, after a SIGKILL too."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import FakeNvml
from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    pid_alive,
    run_flashnode,
    wait_for,
)
from seat import snapshot

TWO_GPUS = "devices 2\nname NVIDIA Stand-in\n"
FAST = {
    "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
    "FLASHNODE_KILL_GRACE_SECONDS": "1",
    "FLASHNODE_CHECKPOINT_SCAN_SECONDS": "0.5",
    "FLASHNODE_GPU_YIELD_RESUME_SECONDS": "1",
    "FLASHNODE_CPU_TEMPERATURE_LIMIT_C": "0",  # this machine's own heat is not the test's
}
TRUSTED = ("--runner", "trusted", "--pool", "team-a", "--slots", "auto")

# A task that does WORK seconds of CPU work in steps, checkpointing each step, and says its pid
# in the pid file of the GPU it was given (the stand-in lists those as that GPU's processes).
TASK = """
import json, os, sys, time
shared, work = sys.argv[1], float(sys.argv[2])
gpu = os.environ["CUDA_VISIBLE_DEVICES"]
with open(os.path.join(shared, "pids-" + gpu), "a") as f:
    f.write(f"{os.getpid()}\\n")
ckpt, resumed = os.environ["FLASHML_CHECKPOINT_DIR"], os.environ.get("FLASHML_RESUME")
step = int(open(os.path.join(resumed, "step")).read()) if resumed else 0
first = step
while step < work * 4:
    t = time.process_time()
    while time.process_time() - t < 0.25:
        pass
    step += 1
    tmp = os.path.join(ckpt, f".tmp-step-{step}")
    os.makedirs(tmp)
    open(os.path.join(tmp, "step"), "w").write(str(step))
    os.rename(tmp, os.path.join(ckpt, f"step-{step}"))
json.dump({"gpu": gpu, "from": first, "steps": step}, open("metrics.json", "w"))
"""


@pytest.fixture
def shared(drop_dir: Path) -> Path:
    for gpu in ("0", "1"):
        (drop_dir / f"pids-{gpu}").touch()
        (drop_dir / f"pids-{gpu}").chmod(0o666)
    return drop_dir


def nvml_script(shared: Path, extra: str = "") -> str:
    return TWO_GPUS + "".join(f"procfile {g} {shared / f'pids-{g}'} 60\n" for g in "01") + extra


def gpu_job(shared: Path, work: float, tasks: int = 2, **extra: object) -> dict[str, object]:
    spec = argv_job(
        ["python3", "-c", TASK, str(shared), str(work)],
        params=[{}] * tasks if tasks > 1 else None,
        checkpoint={"interval_seconds": 30},
        **extra,
    )
    spec["spec"]["resources"] = {"gpuPerTask": 1}  # type: ignore[index]
    return spec


def task_pid(shared: Path, gpu: str) -> int:
    return wait_for(f"the task on GPU {gpu}", lambda: _first_pid(shared / f"pids-{gpu}"))


def _first_pid(path: Path) -> int | None:
    words = path.read_text().split()
    return int(words[0]) if words else None


def cpu_ticks(pid: int) -> int:
    """Its CPU time so far in clock ticks (-1 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return -1
    return int(fields[11]) + int(fields[12])  # utime, stime


def still(pid: int, over: float = 0.4) -> bool:
    """The process used no CPU over ``over`` seconds (a measurement, not a synchronisation)."""
    before = cpu_ticks(pid)
    time.sleep(over)
    return cpu_ticks(pid) == before


@pytest.fixture
def owner(shared: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """Start a process of the owner's on a GPU (listed in its pid file); ended at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(gpu: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "600"])
        started.append(proc)
        with (shared / f"pids-{gpu}").open("a") as f:
            f.write(f"{proc.pid}\n")
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def leave(shared: Path, gpu: str, proc: subprocess.Popen[bytes]) -> None:
    """The owner's process ends (and is no longer listed on the GPU)."""
    proc.kill()
    proc.wait()
    path = shared / f"pids-{gpu}"
    path.write_text("".join(f"{p}\n" for p in path.read_text().split() if p != str(proc.pid)))


def two_tasks_at_work(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: FakeNvml,
    shared: Path,
) -> tuple[AgentProcess, str, int, int]:
    """An agent running two tasks, one on each GPU, both at work: (agent, job, their pids)."""
    env = fake_nvml.script(nvml_script(shared))
    job = coordinator.submit(gpu_job(shared, work=8))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env={**FAST, **env})
    zero, one = task_pid(shared, "0"), task_pid(shared, "1")
    wait_for("both tasks at work", lambda: cpu_ticks(zero) > 5 and cpu_ticks(one) > 5)
    return agent, job, zero, one


def by_gpu(agent: AgentProcess) -> dict[str, dict[str, object]]:
    return {str(r["gpus"][0]): r for r in agent.ledger()}


def test_the_owners_process_on_gpu_0_pauses_only_its_task_and_both_commit_once_it_ends(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: FakeNvml,
    shared: Path,
    owner: Callable[[str], subprocess.Popen[bytes]],
) -> None:
    agent, job, zero, one = two_tasks_at_work(coordinator, start_agent, fake_nvml, shared)
    game = owner("0")
    wait_for("GPU 0's task to stop using CPU", lambda: still(zero), timeout=3)
    assert not still(one, over=1.0)  # GPU 1's task runs on
    assert "courtesy: pausing the tasks on GPU 0: the owner uses GPU 0: sleep" in agent.log
    time.sleep(1.5)  # a measurement: the pause holds while the owner's process runs
    assert still(zero)
    live = {str(a["gpus"][0]): a for a in snapshot(agent).get("running") or []}
    assert live["0"]["suspend_reason"].startswith("the owner uses GPU 0: sleep (pid ")
    assert live["0"]["suspended_since"] is not None and live["1"]["suspended_since"] is None
    leave(shared, "0", game)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    lines = by_gpu(agent)
    assert lines["0"]["outcome"] == lines["1"]["outcome"] == "committed"
    pauses = lines["0"]["pauses"]
    assert isinstance(pauses, dict) and pauses["count"] == 1 and pauses["seconds"] >= 1.5
    [pause] = pauses["list"]
    assert pause["why"].startswith("the owner uses GPU 0: sleep (pid ")
    assert "pauses" not in lines["1"]
    shown = run_flashnode("history", "--state-dir", str(agent.state_dir)).stdout
    assert "paused 1x" in shown and "(last: the owner uses GPU 0: sleep" in shown
    # Its running time in the evidence leaves the pause out.
    evidence, timings = lines["0"]["evidence"], lines["0"]["timings"]
    assert isinstance(evidence, dict) and isinstance(timings, dict)
    ran = timings["execute.wait"] - timings["suspended"]
    assert evidence["wall_seconds"] == pytest.approx(ran, abs=0.5)


def test_the_owners_long_use_stops_the_task_frees_the_gpu_and_the_next_attempt_resumes(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: FakeNvml,
    shared: Path,
    owner: Callable[[str], subprocess.Popen[bytes]],
) -> None:
    env = fake_nvml.script(nvml_script(shared).replace("devices 2", "devices 1"))
    job = coordinator.submit(gpu_job(shared, work=6, tasks=1, max_attempts=1))
    agent = start_agent(
        coordinator.url,
        *TRUSTED,
        env={**FAST, **env, "FLASHNODE_GPU_YIELD_STOP_SECONDS": "2"},
    )
    pid = task_pid(shared, "0")
    wait_for("a checkpoint shipped", lambda: _shipped(coordinator, job))
    game = owner("0")
    entry = wait_for("the ledger line", lambda: agent.ledger() and agent.ledger()[-1], timeout=30)
    assert entry["outcome"] == "lapsed", entry
    assert (
        "the owner has used GPU 0" in entry["reason"]
        and "to free the GPU's memory" in (entry["reason"])
    )
    assert not pid_alive(pid)  # its memory on the GPU is free
    assert entry["checkpoint_step"] >= 1
    assert coordinator.job(job)["state"] not in ("FAILED", "SUCCEEDED")
    r = coordinator.http.post(f"/jobs/{job}/tasks/task-000/force-expire", json={"reason": "t"})
    assert r.status_code == 200, r.text
    time.sleep(1.0)  # a measurement: no claim for the GPU while the owner still uses it
    assert len(agent.ledger()) == 1 and "courtesy" in (agent.state_dir / "status.json").read_text()
    leave(shared, "0", game)
    # maxTaskAttempts 1: only a lapse that spent no failure lets the second attempt run.
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    first, second = agent.wait_ledger(2)
    assert (
        second["outcome"] == "committed" and second["resumed_from_step"] == first["checkpoint_step"]
    )
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report["from"] == first["checkpoint_step"] and report["steps"] == 24


def _shipped(coordinator: CoordinatorServer, job: str) -> bool:
    r = coordinator.http.get(f"/jobs/{job}/tasks/task-000/checkpoints/latest")
    return r.status_code == 200


def test_a_hot_gpu_pauses_its_task_without_flapping_and_it_runs_again_once_cool(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: FakeNvml,
    shared: Path,
) -> None:
    agent, job, zero, one = two_tasks_at_work(coordinator, start_agent, fake_nvml, shared)
    fake_nvml.script(nvml_script(shared, "temperature 1 95\n"))
    wait_for("GPU 1's task to pause", lambda: still(one), timeout=5)
    assert not still(zero, over=1.0)
    for celsius in (86, 84, 85, 80, 76):  # hovering at the limit, then cooling a little
        fake_nvml.script(nvml_script(shared, f"temperature 1 {celsius}\n"))
        assert still(one, over=0.6), celsius
    fake_nvml.script(nvml_script(shared, "temperature 1 60\n"))
    # Well below the limit, and 10 s after it was last at it.
    wait_for("GPU 1's task to run again", lambda: not still(one), timeout=15)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    lines = by_gpu(agent)
    pauses = lines["1"]["pauses"]
    assert isinstance(pauses, dict) and pauses["count"] == 1  # one pause: no flapping
    assert pauses["list"][0]["why"].startswith("GPU 1 at 95 °C (limit 85 °C")
    assert "pauses" not in lines["0"]
    assert agent.log.count("task suspended: GPU 1 at 95 °C") == 1


def powered(log: Path) -> list[tuple[str, int]]:
    if not log.exists():
        return []
    return [(d, int(mw)) for d, mw in (line.split() for line in log.read_text().splitlines())]


def test_a_power_limit_holds_while_a_task_runs_and_the_owners_comes_back_after_a_sigkill_too(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: FakeNvml,
    shared: Path,
) -> None:
    log = shared / "power.log"
    env = fake_nvml.script(
        nvml_script(shared, f"powerlog {log}\n").replace("devices 2", "devices 1")
    )
    env = {**FAST, **env, "FLASHNODE_GPU_POWER_LIMIT_PERCENT": "50"}
    job = coordinator.submit(gpu_job(shared, work=1, tasks=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=env)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    # 50 % of the default 350 W while the task ran; the owner's 300 W once it ended.
    assert powered(log) == [("0", 175_000), ("0", 300_000)]
    assert not (agent.state_dir / "gpu-power.json").exists()

    log.unlink()
    (shared / "pids-0").write_text("")
    job = coordinator.submit(gpu_job(shared, work=60, tasks=1))
    env["FLASHNODE_REATTACH_SECONDS"] = "0"  # nothing of the task outlives the agent
    crashed = start_agent(coordinator.url, *TRUSTED, env=env, name="crashed")
    wait_for("the power limit set", lambda: powered(log) == [("0", 175_000)])
    pid = task_pid(shared, "0")
    os.kill(crashed.proc.pid, 9)
    crashed.wait(10)
    wait_for("the task ended with its agent", lambda: not pid_alive(pid), timeout=15)
    assert powered(log) == [("0", 175_000)]  # the GPU is left capped: the agent was killed
    again = start_agent(
        coordinator.url, *TRUSTED, env=env, name="again", state_dir=crashed.state_dir
    )
    wait_for("the owner's limit set back", lambda: powered(log)[-1:] == [("0", 300_000)])
    assert "power limit back to the owner's 300 W" in again.log
    coordinator.http.post(f"/jobs/{job}/cancel", json={"reason": "test"})
