"""A trusted task stays its task user. Each test is one attack, as a task author would
run it against a root agent: the agent must never follow a path the task can change, never run
the task's environment with privileges, keep concurrent tasks apart, and leave nothing behind.
Most of them need root: that is the agent they attack."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from badcoord import BadCoordinator, lease_answer
from conftest import TokenCoordinator
from harness import AgentProcess, CoordinatorServer, argv_job, shared_dir, wait_for

from flashnode.runners.trusted import TrustedRunner

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
ROOT = os.geteuid() == 0


@pytest.fixture
def secret() -> Iterator[tuple[Path, bytes]]:
    """A root-only file with unguessable bytes, in a directory every user can enter."""
    directory = shared_dir("flashnode-secret-")
    path = directory / "secret"
    data = secrets.token_hex(24).encode()
    path.write_bytes(data)
    path.chmod(0o600)
    yield path, data
    shutil.rmtree(directory, ignore_errors=True)


def _artifacts_hold(server: CoordinatorServer, job: str, needle: bytes) -> list[str]:
    return [key for key in server.artifacts(job) if needle in server.artifact(key)]


# --- 1. paths the task can change --------------------------------------------------------------

SWAP = r"""
cd "$FLASHML_WORK_DIR"
# The agent's logs: replace the directory with one whose files point at secrets.
mv logs logs.old 2>/dev/null && mkdir logs && ln -s {secret} logs/stdout.txt \
  && ln -s /etc/shadow logs/stderr.txt && echo swapped-logs
# The outputs: replace out/ with a link to a root-only directory.
mv out out.old 2>/dev/null && ln -s {secret_dir} out && echo swapped-out
ln {secret} out/hard.txt 2>/dev/null && echo hard-linked
{link}
cat {secret} > out/copy.txt 2>/dev/null
echo "attack done"
echo '{{"ok": 1}}' > out/metrics.json
"""


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize("link", ["", "ln -s {secret} out/soft.txt"])
def test_swapped_logs_and_out_and_links_never_carry_a_secret(
    token_coordinator: TokenCoordinator,
    start_agent: Callable[..., AgentProcess],
    secret: tuple[Path, bytes],
    link: str,
) -> None:
    path, data = secret
    tc = token_coordinator
    protected = Path("/proc/sys/fs/protected_hardlinks")
    before = protected.read_text().strip()
    with contextlib.suppress(OSError):  # not every host protects hard links: no reliance
        protected.write_text("0")
    try:
        script = SWAP.format(secret=path, secret_dir=path.parent, link=link.format(secret=path))
        job = tc.server.submit(argv_job(["sh", "-c", script], max_attempts=1))
        agent = start_agent(
            tc.server.url,
            *TRUSTED,
            *tc.agent_args(),
            "--max-tasks",
            "1",
            env={**FAST, **tc.agent_env()},
        )
        assert agent.wait(60) == 0, agent.log
    finally:
        if protected.read_text().strip() != before:
            protected.write_text(before)
    state = tc.server.wait_state(job, {"SUCCEEDED", "FAILED"})
    needles = [data, tc.token.encode()]
    assert not any(_artifacts_hold(tc.server, job, n) for n in needles)
    [entry] = agent.ledger()
    if link or entry["outcome"] != "committed":
        # A planted link, or a hard link to a file the task did not write: refused by name.
        assert state == "FAILED"
        assert "symlink" in entry["reason"] or "not written by the task" in entry["reason"]
    stdout = tc.server.artifact(f"jobs/{job}/task-000/logs/stdout.txt")
    assert b"swapped" not in stdout  # the workspace and logs/ are the agent's, not the task's


# --- 2. the task's environment reaches only the task -------------------------------------------

MARKER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char comm[64] = {0}, line[160];
    int c = open("/proc/self/comm", O_RDONLY);
    if (c >= 0) { if (read(c, comm, sizeof comm - 1) < 0) comm[0] = 0; close(c); }
    int fd = open(RECORD, O_WRONLY | O_APPEND | O_CREAT, 0666);
    if (fd < 0) return;
    int n = snprintf(line, sizeof line, "euid=%d pid=%d comm=%s", (int)geteuid(), (int)getpid(), comm);
    if (write(fd, line, n) < 0) {}
    close(fd);
}
"""


@pytest.fixture
def marker() -> Iterator[tuple[Path, Path]]:
    """A library that records the euid of every process that loads it: (library, record)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the marker library")
    directory = shared_dir("flashnode-marker-")
    directory.chmod(0o1777)
    record = directory / "loaded"
    source = directory / "marker.c"
    source.write_text(MARKER_C)
    library = directory / "libmarker.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f'-DRECORD="{record}"', "-o", str(library), str(source)],
        check=True,
    )
    library.chmod(0o755)
    yield library, record
    shutil.rmtree(directory, ignore_errors=True)


def _loads(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


@pytest.mark.usefixtures("as_root")
def test_ld_preload_in_the_payload_never_runs_as_root(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    marker: tuple[Path, Path],
) -> None:
    library, record = marker
    env = {"LD_PRELOAD": str(library), "LD_LIBRARY_PATH": str(library.parent)}
    job = coordinator.submit(argv_job(["sh", "-c", "echo '{\"ok\": 1}' > metrics.json"], env=env))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    loads = _loads(record)
    assert loads, "the task itself may preload it, as its own user"
    assert not [line for line in loads if line.startswith("euid=0 ")], loads


@pytest.mark.usefixtures("as_root")
def test_a_module_task_takes_no_env_at_all(
    start_agent: Callable[..., AgentProcess], marker: tuple[Path, Path]
) -> None:
    library, record = marker
    bad = BadCoordinator()  # a coordinator's lease alone: no pool, no opt-in
    try:
        bad.claims = [
            lease_answer(
                1,
                argv=None,
                module="flashml_workloads.sklearn_trial",
                pool=None,
                env={"LD_PRELOAD": str(library)},
            )
        ]
        agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "1", env=FAST)
        assert agent.wait(60) == 0, agent.log
        [(_, reason)] = bad.fails
        assert "env is not allowed for a module task" in reason
    finally:
        bad.close()
    assert _loads(record) == []


# --- 3. concurrent tasks are separate users ----------------------------------------------------

VICTIM = r"""
import json, os, time
secret = open('../inputs/secret.txt').read()
time.sleep(8)
json.dump({'mine': 'victim', 'saw': len(secret)}, open('metrics.json', 'w'))
"""
ATTACKER = r"""
import glob, json, os, time
me = os.environ['FLASHNODE_OWNER']
found = {'tokens': [], 'inputs': [], 'wrote': [], 'paths': []}


def workspace(pid):
    # What a task's /work is bound from, as every process's mountinfo tells.
    try:
        lines = open(f'/proc/{pid}/mountinfo').read().splitlines()
    except OSError:
        return None
    roots = [f.split()[3] for f in lines if len(f.split()) > 4 and f.split()[4] == '/work']
    return roots[-1].replace('\\040', ' ') if roots else None


mine = workspace('self')
deadline = time.time() + 6
while time.time() < deadline:
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
            tokens = [e for e in env if e.startswith(b'FLASHNODE_OWNER=') and me.encode() not in e]
            found['tokens'] += [t.decode() for t in tokens]
        except OSError:
            pass
        for root in [workspace(pid)]:
            if root and '/attempts/' in root and root != mine:
                found['paths'].append(root)
                for name in glob.glob(root + '/inputs/*'):
                    try:
                        found['inputs'].append(open(name).read())
                    except OSError:
                        pass
                try:
                    open(root + '/out/metrics.json', 'w').write('{"mine": "attacker"}')
                    found['wrote'].append(root)
                except OSError:
                    pass
    time.sleep(0.2)
json.dump(found, open('metrics.json', 'w'))
"""


@pytest.mark.usefixtures("as_root")
def test_two_slots_cannot_read_or_write_each_other(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    secret = secrets.token_hex(16)
    coordinator.put_artifact("shared/secret.txt", secret.encode())
    victim = coordinator.submit(
        argv_job(
            ["python3", "-c", VICTIM, "/work/out/metrics.json"],
            inputs={"secret": "artifact://shared/secret.txt"},
        )
    )
    attacker = coordinator.submit(argv_job(["python3", "-c", ATTACKER]))
    agent = start_agent(coordinator.url, *TRUSTED, "--slots", "2", "--max-tasks", "2", env=FAST)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(victim, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert json.loads(coordinator.artifact(f"jobs/{victim}/task-000/metrics.json")) == {
        "mine": "victim",
        "saw": len(secret),
    }
    report = json.loads(coordinator.artifact(f"jobs/{attacker}/task-000/metrics.json"))
    assert report["paths"], report  # it did find its neighbour's workspace (its mountinfo)
    assert report["tokens"] == [] and report["wrote"] == [], report
    assert secret not in json.dumps(report["inputs"]), report
    slots = sorted(r["slot"] for r in agent.ledger())
    assert slots == [0, 1]


# --- 4. nothing a task leaves in /tmp, /dev/shm or IPC outlives it ------------------------------

LEAVE = r"""
m=flashnode-leftover-{marker}
touch /tmp/$m /var/tmp/$m /dev/shm/$m
cp /bin/sh /tmp/$m-sh && chmod u+s /tmp/$m-sh
shmid=$(ipcmk -M 4096 | grep -o '[0-9]*$')
printf '{{"shmid": %s}}' "$shmid" > metrics.json
"""
LOOK = r"""
m=flashnode-leftover-{marker}
seen=$(ls /tmp/$m* /var/tmp/$m /dev/shm/$m 2>/dev/null | wc -l)
if ipcs -m -i {shmid} 2>/dev/null | grep -q "shmid={shmid}"; then segment=true; else segment=false; fi
printf '{{"seen": %s, "segment": %s}}' "$seen" "$segment" > metrics.json
"""


@pytest.mark.usefixtures("as_root")
def test_leftovers_in_tmp_shm_and_ipc_are_gone_after_the_attempt(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    marker = secrets.token_hex(6)
    left = coordinator.submit(argv_job(["sh", "-c", LEAVE.format(marker=marker)]))
    # One slot: the second task runs as the same user, right after the first.
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
    assert coordinator.wait_state(left, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    shmid = json.loads(coordinator.artifact(f"jobs/{left}/task-000/metrics.json"))["shmid"]
    look = coordinator.submit(argv_job(["sh", "-c", LOOK.format(marker=marker, shmid=shmid)]))
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(look, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = json.loads(coordinator.artifact(f"jobs/{look}/task-000/metrics.json"))
    assert seen == {"seen": 0, "segment": False}
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not list(Path(d).glob(f"flashnode-leftover-{marker}*"))


# --- 5. no way to switch users: no trusted work ------------------------------------------------


def test_a_non_root_agent_refuses_the_trusted_runner_naming_the_fix(
    coordinator: CoordinatorServer, tmp_path: Path
) -> None:
    if not ROOT:
        pytest.skip("needs root to start the agent as an unprivileged user")
    python = "/usr/bin/python3"
    site = next(p for p in sys.path if p.endswith("site-packages"))
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": f"{repo}:{site}", "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    probe = subprocess.run([*as_nobody, python, "-c", "import flashnode, pydantic_core"], env=env)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import this checkout as an unprivileged user")
    state = shared_dir("flashnode-nobody-")
    os.chown(state, 65534, 65534)
    try:
        work = [python, "-m", "flashnode", "work", "--coordinator", coordinator.url]
        done = subprocess.run(
            [*as_nobody, *work, "--state-dir", str(state), *TRUSTED],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 78, done.stderr
        assert "cannot run tasks as a distinct task user" in done.stderr
        assert "allow_same_user" in done.stderr and "task_user" in done.stderr
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_preflight_refuses_trusted_without_a_user_to_switch_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from flashnode.config.settings import Settings

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    s = Settings(
        coordinator="http://127.0.0.1:1", runner="trusted", pools=("p",), state_dir=tmp_path
    )
    [problem] = [f for f in TrustedRunner.preflight(s) if getattr(f, "fatal", False)]
    assert problem.code == 78 and "allow_same_user" in problem.fix
    allowed = s.model_copy(update={"allow_same_user": True})
    assert not [f for f in TrustedRunner.preflight(allowed) if getattr(f, "fatal", False)]


# --- 6. the state dir is the agent's ------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o1777])
def test_a_state_dir_other_users_can_write_to_is_refused(tmp_path: Path, mode: int) -> None:
    """Another user could put files in it that the agent reads as its own: its records, and
    the mount tables its launch chains run as root."""
    from flashnode.config.settings import Settings
    from flashnode.runners import preflight

    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    s = Settings(coordinator="http://127.0.0.1:1", runner="trusted", pools=("p",), state_dir=state)
    [problem] = [p for p in preflight.problems(s) if p.what == "state dir"]
    assert problem.fatal and "writable by other users" in problem.why
    assert problem.fix == f"chmod go-w {state}"
    state.chmod(0o755)
    assert not [p for p in preflight.problems(s) if p.what == "state dir"]


def test_a_covers_table_planted_under_the_name_it_will_have_is_written_over(
    tmp_path: Path,
) -> None:
    from flashnode.sandbox.procs.mounts import cover_fstab

    lent = [Path("/srv/data")]
    name = Path(cover_fstab(tmp_path / "probe", lent)).name
    planted = tmp_path / name
    planted.write_text("/ /srv/data none bind 0 0\n")
    assert cover_fstab(tmp_path, lent) == str(planted)
    assert planted.read_text().split()[1:4] == [
        "/srv/data",
        "tmpfs",
        "ro,nosuid,nodev,noexec,mode=0555,size=4k",
    ]


@pytest.mark.usefixtures("as_root")
def test_nothing_in_the_state_dir_is_readable_by_another_local_user(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(["sh", "-c", "echo '{\"ok\": 1}' > metrics.json"]))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    wait_for("the ledger line", agent.ledger)
    state = agent.state_dir
    (state / "outbox").mkdir(exist_ok=True, mode=0o700)
    private = [
        state / "status.json",
        state / "node-id",
        state / "ledger.jsonl",
        state / "outbox",
        state / "attempts",
    ]

    def as_nobody(*argv: str) -> int:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
        return subprocess.run(cmd, capture_output=True).returncode

    for path in private:
        assert path.exists(), path
        reader = "ls" if path.is_dir() else "cat"
        assert as_nobody(reader, str(path)) != 0, f"{path} is readable by nobody"
    assert as_nobody("ls", str(state)) != 0  # the state dir: passable for task users, not listable
    for name in ("status.json", "ledger.jsonl"):  # group flashnode may look (status, history)
        assert (state / name).stat().st_mode & 0o027 == 0, name
    assert (state / "node-id").stat().st_mode & 0o077 == 0


def test_a_task_sees_only_its_own_gpu_device_files(tmp_path: Path) -> None:
    from flashnode.coordinator.messages import GpuInfo
    from flashnode.evidence.gpupool import Device
    from flashnode.runners.trusted import hidden_gpus

    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    gpus = [Device(GpuInfo(index=i), str(i), minor=i) for i in range(3)]

    class Spec:
        gpu_node = True

    def hidden(held: list[Device]) -> list[str]:
        spec = Spec()
        spec.gpus = tuple(held)  # type: ignore[attr-defined]
        return [Path(p).name for p in hidden_gpus(spec, tmp_path)]  # type: ignore[arg-type]

    assert hidden([]) == ["nvidia0", "nvidia1", "nvidia2"]  # none given: none opens
    assert hidden([gpus[1]]) == ["nvidia0", "nvidia2"]
    assert hidden(gpus) == []
    Spec.gpu_node = False
    assert hidden([]) == []  # no GPUs on this node: nothing to hide
