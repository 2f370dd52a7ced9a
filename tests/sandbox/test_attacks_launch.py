"""Attacks on the launch chain (the chain that waits for its script, slot chains started
ahead, keyrings cleared by a thread): a hostile task author against the real agent (root,
``--runner trusted``) and the real coordinator. Each test is one attack and fails while the hole
it demonstrates is open."""

from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from badcoord import BadCoordinator, lease_answer
from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    processes_with,
    shared_dir,
    wait_for,
)

from flashnode.sandbox import cgroups

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
METRICS = "echo '{\"ok\": 1}' > metrics.json"
SLOT0 = "flashnode-task-0"


def _slot0_uid() -> int:
    try:
        return pwd.getpwnam(SLOT0).pw_uid
    except KeyError:
        pytest.skip(f"no user {SLOT0}")


def _live_of(uid: int) -> set[int]:
    found = set()
    for p in Path("/proc").iterdir():
        try:
            if (
                p.name.isdigit()
                and p.stat().st_uid == uid
                and (p / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            ):
                found.add(int(p.name))
        except OSError:
            continue
    return found


def _waiting_outside_ahead(uid: int) -> set[int]:
    """Chains of ``uid`` waiting for a script, other than one kept ahead for its slot."""
    found = set()
    for p in _live_of(uid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            cgroup = Path(f"/proc/{p}/cgroup").read_text()
        except OSError:
            continue
        if b"/dev/stdin" in cmd and "ahead-" not in cgroup:
            found.add(p)
    return found


# The second task (same slot, same user): every chain of its user that still waits for a script
# gets one, written through /proc/<pid>/fd/0 (the pipe is the slot user's): a sleeper started
# there lives in that chain's cgroup, not in this task's.
HIJACK = r"""
import os, sys
me, mark = os.getuid(), sys.argv[1]
hit = 0
for p in os.listdir('/proc'):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    try:
        if os.stat('/proc/' + p).st_uid != me:
            continue
        cmd = open('/proc/%s/cmdline' % p, 'rb').read()
        if b'/dev/stdin' not in cmd:
            continue
        fd = os.open('/proc/%s/fd/0' % p, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b'exec sleep ' + mark.encode() + b'\n')
        os.close(fd)
        hit += 1
    except OSError:
        continue
open('metrics.json', 'w').write('{"hijacked": %d}' % hit)
"""


@pytest.mark.usefixtures("as_root")
def test_a_task_whose_script_cannot_be_encoded_leaves_no_chain_for_the_next_task_to_hijack(
    start_agent: Callable[..., AgentProcess],
) -> None:
    """The attack: an argv (or env value) holding a lone surrogate passes the wire parser (its
    size is counted with ``surrogatepass``), but ``env_script`` cannot encode it: the trusted
    runner's ``start`` raises after the chain was started and before a TaskProcess owns it. The
    chain is left waiting on its pipe forever, as the slot's user, in a cgroup nothing removes.
    The slot's next task (same user) writes its own script into that chain through
    /proc/<pid>/fd/0: its sleeper lives on in the leaked cgroup after its attempt ended, beside
    every later task of the slot (same uid: it can read their environment and trace them)."""
    uid = _slot0_uid()
    m = f"600.{secrets.randbelow(10**6):06d}"
    bad = BadCoordinator()
    try:
        bad.claims = [
            lease_answer(1, argv=["sh", "-c", METRICS, "\ud800"]),
            lease_answer(2, argv=["python3", "-c", HIJACK, m]),
        ]
        agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "2", env=FAST)
        assert agent.wait(90) == 0, agent.log
        survivors = processes_with(f"sleep {m}")
        waiting = _waiting_outside_ahead(uid)
    finally:
        bad.close()
        for pid in [*processes_with(f"sleep {m}"), *_waiting_outside_ahead(uid)]:
            os.kill(pid, 9)
    assert survivors == [], f"the second task's sleeper outlived it: {survivors}\n{agent.log}"
    assert waiting == set(), f"chains of {SLOT0} wait outside any task: {waiting}"


# --- keyrings: what the clear leaves ------------------------------------------------------------

KEYCTL = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
# Slot 0's task: its user and user-session keyrings, open to every user.
OPEN_KEYRINGS = KEYCTL + (
    "for ring in (-4, -5):\n"
    "    assert libc.syscall(250, 5, ring, 0x3F3F3F3F) == 0, os.strerror(ctypes.get_errno())\n"
    "open('metrics.json', 'w').write('{}')\n"
)
# Another slot's user, after the agent cleared slot 0's keyrings: a key planted in them.
PLANT = KEYCTL + (
    "import sys\n"
    "for line in open('/proc/keys'):\n"
    "    f = line.split()\n"
    "    if f[7] == 'keyring' and f[8].startswith(('_uid.%s:' % sys.argv[1],"
    " '_uid_ses.%s:' % sys.argv[1])):\n"
    "        r = libc.syscall(248, b'user', b'planted', b'x', 1, ctypes.c_long(int(f[0], 16)))\n"
    "        print(f[8], r)\n"
)
RESET = KEYCTL + (
    "for ring in (-4, -5):\n    libc.syscall(250, 5, ring, 0x1F3F0000)\n    libc.syscall(250, 7, ring)\n"
)


def _as(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.usefixtures("as_root")
def test_a_task_cannot_leave_its_slots_keyrings_open_to_other_users(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack: slot 0's task sets the permissions of its user's own keyrings (user and
    user-session: they outlive every process of the user) to let every user in. The agent's
    clear after the task unlinks their keys but leaves the permissions: the task of another slot
    (another user) can then link keys into them, or link them into its own session keyring and
    so possess, and read, what the slot's next task (a stranger's) keeps there."""
    _slot0_uid()
    python = "/usr/bin/python3"
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    digest = hashlib.sha256(str(agent.state_dir.resolve()).encode()).hexdigest()[:12]
    try:
        job = coordinator.submit(argv_job([python, "-c", OPEN_KEYRINGS], max_attempts=1))
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
        # The turnover (its cgroup removed, keyrings cleared) is done once the chain waits ahead.
        wait_for("a chain kept ahead", lambda: _ahead_chains(digest), timeout=30)
        planted = _as("flashnode-task-1", python, "-c", PLANT, str(_slot0_uid()))
    finally:
        _as(SLOT0, python, "-c", RESET)
    assert planted.returncode == 0, planted.stderr
    assert planted.stdout == "", f"another slot's user reached slot 0's keyrings: {planted.stdout}"


def _ahead_chains(digest: str) -> set[int]:
    hierarchy, _ = cgroups.detect()
    if hierarchy is None:
        pytest.skip("no cgroups")
    base = next(iter(hierarchy.bases.values()))
    return {
        int(pid)
        for cg in base.iterdir()
        if cg.name.startswith(f"ahead-{digest}-")
        for pid in (cg / "cgroup.procs").read_text().split()
    }


# --- whose fault: a task cannot pass its failure off as its launch's -----------------------------


@pytest.mark.usefixtures("as_root")
def test_a_task_that_prints_its_launchs_failure_and_exits_125_is_failed(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack: the launch's setup steps reported their failures on the task's own stderr,
    ending 125, and the agent took any such line there as the node's fault. A task that prints
    one and exits 125 had its lease lapse instead of failing: it spent no failure budget and
    counted against no node, wherever it ran."""
    forged = "echo 'flashnode: cannot mount /tmp' >&2; exit 125"
    job = coordinator.submit(argv_job(["sh", "-c", forged], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    [entry] = agent.ledger()
    assert entry["outcome"] == "failed", entry
    assert entry["reason"].startswith("exit code 125 (the task's last lines: flashnode logs"), entry
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    [failed] = [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "exit code 125" in failed["message"]


@pytest.mark.usefixtures("as_root")
def test_a_payload_env_the_launch_shell_refuses_leaves_the_failure_the_tasks(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack: ``export OPTIND='x'`` ends dash ("Illegal number") while the launch's last
    step applies the payload's env, before it says the task's exec comes next: the agent read
    "task setup failed" and let the lease lapse as the node's fault, so a job never spent its
    failure budget and counted a node fault, toward the quarantine, on every node it reached.
    The task's own failure stays the task's."""
    job = coordinator.submit(argv_job(["sh", "-c", "exit 3"], env={"OPTIND": "x"}, max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    [entry] = agent.ledger()
    assert entry["outcome"] == "failed" and entry["reason"].startswith("exit code 3"), entry
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"


@pytest.mark.usefixtures("as_root")
def test_a_launch_that_fails_before_the_task_runs_is_the_nodes_fault_with_its_reason(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The allowed path beside it: a lent directory removed after the agent started cannot be
    bound for the task that asked for it. No code of the task ran: the lease lapses (the node's
    fault), and the ledger says which step failed."""
    top = shared_dir("flashnode-lent-")
    try:
        (top / "scans").mkdir(mode=0o755)
        lend = {"FLASHNODE_LOCAL_DATA": f"scans={top / 'scans'}"}
        agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env={**FAST, **lend})
        agent.wait_log("registered as node")
        (top / "scans").rmdir()
        job = coordinator.submit(argv_job(["sh", "-c", METRICS], local_inputs=["scans"]))
        assert agent.wait(60) == 0, agent.log
    finally:
        shutil.rmtree(top, ignore_errors=True)
    [entry] = agent.ledger()
    assert entry["outcome"] == "lapsed", entry
    assert entry["reason"].startswith("task setup failed (cannot mount /work/inputs/scans"), entry
    assert not [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
