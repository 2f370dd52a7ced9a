"""Owner controls on the real machine: suspending a task's process tree (SIGSTOP, cgroup freezer)
and the machine-wide CPU cap as a cgroup quota that a reload changes live."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import wait_for

from flashnode.config.settings import Settings
from flashnode.evidence.gpupool import GpuPool
from flashnode.runners.base import RunnerEnv
from flashnode.runners.plan import TaskPlan
from flashnode.runners.trusted import TrustedRunner
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.cgroups import AttemptCgroup, Hierarchy
from flashnode.sandbox.cgroups.files import CFS_PERIOD_US
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.task import TaskProcess
from flashnode.sandbox.workspace import Workspace

# A task that prints, and keeps a detached grandchild (its own session) busy with light work: a
# little CPU each 20 ms, never a burner.
TASK = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            sum(range(20000)); time.sleep(0.02)
    os._exit(0)
n = 0
while True:
    n += 1; print("tick", n, flush=True); time.sleep(0.05)
"""


def start(tmp_path: Path, cgroup: AttemptCgroup | None = None) -> TaskProcess:
    env = {"PATH": SYSTEM_PATH, procs.OWNER_ENV: procs.new_token()}
    return TaskProcess(
        [sys.executable, "-c", TASK],
        env,
        cwd=tmp_path,
        stdout=tmp_path / "stdout.txt",
        stderr=tmp_path / "stderr.txt",
        log_max_bytes=1 << 20,
        on_exit=lambda: None,
        cgroup=cgroup,
    )


def states(proc: TaskProcess) -> dict[int, str]:
    found = {}
    for pid in proc.members():
        with open(f"/proc/{pid}/stat") as fh:
            found[pid] = fh.read().rsplit(")", 1)[1].split()[0]
    return found


def unchanged(path: Path, window: float) -> bool:
    before = path.stat().st_size
    time.sleep(window)  # a measurement window
    return path.stat().st_size == before


def test_sigstop_suspends_the_whole_tree_detached_children_included(tmp_path: Path) -> None:
    proc = start(tmp_path)
    stdout = tmp_path / "stdout.txt"
    try:
        members = wait_for(
            "the detached grandchild", lambda: len(states(proc)) >= 2 and states(proc)
        )
        assert len(members) == 2  # the main process and its grandchild, in another session
        wait_for("a printed line", lambda: "tick" in proc.last_line())
        proc.suspend()
        assert set(states(proc).values()) == {"T"}, states(proc)
        ticks = {pid: procs.cpu_ticks(pid) for pid in members}
        # What it printed before it stopped reaches the file through its supervisor's pipe.
        wait_for("its pipe drained into the file", lambda: unchanged(stdout, 0.1))
        printed = stdout.stat().st_size
        time.sleep(0.5)  # a measurement window, not a synchronisation
        assert stdout.stat().st_size == printed
        assert {pid: procs.cpu_ticks(pid) for pid in members} == ticks
        proc.resume()
        assert "T" not in set(states(proc).values())
        wait_for("output again", lambda: stdout.stat().st_size > printed, timeout=5)
        # Suspended again, then terminated: the stopped tree still goes at once.
        proc.suspend()
        t0 = time.monotonic()
        proc.terminate(5.0)
        assert time.monotonic() - t0 < 3.0
        assert not list(proc.members()) and proc.exited.is_set()
    finally:
        proc.kill()
        proc.close()


@pytest.fixture
def hierarchy() -> Iterator[Hierarchy]:
    """This host's attempt cgroups, under a parent of this test's own (so that a CPU cap set
    here never touches another agent's tasks on a shared machine)."""
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    found, why = cgroups.detect()
    if found is None:
        pytest.skip(f"no cgroups here: {why}")
    name = f"flashnode-test-{secrets.token_hex(3)}"
    bases = {k: v.parent / name for k, v in found.bases.items()}
    for base in bases.values():
        base.mkdir()
        if found.version == 2:
            (base / "cgroup.subtree_control").write_text("+memory +pids +cpu")
    yield Hierarchy(found.version, bases)
    for base in bases.values():
        for child in base.iterdir():
            if child.is_dir():
                AttemptCgroup(found.version, {"x": child}).remove()
        base.rmdir()


def test_the_freezer_stops_the_cgroups_cpu_use_and_thaws_it(
    tmp_path: Path, hierarchy: Hierarchy
) -> None:
    cgroup = hierarchy.create(f"freeze-{secrets.token_hex(3)}", Limits(pids=64))
    if not cgroup.can_freeze:
        cgroup.remove()
        pytest.skip("this host's cgroups have no freezer")
    proc = start(tmp_path, cgroup)
    try:
        wait_for("the task's cpu use", lambda: (cgroup.cpu_seconds() or 0) > 0.02, timeout=20)
        proc.suspend()
        assert cgroup.frozen()
        before = cgroup.cpu_seconds()
        time.sleep(1.0)  # a measurement window, not a synchronisation
        assert cgroup.cpu_seconds() == before  # frozen: not one more nanosecond
        proc.resume()
        assert not cgroup.frozen()
        wait_for("cpu use again", lambda: (cgroup.cpu_seconds() or 0) > (before or 0), timeout=5)
        proc.suspend()  # frozen, then terminated: a frozen v1 task dies only once thawed
        t0 = time.monotonic()
        proc.terminate(5.0)
        assert time.monotonic() - t0 < 3.0 and not cgroup.pids()
    finally:
        proc.kill()
        proc.close()
        cgroup.remove()


def quota(path: Path, version: int) -> float | None:
    """CPUs of a cgroup's quota, None for none."""
    if version == 2:
        value = (path / "cpu.max").read_text().split()[0]
        return None if value == "max" else int(value) / CFS_PERIOD_US
    value = (path / "cpu.cfs_quota_us").read_text().strip()
    return None if int(value) < 0 else int(value) / CFS_PERIOD_US


def test_the_cpu_cap_is_the_tasks_parent_quota_and_a_reload_changes_it_live(
    tmp_path: Path, hierarchy: Hierarchy
) -> None:
    cores = os.cpu_count() or 1
    base = Settings(
        coordinator="http://127.0.0.1:1", runner="trusted", pools=("p",), state_dir=tmp_path
    )
    runner = TrustedRunner(
        base.model_copy(update={"task_cpu_percent": 100.0}),
        RunnerEnv("node-1", GpuPool()),
        None,
        hierarchy,
        sandbox=False,
    )
    runner.reconfigure(runner.settings)
    cpu = hierarchy.bases.get("cpu", hierarchy.bases.get("unified"))
    assert cpu is not None
    assert quota(cpu, hierarchy.version) == pytest.approx(cores)
    ws = Workspace.create(tmp_path / "attempts", "lease-cap")
    own = cores * 0.75  # the task's own limit, below the cap
    handle = runner.start(
        TaskPlan(
            lease_id="lease-cap",
            slot=0,
            workspace=ws,
            image="",
            argv=("sleep", "60"),
            env={},
            cwd=f"{ws.root}/out",
            views=(),
            datasets=None,
            environment=None,
            module_spec=None,
            gpus=(),
            gpu_node=False,
            limits=Limits(cpus=own, pids=64),
            on_exit=lambda: None,
            record=lambda identity: None,
            stdout=ws.logs / "stdout.txt",
            stderr=ws.logs / "stderr.txt",
        )
    )
    try:
        task = cpu / "lease-cap"
        assert quota(task, hierarchy.version) == pytest.approx(own)
        # Down to a quarter of the machine: below the task's own limit, which must go down
        # first (cgroup v1 refuses a parent quota below a child's).
        runner.reconfigure(base.model_copy(update={"task_cpu_percent": 25.0}))
        assert quota(cpu, hierarchy.version) == pytest.approx(cores / 4)
        assert quota(task, hierarchy.version) == pytest.approx(cores / 4)
        # No cap: the parent has no quota and the task is back at its own limit.
        runner.reconfigure(base)
        assert quota(cpu, hierarchy.version) is None
        assert quota(task, hierarchy.version) == pytest.approx(own)
    finally:
        handle.terminate(0.0)
        handle.result()
        runner.close()  # the slot's turnover (the cgroup's removal) runs off the attempt's way
    assert not task.exists()
    assert runner._task_cpus == {}
