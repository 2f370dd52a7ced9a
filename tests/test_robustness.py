"""Never a crash, never a leak, never a wasted attempt: one test per way the agent was
seen to fail — hostile answers, runaway tasks, and the agent's own faults. Each ends in a clean
outcome with a reason; the agent keeps running (or stops cleanly) with nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import psutil
import pytest
from badcoord import BadCoordinator, answer, drip, huge, lease_answer, sequence
from conftest import TokenCoordinator
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease
from harness import (
    AgentProcess,
    CoordinatorServer,
    NotifySocket,
    argv_job,
    run_flashnode,
    shared_dir,
    wait_for,
)

from flashnode.attempt import Attempt, Outcome

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
API = "/v1alpha1"


@pytest.fixture
def bad() -> Iterator[BadCoordinator]:
    server = BadCoordinator()
    yield server
    server.close()


class PeakRss:
    """Samples a process's resident memory on a thread: its peak over the watch."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def growth(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


# --- hostile answers ---------------------------------------------------------------------------


def test_a_huge_error_answer_to_a_download_is_read_capped(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    bad.overrides[f"{API}/artifacts/shared/"] = huge(500, 300 << 20)
    bad.claims = [lease_answer(1, inputs={"data": "artifact://shared/data.csv"})]
    agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    agent.wait_log("registered as node")
    rss = PeakRss(agent.proc.pid)
    assert agent.wait(60) == 0, agent.log
    growth = rss.growth()
    [(lease_id, reason)] = bad.fails
    assert lease_id == "ls-000000000001" and "input 'data' could not be fetched" in reason
    assert growth < 64 << 20, f"agent RSS grew by {growth >> 20} MB"


def test_a_deeply_nested_claim_answer_is_refused_and_the_agent_goes_on(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    nested = b"[" * 100_000 + b"]" * 100_000  # 200 KB: past any JSON parser's recursion limit
    bad.claims = [answer(200, nested), lease_answer(1)]
    agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert "claim answer is not JSON" in agent.log and "Traceback" not in agent.log
    assert [c[0] for c in bad.completes] == ["ls-000000000001"]


def test_a_node_id_that_cannot_go_into_a_url_is_refused_and_registration_retried(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    bad.overrides[f"{API}/nodes/register"] = sequence(
        answer(200, {"node_id": "evil\nHost: elsewhere", "status": "registered"}),
        answer(200, {"node_id": "node-ok", "status": "registered"}),
    )
    bad.claims = [lease_answer(1)]
    agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert "register answer carries no usable node_id" in agent.log
    assert "registered as node node-ok" in agent.log and "Traceback" not in agent.log


class GrowingUploads(FakeCoordinator):
    """Appends to the file it is handed while it reads it: a file that grows mid-upload."""

    def upload(self, key: str, fh: BinaryIO, size: int) -> str:
        if key.endswith("notes.txt"):
            with open(f"/proc/self/fd/{fh.fileno()}", "ab") as again:
                again.write(b"more bytes")
        return super().upload(key, fh, size)


class WritesNotes(FakeRunner):
    def start(self, plan: Any) -> Any:
        (plan.workspace.out / "notes.txt").write_text("notes")
        return super().start(plan)


def test_a_file_that_grows_while_it_is_uploaded_fails_the_attempt(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = GrowingUploads(clock)
    outcome = Attempt(context(tmp_path, clock, coord, WritesNotes()), lease()).run()
    assert outcome is Outcome.FAILED
    [reason] = [c[2][1] for c in coord.calls if c[1] == "fail"]
    assert "out/notes.txt changed while it was read" in reason
    assert "complete" not in [c[1] for c in coord.calls]


class FillsTmp(FakeRunner):
    """A task that writes 2 MiB into its tmp/ and its outputs, and has exited before any watch
    could look."""

    def start(self, plan: Any) -> Any:
        (plan.workspace.tmp / "scratch.bin").write_bytes(os.urandom(2 << 20))
        (plan.workspace.out / "metrics.json").write_text("{}")
        return super().start(plan)


def test_a_task_that_exited_past_its_disk_cap_fails_with_the_reason(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, FillsTmp(), task_disk_bytes="1M")
    assert Attempt(ctx, lease()).run() is Outcome.FAILED
    [reason] = [c[2][1] for c in coord.calls if c[1] == "fail"]
    assert "the task's files grew past 1 MiB (task_disk_bytes" in reason, reason
    assert "complete" not in [c[1] for c in coord.calls]


# --- runaway tasks -------------------------------------------------------------------------------

FLOOD = r"""
import os, sys, time
chunk = b'x' * (1 << 20)
with open('flood.bin', 'wb') as f:
    for i in range(200):
        f.write(chunk); f.flush()
        print(i + 1, flush=True)
        time.sleep(0.02)
print('done', flush=True)
open('metrics.json', 'w').write('{}')
"""


def test_outputs_past_their_cap_stop_the_task_while_it_runs(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(["python3", "-c", FLOOD], max_attempts=1))
    env = {**FAST, "FLASHNODE_MAX_OUTPUT_TOTAL_BYTES": str(10 << 20)}
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=env)
    assert agent.wait(60) == 0, agent.log
    [failed] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert f"outputs grew past {10 << 20} bytes" in failed
    printed = coordinator.artifact(f"jobs/{job}/task-000/logs/stdout.txt").decode().split()
    assert "done" not in printed and int(printed[-1]) < 100, printed[-3:]


@pytest.mark.usefixtures("as_root")
def test_tasks_get_memory_and_cpu_limits_by_default(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    probe = r"""
import json
found = {}
for line in open('/proc/self/cgroup'):
    _, controllers, path = line.strip().split(':', 2)
    for c in controllers.split(','):
        found[c or 'unified'] = path
def read(*names):
    for base, name in names:
        try:
            return open(f'/sys/fs/cgroup/{base}{found.get(base.split("/")[0] or "unified", "")}/{name}').read().strip()
        except (OSError, KeyError):
            continue
    return None
json.dump({
    'memory': read(('memory', 'memory.limit_in_bytes'), ('', 'memory.max')),
    'cpu': read(('cpu', 'cpu.cfs_quota_us'), ('', 'cpu.max')),
}, open('metrics.json', 'w'))
"""
    job = coordinator.submit(argv_job(["python3", "-c", probe]))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    seen = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    total = psutil.virtual_memory().total
    memory = seen["memory"]
    if memory is None:
        pytest.skip("this host gives tasks no cgroup")
    assert memory != "max" and int(memory) <= total * 3 // 4, seen
    assert seen["cpu"] not in (None, "-1", "max") and not str(seen["cpu"]).startswith("max"), seen


def test_a_payload_cannot_set_the_gpu_visibility(tmp_path: Path) -> None:
    clock = FakeClock()
    for name in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "FLASHNODE_OWNER"):
        coord = FakeCoordinator(clock)
        runner = FakeRunner()
        outcome = Attempt(
            context(tmp_path / name, clock, coord, runner), lease(env={name: "all"})
        ).run()
        assert outcome is Outcome.FAILED and runner.started == []
        [reason] = [c[2][1] for c in coord.calls if c[1] == "fail"]
        assert f"payload env {name!r} is reserved for the agent" in reason


# --- the agent's own faults ----------------------------------------------------------------------


def test_a_revoked_token_holds_the_agent_until_a_fixed_token_lets_it_work_again(
    token_coordinator: TokenCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    tc = token_coordinator
    job = tc.server.submit(argv_job(["sh", "-c", "sleep 30; echo '{}' > metrics.json"]))
    agent = start_agent(tc.server.url, *TRUSTED, *tc.agent_args(), env={**FAST, **tc.agent_env()})
    wait_for("the task to run", lambda: tc.server.tasks(job)[0]["state"] == "LEASED")
    agent.wait_log("running (trusted runner")
    # The operator revokes this node's token: the coordinator comes back knowing another one.
    new_token = "tok-" + os.urandom(12).hex()
    tc.server.stop()
    tc.server.extra_env["FLASHML_NODE_TOKENS"] = f"node-x:{new_token}"
    tc.server.start()
    # The agent does not exit: it holds, claims nothing, and says why with the fix.
    held = wait_for("the credentials hold", lambda: _held_by(agent, "credentials"), timeout=60)
    assert "401" in held["reason"] and "flashnode login" in held["fix"], held
    [entry] = agent.wait_ledger(1, timeout=60)  # the running attempt: its lease is lost
    assert entry["outcome"] in ("lapsed", "lost"), entry
    assert agent.proc.poll() is None, agent.log
    text = run_flashnode("status", "--state-dir", str(agent.state_dir)).stdout
    assert "  credentials: the coordinator refused this node's credentials" in text, text
    # The owner stores the new token where the agent reads it: no restart.
    fresh = tc.token_file.with_name("token.new")
    fresh.write_text(new_token)
    fresh.chmod(0o600)
    fresh.replace(tc.token_file)
    second = tc.server.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    assert tc.server.wait_state(second, {"SUCCEEDED", "FAILED"}, 60) == "SUCCEEDED", agent.log
    assert "the coordinator accepts this node's credentials again" in agent.log
    assert _held_by(agent, "credentials") is None
    assert agent.proc.poll() is None
    assert "Traceback" not in agent.log


def _held_by(agent: AgentProcess, rule: str) -> dict[str, Any] | None:
    """The hold ``rule`` as the agent's status.json shows it, or None."""
    try:
        snapshot = json.loads((agent.state_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    held = snapshot.get("controls", {}).get("held_by") or []
    found: dict[str, Any] | None = next((h for h in held if h.get("rule") == rule), None)
    return found


def test_a_slow_reload_keeps_the_watchdog_fed(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    # A task interpreter whose import check is fast at start and takes 20 s once asked again.
    slow = shared_dir("flashnode-slowpy-")
    slow.chmod(0o755)  # the check runs as the task user
    flag = slow / "slow"
    python = slow / "python"
    python.write_text(f"#!/bin/sh\n[ -e {flag} ] && sleep 20\nexit 1\n")
    python.chmod(0o755)
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        agent = start_agent(
            coordinator.url,
            *TRUSTED,
            env={
                **FAST,
                "FLASHNODE_TASK_PYTHON": str(python),
                "NOTIFY_SOCKET": str(notify.path),
                "WATCHDOG_USEC": "2000000",
            },
        )
        agent.wait_log("registered as node")
        flag.touch()
        agent.signal(signal.SIGHUP)
        start = time.monotonic()
        time.sleep(6)  # a window inside the 20 s check to count the watchdog's pings in
        pings = [t for t, _ in notify.lines("WATCHDOG=1") if t > start + 0.5]
        assert len(pings) >= 4, pings
    finally:
        notify.close()


def test_a_stop_during_staging_ends_the_attempt_before_the_task_starts(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    marker = shared_dir("flashnode-staged-") / "ran"
    marker.parent.chmod(0o1777)
    bad.overrides[f"{API}/artifacts/shared/"] = drip(b"x" * 120, every=0.5)
    bad.claims = [
        lease_answer(
            1,
            inputs={"data": "artifact://shared/slow.bin"},
            argv=["sh", "-c", f"touch {marker}; echo '{{}}' > metrics.json"],
        )
    ]
    agent = start_agent(bad.url, *TRUSTED, env={**FAST, "FLASHNODE_DRAIN_SECONDS": "1"})
    wait_for("the download", lambda: bad.count("/artifacts/shared/slow.bin"))
    agent.signal(signal.SIGTERM)  # a stop: what has not started its task is stopped at once
    assert agent.wait(30) == 0, agent.log
    assert not marker.exists()
    [entry] = agent.ledger()
    assert (entry["outcome"], entry["reason"]) == ("lapsed", "agent stopping")
    assert bad.fails == [] and bad.completes == []


def test_the_ledger_and_workspace_stay_consistent_whatever_a_phase_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashnode.attempt import PHASES

    # Each phase's function (the stage phase's downloads: its workspace exists by then).
    functions = {name: f"flashnode.attempt.phases.{name}.run" for name in PHASES}
    functions.update(
        check="flashnode.attempt.phases.commit.check",
        commit="flashnode.attempt.phases.commit.commit",
    )
    assert tuple(functions) == PHASES
    for name, function in functions.items():
        clock = FakeClock()
        coord = FakeCoordinator(clock)
        (tmp_path / name).mkdir()
        ctx = context(tmp_path / name, clock, coord, FakeRunner())

        def boom(*_: Any, name: str = name) -> None:
            raise RuntimeError(f"injected in {name}")

        monkeypatch.undo()
        monkeypatch.setattr(function, boom)
        outcome = Attempt(ctx, lease()).run()
        assert outcome is Outcome.FAILED, name
        [(_, reason)] = [c[2] for c in coord.calls if c[1] == "fail"]
        assert reason == "agent error (RuntimeError)"
        assert len(ctx.ledger.records()) == 1
        assert not list((tmp_path / name / "outbox").glob("*.json"))
        attempts = tmp_path / name / "attempts"
        assert not attempts.exists() or not list(attempts.iterdir())


def test_an_attempt_whose_task_end_cannot_be_read_still_releases_what_it_holds_and_records_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task's end, read as the attempt ends (its handle's ``result``), raises: the phases'
    contributions are released all the same, and the attempt ends in one ledger line."""
    from flashnode.attempt.phases import execute

    released: list[str] = []
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, FakeRunner())
    a = Attempt(ctx, lease())

    def boom(_: Any) -> None:
        raise OSError("the task's end cannot be read")

    def held(*_: Any) -> Any:
        from flashnode.runners.plan import Contribution

        return Contribution(release=lambda: released.append("env"))

    monkeypatch.setattr(execute, "release", boom)
    monkeypatch.setattr("flashnode.attempt.phases.environment.run", held)
    outcome = a.run()
    assert outcome is Outcome.COMMITTED
    assert released == ["env"]
    assert len(ctx.ledger.records()) == 1


def test_state_files_keep_their_modes_whatever_the_umask(tmp_path: Path) -> None:
    from flashnode import statefile

    old = os.umask(0)
    try:
        path = tmp_path / "f"
        statefile.write(path, b"x", 0o600)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        os.umask(old)
