"""No task process outlives its attempt: real processes that detach, ignore SIGTERM, fork-bomb
and overrun memory, run by the real agent against the real coordinator."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TokenCoordinator
from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    ended_in_sandbox,
    pid_alive,
    processes_with,
    shared_dir,
    slot_user,
    wait_for,
)

from flashnode.sandbox import cgroups
from flashnode.sandbox.limits import Limits

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
METRICS = "echo '{\"ok\": 1}' > metrics.json"


def marker() -> str:
    """A unique sleep duration, so this test's sleepers are told apart from everything else."""
    return f"600.{secrets.randbelow(10**6):06d}"


def finished(agent: AgentProcess) -> dict[str, object]:
    return wait_for("an attempt in the ledger", lambda: agent.ledger() and agent.ledger()[-1])


@pytest.mark.parametrize("holds_pipes", [False, True], ids=["quiet-child", "child-holds-stdout"])
def test_detached_double_fork_is_killed_and_the_attempt_commits_at_once(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], holds_pipes: bool
) -> None:
    m = marker()
    redirect = "" if holds_pipes else " >/dev/null 2>&1"
    script = f'setsid sh -c "sleep {m}{redirect} &"; nohup sleep {m}{redirect} & {METRICS}'
    job = coordinator.submit(argv_job(["sh", "-c", script]))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(30) == 0, agent.log
    record = agent.ledger()[-1]
    assert record["outcome"] == "committed"
    assert float(record["ended_at"]) - float(record["started_at"]) < 2.0  # type: ignore[arg-type]
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert processes_with(f"sleep {m}") == []


@pytest.mark.parametrize("how", ["timeout", "lease-lost"])
def test_child_ignoring_sigterm_is_gone_after_the_grace(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
    how: str,
) -> None:
    m = marker()
    pidfile = drop_dir / "pid"
    script = f"trap '' TERM; sleep {m} & echo $! > {pidfile}; wait"
    job = coordinator.submit(argv_job(["sh", "-c", script], max_attempts=1, lease_seconds=30))
    # The coordinator refuses timeout_seconds below 30 s; the agent's own cap is what times out.
    limit = {"FLASHNODE_MAX_TASK_SECONDS": "2"} if how == "timeout" else {}
    agent = start_agent(coordinator.url, *TRUSTED, env={**FAST, **limit})
    pid = int(wait_for("the child's pid", lambda: pidfile.exists() and pidfile.read_text().strip()))
    assert pid_alive(pid)
    if how == "lease-lost":
        coordinator.cancel(job)
        wait_for("the child to be gone", lambda: not pid_alive(pid), timeout=30 / 3 + 2, every=0.05)
        assert finished(agent)["outcome"] == "lost"
    else:
        wait_for("the child to be gone", lambda: not pid_alive(pid), timeout=2 + 1 + 3, every=0.05)
        record = finished(agent)
        assert record["outcome"] == "failed" and record["reason"] == "timed out after 2 s"
    assert processes_with(f"sleep {m}") == []


def test_restarted_agent_reaps_leftovers_before_claiming_and_spares_reused_pids(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    m = marker()
    pidfile = drop_dir / "pids"
    script = f'setsid sh -c "sleep {m} >/dev/null 2>&1 & echo \\$! >> {pidfile}"; sleep {m} & echo $! >> {pidfile}; wait'
    job = coordinator.submit(argv_job(["sh", "-c", script], max_attempts=2))
    first = start_agent(coordinator.url, *TRUSTED, env=FAST)
    pids = wait_for(
        "two leftover pids",
        lambda: pidfile.exists() and len(p := pidfile.read_text().split()) == 2 and p,
    )
    first.proc.kill()  # SIGKILL: no cleanup at all
    first.proc.wait()
    assert all(pid_alive(int(p)) for p in pids)

    # A bystander with no token stands in for a process that reused the task's recorded pid.
    bystander = subprocess.Popen(["sleep", m])
    outbox = first.state_dir / "outbox"
    [record_path] = list(outbox.glob("*.json"))
    record = json.loads(record_path.read_text())
    record["process"]["pid"] = bystander.pid
    record_path.write_text(json.dumps(record))
    try:
        second = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=first.state_dir)
        second.wait_log("registered as node")
        assert not any(pid_alive(int(p)) for p in pids)  # reaped before registering and claiming
        assert bystander.poll() is None  # no token, no matching start time: untouched
        assert second.log.index("agent restarted") < second.log.index("registered as node")
        # Not the task's fault: its lease is left to lapse, no failure is reported.
        assert [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"] == []
        entry = wait_for("the ledger line", lambda: second.ledger() and second.ledger()[-1])
        assert (entry["outcome"], entry["reason"]) == ("lapsed", "agent restarted")
        assert not (first.state_dir / "attempts" / record_path.stem).exists()  # workspace cleaned
    finally:
        bystander.kill()
        bystander.wait()


FORKS = (
    "import os, json, time\n"
    "n = 0\n"
    "try:\n"
    "    while n < 500:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(60); os._exit(0)\n"
    "        n += 1\n"
    "except OSError:\n"
    "    pass\n"
    "json.dump({'forks': n}, open('metrics.json', 'w'))\n"
)


@pytest.mark.usefixtures("task_cgroups")
def test_fork_bomb_stops_at_the_pids_limit(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(["python3", "-c", FORKS]))
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "1", env={**FAST, "FLASHNODE_TASK_PIDS": "32"}
    )
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    forks = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))["forks"]
    assert 0 < forks < 32
    assert processes_with("python3 -c import os, json, time") == []


@pytest.mark.usefixtures("task_cgroups")
def test_allocating_past_the_memory_limit_fails_with_out_of_memory(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    script = "b = bytearray(512 << 20); open('metrics.json', 'w').write('{}')"
    job = coordinator.submit(argv_job(["python3", "-c", script], max_attempts=1))
    agent = start_agent(
        coordinator.url,
        *TRUSTED,
        "--max-tasks",
        "1",
        env={**FAST, "FLASHNODE_TASK_MEMORY_BYTES": str(64 << 20)},
    )
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    failed = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert failed == ["out of memory"]


@pytest.mark.usefixtures("as_root")
def test_task_user_cannot_read_the_credentials_or_the_agent_environment(
    token_coordinator: TokenCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    tc = token_coordinator
    probe = (
        "import json, os\n"
        "def read(p):\n"
        "    try:\n"
        "        return open(p, errors='replace').read()\n"
        "    except OSError as e:\n"
        "        return 'denied: ' + e.strerror\n"
        f"r = {{'token': read({str(tc.token_file)!r}), 'agent_env': read('/proc/%d/environ' % os.getppid()),"
        " 'uid': os.getuid()}\n"
        "json.dump(r, open('metrics.json', 'w'))\n"
    )
    job = tc.server.submit(argv_job(["python3", "-c", probe]))
    agent = start_agent(
        tc.server.url,
        *TRUSTED,
        *tc.agent_args(),
        "--max-tasks",
        "1",
        env={**FAST, **tc.agent_env()},
    )
    assert agent.wait(30) == 0, agent.log
    assert tc.server.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    seen = json.loads(tc.server.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert seen["uid"] != 0
    assert seen["token"].startswith("denied") and seen["agent_env"].startswith("denied")
    assert tc.token not in json.dumps(seen) and tc.join_code not in json.dumps(seen)


class SteppingClock:
    """Monotonic time that moves only when the code under test sleeps: the TERM→KILL schedule is
    followed without waiting for it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        if not event.is_set():
            event.wait(0.01)  # let the real process side move a little
            self.now += max(timeout, 0.0)
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        # Each of the code's short polls stands for a long pause on this clock.
        time.sleep(0.005)
        self.now += seconds * 1000
        self.slept += seconds * 1000


def test_term_then_kill_follows_the_grace_on_the_injected_clock(tmp_path: Path) -> None:
    from flashnode.sandbox import procs
    from flashnode.sandbox.procs.chain import SYSTEM_PATH
    from flashnode.sandbox.procs.task import TaskProcess

    ready = tmp_path / "ready"
    done = threading.Event()
    clock = SteppingClock()
    proc = TaskProcess(
        ["sh", "-c", f"trap '' TERM; touch {ready}; while :; do sleep 1; done"],
        {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
        cwd=tmp_path,
        stdout=tmp_path / "out",
        stderr=tmp_path / "err",
        log_max_bytes=1024,
        on_exit=done.set,
        clock=clock,
    )
    wait_for("the task to ignore TERM", ready.exists)
    started = time.monotonic()
    proc.terminate(grace=600.0)  # ten minutes on the clock, a moment in real time
    assert done.wait(10) and proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 30 and clock.slept >= 600.0
    proc.close()


# --- the launch: nothing of a task runs before it is recorded and sent ---------------------------


def _waiting(pid: int) -> bool:
    """The chain's last step is up and blocked reading its script."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return cmdline[-2:-1] == [b"flashnode-task"] and state == "S"


def test_a_held_task_runs_only_once_sent_and_a_torn_script_runs_nothing(tmp_path: Path) -> None:
    from flashnode.sandbox import procs
    from flashnode.sandbox.procs.chain import SETUP_FAILED, SYSTEM_PATH, env_script
    from flashnode.sandbox.procs.launch import Launch
    from flashnode.sandbox.procs.task import TaskProcess

    ran = tmp_path / "ran"
    env = {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH}
    proc = TaskProcess(
        ["sh", "-c", f"touch {ran}"],
        env,
        cwd=tmp_path,
        stdout=tmp_path / "out",
        stderr=tmp_path / "err",
        log_max_bytes=1024,
        on_exit=lambda: None,
        hold=True,
    )
    wait_for("the chain to wait for its script", lambda: _waiting(proc.pid))
    assert not ran.exists() and not proc.exited.is_set()
    proc.go()
    wait_for("the task to run once sent", lambda: proc.exited.is_set())
    assert ran.exists() and proc.returncode == 0
    proc.close()

    # The script arrives torn (the agent died while sending it): the exports and the arguments
    # are there, the last line is not. The chain runs nothing.
    launch = Launch(tmp_path)
    wait_for("the chain to wait for its script", lambda: _waiting(launch.pid))
    whole = env_script(env, ["sh", "-c", f"touch {ran}-torn"], tmp_path)
    os.write(launch.script_w, whole[: whole.rindex(b"FLASHNODE_GO")])
    os.close(launch.script_w)
    wait_for("the chain to end", lambda: not launch.alive())
    assert launch.supervised.returncode == SETUP_FAILED
    assert not Path(f"{ran}-torn").exists()
    launch.supervised.done()


# --- whose fault: the launch's own channel ---------------------------------------------------

# The task: list the pipes it holds (readlink of every descriptor), then forge its launch's words.
FORGER = "ls -l /proc/self/fd/ > {fds}; echo 'flashnode: cannot mount /tmp' >&2; exit 125"


def test_the_task_holds_no_descriptor_of_its_launchs_fault_channel(tmp_path: Path) -> None:
    """The launch tells its setup failures on a channel of its own, its stderr until the task's
    exec: the task has no descriptor of it, and what the task prints goes to its own stderr. A
    task printing a "flashnode:" line and ending 125 was launched: its exit is its own."""
    from flashnode.sandbox import procs
    from flashnode.sandbox.procs.chain import SETUP_FAILED, SYSTEM_PATH
    from flashnode.sandbox.procs.launch import Launch
    from flashnode.sandbox.procs.task import TaskProcess

    launch = Launch(tmp_path)
    fault = wait_for(  # the chain's stderr, once its first process has set it: its fault channel
        "the chain's fault channel",
        lambda: (link := os.readlink(f"/proc/{launch.pid}/fd/2")).startswith("pipe:[") and link,
    )
    fds = tmp_path / "fds"
    proc = TaskProcess(
        ["sh", "-c", FORGER.format(fds=fds)],
        {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
        cwd=tmp_path,
        stdout=tmp_path / "out",
        stderr=tmp_path / "err",
        log_max_bytes=1024,
        on_exit=lambda: None,
        launch=launch,
    )
    wait_for("the task to end", proc.exited.is_set)
    proc.close()
    assert fault not in fds.read_text()
    assert "pipe:[" in fds.read_text()  # its stdout and stderr are pipes: the listing works
    assert proc.returncode == SETUP_FAILED and proc.launched
    assert (tmp_path / "err").read_bytes() == b"flashnode: cannot mount /tmp\n"


@pytest.mark.usefixtures("as_root")
def test_a_launch_whose_setup_fails_says_why_and_runs_nothing(tmp_path: Path) -> None:
    from flashnode.sandbox.procs.mounts import Sandbox

    ran = tmp_path / "ran"
    (tmp_path / "view").mkdir()
    sandbox = Sandbox(1 << 20, read_only_binds=((str(tmp_path / "vanished"), "view"),))
    proc = ended_in_sandbox(["touch", str(ran)], sandbox, tmp_path, tmp_path)
    assert not proc.launched and not ran.exists()
    why = proc.setup_failure()
    assert why == "cannot mount /work/view read-only: No such file or directory", why
    assert (tmp_path / "err").read_bytes() == b""  # nothing of the setup in the task's log


def ahead_cgroups(agent: AgentProcess) -> set[Path]:
    """The cgroups of the chains ``agent`` started ahead (named for its state dir)."""
    hierarchy, _ = cgroups.detect()
    assert hierarchy is not None
    base = next(iter(hierarchy.bases.values()))
    digest = hashlib.sha256(str(agent.state_dir.resolve()).encode()).hexdigest()
    return {p for p in base.iterdir() if p.name.startswith(f"ahead-{digest[:12]}-")}


def waiting_chain(agent: AgentProcess) -> int | None:
    """The pid of the one chain ``agent`` keeps ahead once it waits for its script: alone in its
    cgroup, the slot's user (while it sets up, its steps run as root beside it)."""
    chains = waiting_chains(agent)
    return chains.popitem()[1] if len(chains) == 1 else None


def waiting_chains(agent: AgentProcess) -> dict[int, int]:
    """Slot -> the pid of its chain kept ahead, for the chains that wait for their script."""
    prefix = f"ahead-{hashlib.sha256(str(agent.state_dir.resolve()).encode()).hexdigest()[:12]}-"
    chains: dict[int, int] = {}
    for cg in ahead_cgroups(agent):
        pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        try:
            if len(pids) == 1 and os.stat(f"/proc/{pids[0]}").st_uid != 0:
                chains[int(cg.name.removeprefix(prefix).split("-")[0])] = pids[0]
        except OSError:
            continue
    return chains


def next_task_pid(coordinator: CoordinatorServer, agent: AgentProcess) -> int:
    """The pid of a task run now by ``agent`` (the pid of the chain it ran in)."""
    job = coordinator.submit(
        argv_job(["sh", "-c", 'echo "{\\"pid\\": $$}" > metrics.json'], max_attempts=1)
    )
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    return int(json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))["pid"])


@pytest.mark.usefixtures("task_cgroups")
def test_the_chain_kept_ahead_goes_with_the_agent_and_its_cgroup_at_the_next_start(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """After a task, its slot's next chain waits ahead (its own cgroup, the slot's user). An
    agent killed outright leaves it: it reads the end of its pipe and exits having run nothing,
    and the next start of the agent removes its cgroup."""
    job = coordinator.submit(argv_job(["sh", "-c", METRICS], max_attempts=1))
    first = start_agent(coordinator.url, *TRUSTED, env=FAST)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", first.log

    def ahead() -> set[Path]:
        return ahead_cgroups(first)

    chain = wait_for("a chain kept ahead", lambda: waiting_chain(first))
    mine = ahead()
    first.proc.kill()  # SIGKILL: no cleanup at all
    first.proc.wait()
    wait_for("the chain to end with its pipe", lambda: not pid_alive(chain), timeout=10)
    assert mine <= ahead()  # still there: nobody removed it
    second = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=first.state_dir)
    second.wait_log("registered as node")
    assert not mine & ahead()


@pytest.mark.usefixtures("task_cgroups")
def test_the_chain_kept_ahead_waits_alone_and_the_next_task_of_its_slot_runs_in_it(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack: a task leaves a detached process of its slot's user that ignores SIGTERM, to
    meddle with the chain started ahead for the slot's next task (same user: it could trace it
    or rewrite its script). The chain must wait with no other process of that user beside it;
    and the next task of the slot runs in it (its pid is the chain's), its workspace at /work."""
    m = marker()
    lurker = f"setsid sh -c 'trap \"\" TERM; sleep {m}' >/dev/null 2>&1 & {METRICS}"
    first = coordinator.submit(argv_job(["sh", "-c", lurker], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    assert coordinator.wait_state(first, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log

    chain = wait_for("a chain kept ahead", lambda: waiting_chain(agent))
    uid = os.stat(f"/proc/{chain}").st_uid
    assert uid != 0 and processes_with(f"sleep {m}") == []
    mine = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _live(p, uid)}
    assert mine == {chain}, {p: _describe(p) for p in mine}

    assert next_task_pid(coordinator, agent) == chain


@pytest.mark.usefixtures("task_cgroups")
def test_an_agent_keeps_a_chain_ahead_from_its_start_and_its_first_task_runs_in_it(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Not only after a task: a slot's first task after the agent's start also starts with one
    exec, in the chain the agent started for it (its pid is the chain's)."""
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    chain = wait_for("a chain kept ahead before any task", lambda: waiting_chain(agent))
    assert next_task_pid(coordinator, agent) == chain


@pytest.mark.usefixtures("task_cgroups")
def test_an_agent_started_again_keeps_no_chain_ahead_beside_a_task_it_rejoined(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack a chain kept ahead must never meet: a running task of the same user, which
    could trace it or write a script of its own into it. An agent started again while a task of
    its earlier run runs on keeps chains ahead for its free slots only; the task's slot gets its
    chain once the task has ended (its turnover)."""
    gate = shared_dir("rejoined-")
    gate.chmod(0o777)
    script = f"id -u > {gate}/uid; until [ -e {gate}/go ]; do sleep 0.05; done; {METRICS}"
    job = coordinator.submit(argv_job(["sh", "-c", script], lease_seconds=60, max_attempts=1))
    try:
        first = start_agent(coordinator.url, *TRUSTED, "--slots", "2", env=FAST)
        uid = int(wait_for("the task to run", lambda: _read(gate / "uid"), timeout=60))
        first.signal(signal.SIGTERM)  # a stop lets go of the task: it runs on
        assert first.wait(15) == 0, first.log
        busy = next(slot for slot in (0, 1) if slot_user(slot).uid == uid)
        second = start_agent(
            coordinator.url, *TRUSTED, "--slots", "2", env=FAST, state_dir=first.state_dir
        )
        second.wait_log("re-attached 1 task(s)")
        # (The rejoined task's user is not held by this agent while it runs, so a chain of
        # that user could not start either: this holds the outcome, whichever step keeps it.)
        chains = wait_for("the free slot's chain", lambda: waiting_chains(second))
        assert set(chains) == {1 - busy}, chains
        (gate / "go").touch()
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", second.log
        wait_for("the task's slot's chain", lambda: busy in waiting_chains(second))
    finally:
        (gate / "go").touch()
        shutil.rmtree(gate, ignore_errors=True)


@pytest.mark.usefixtures("task_cgroups")
def test_no_chain_is_started_ahead_beside_a_process_of_its_user_that_outlived_a_run(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack: a process of the slot's user that no cgroup holds any more (a task of an
    earlier run that escaped its reaping) waits for the next agent's chain, to trace it or
    write a script of its own into it. An agent started beside it keeps no chain ahead for
    that slot, and says why."""
    user = slot_user(0)
    m = marker()
    lurker = subprocess.Popen(
        ["sleep", m], user=user.uid, group=user.gid, extra_groups=[], start_new_session=True
    )
    try:
        agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
        agent.wait_log("outlived an earlier run")  # said before the agent registers
        agent.wait_log("registered as node")
        assert ahead_cgroups(agent) == set()
        assert f"(pid {lurker.pid})" in agent.log
    finally:
        lurker.kill()
        lurker.wait()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _live(proc: Path, uid: int) -> bool:
    """A process of ``uid`` that can still act (a zombie, not yet reaped by init, cannot)."""
    try:
        return proc.stat().st_uid == uid and (proc / "stat").read_text().rsplit(")", 1)[1][1] != "Z"
    except OSError:
        return False


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        cg = Path(f"/proc/{pid}/cgroup").read_text().splitlines()[0]
    except OSError as exc:
        return str(exc)
    return f"{cmd} [{cg}]"


def test_a_state_dir_closed_again_is_opened_for_the_next_task(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """systemd sets StateDirectoryMode again on every Exec line (a reload): the next task still
    starts (its workspace is bound at /work as root; its job environment is reached by its path,
    as its user)."""
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    first = coordinator.submit(argv_job(["sh", "-c", METRICS], max_attempts=1))
    assert coordinator.wait_state(first, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    agent.state_dir.chmod(0o700)
    second = coordinator.submit(argv_job(["sh", "-c", f"cd $PWD && {METRICS}"], max_attempts=1))
    assert coordinator.wait_state(second, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log


@pytest.mark.usefixtures("task_cgroups")
def test_a_cgroup_that_exists_is_never_joined_or_removed() -> None:
    """A lease id is the coordinator's to choose: one that names a live cgroup (another
    attempt's, or a chain's started ahead, which a task sees in /proc/self/cgroup) must not put
    the new task in it, nor remove it when the attempt fails to start."""
    hierarchy, _ = cgroups.detect()
    assert hierarchy is not None
    name = f"ahead-test-{secrets.token_hex(4)}"
    first = hierarchy.create(name, Limits())
    try:
        with pytest.raises(FileExistsError):
            hierarchy.create(name, Limits())
        assert all(path.is_dir() for path in first.paths.values())
    finally:
        first.remove()
    assert not any(path.exists() for path in first.paths.values())
