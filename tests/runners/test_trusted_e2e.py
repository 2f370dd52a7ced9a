"""The agent's core end to end: the real coordinator, the real agent process, real tasks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TokenCoordinator
from harness import AgentProcess, CoordinatorServer, argv_job, pid_alive, wait_for

from flashnode.config.settings import Settings
from flashnode.coordinator.client import Coordinator
from flashnode.errors import PrerequisiteError
from flashnode.evidence.inventory import registration
from flashnode.runners import trusted, trustedhost
from flashnode.runners.findings import Ok, Problem

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
PY = "python3"


def test_pool_job_of_three_tasks_commits_every_output(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    script = (
        "import json,sys,os; os.makedirs(os.path.dirname(sys.argv[2]), exist_ok=True);"
        " json.dump(dict(result={n}*2), open(sys.argv[1],'w'));"
        " open(sys.argv[2],'w').write('hello {n}')"
    )
    job = coordinator.submit(
        argv_job(
            [PY, "-c", script, "/work/out/metrics.json", "/work/out/notes/hello.txt"],
            params=[{"n": 1}, {"n": 2}, {"n": 3}],
            validators={"keys": ["result"]},
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "3", env=FAST)
    assert agent.wait() == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert [t["state"] for t in coordinator.tasks(job)] == ["COMPLETED"] * 3

    records = {r["task_id"]: r for r in agent.ledger()}
    for n, task in enumerate(["task-000", "task-001", "task-002"], start=1):
        metrics = coordinator.artifact(f"jobs/{job}/{task}/metrics.json")
        assert json.loads(metrics) == {"result": 2 * n}
        assert hashlib.sha256(metrics).hexdigest() == records[task]["output_sha256"]
        assert coordinator.artifact(f"jobs/{job}/{task}/notes/hello.txt") == f"hello {n}".encode()
        assert records[task]["outcome"] == "committed"
        evidence = records[task]["evidence"]
        assert evidence["exit_code"] == 0 and evidence["image_digest"] == ""
        assert evidence["wall_seconds"] > 0 and evidence["gpu_util_percent_mean"] is None


def test_agent_outside_the_pool_never_gets_the_tasks(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    job = coordinator.submit(argv_job([PY, "-c", "pass"]))
    outsider = start_agent(coordinator.url, "--runner", "trusted", "--pool", "team-b", env=FAST)
    outsider.wait_log("registered as node")
    # The outsider polls several times a second; give it a bounded window to (wrongly) claim.
    with __import__("pytest").raises(AssertionError):
        wait_for(
            "a claim by the outsider", lambda: coordinator.tasks(job)[0]["attempts"] > 0, timeout=3
        )
    assert coordinator.tasks(job)[0]["state"] == "PENDING"
    assert "claimed" not in outsider.log


def test_pool_member_without_the_trusted_opt_in_is_refused(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    job = coordinator.submit(argv_job([PY, "-c", "pass"]))
    # What a pool member without --runner trusted registers: no unsandboxed opt-in, so the
    # coordinator places no trusted argv work on it.
    settings = Settings(
        coordinator=coordinator.url, runner="docker", pools=("team-a",), state_dir=tmp_path
    )
    reg = registration(settings, "no-opt-in")
    assert reg.unsandboxed_argv_capable is False
    # Without the container tier either (argv_capable), nothing may run its argv work.
    reg = reg.model_copy(update={"argv_capable": False, "sandbox_capable": False})
    client = Coordinator(coordinator.url)
    try:
        node = client.register(reg)
        assert client.claim(node) is None
    finally:
        client.close()
    assert coordinator.tasks(job)[0]["attempts"] == 0
    # And the trusted runner with no pool cannot start at all: a configuration error.
    agent = start_agent(coordinator.url, "--runner", "trusted")
    assert agent.wait() == 78
    assert "runner = 'trusted' (from --runner) needs at least one pool" in agent.log


def test_failing_task_ends_failed_with_its_reason_in_the_events(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(
        argv_job(["sh", "-c", "echo starting; echo boom-from-task >&2; exit 3"], max_attempts=2)
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
    assert agent.wait() == 0, agent.log
    assert coordinator.wait_state(job, {"FAILED", "SUCCEEDED"}) == "FAILED"
    failures = [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert len(failures) == 2
    assert all("exit code 3" in e["message"] and "boom-from-task" in e["message"] for e in failures)
    assert any(e["type"] == "TASK_EXHAUSTED" for e in coordinator.events(job))
    # The failed attempt's logs were kept for the operator.
    assert b"boom-from-task" in coordinator.artifact(f"jobs/{job}/task-000/logs/stderr.txt")


def test_lost_lease_kills_the_task_tree_and_sends_no_complete(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    pidfile = drop_dir / "pids"
    # The task and a child of it each record their pid, then run long.
    script = f"sleep 300 & echo $! >> {pidfile}; echo $$ >> {pidfile}; wait"
    lease_seconds = 30
    job = coordinator.submit(argv_job(["sh", "-c", script], lease_seconds=lease_seconds))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    pids = wait_for(
        "the task's pids",
        lambda: (
            (p := pidfile.read_text().split() if pidfile.exists() else []) and len(p) == 2 and p
        ),
    )
    pids = [int(p) for p in pids]
    assert all(pid_alive(p) for p in pids)
    coordinator.cancel(job)
    wait_for(
        "the task's processes to be gone",
        lambda: not any(pid_alive(p) for p in pids),
        timeout=lease_seconds / 3 + 2,
        every=0.05,
    )
    agent.wait_log("lost, nothing more is reported")
    types = [e["type"] for e in coordinator.events(job)]
    assert "TASK_COMMIT_REJECTED" not in types and "TASK_ATTEMPT_FAILED" not in types
    assert coordinator.artifacts(job) == []
    wait_for(
        "the loss in the ledger", lambda: agent.ledger() and agent.ledger()[-1]["outcome"] == "lost"
    )
    assert agent.proc.poll() is None  # the agent carries on


def test_agent_reregisters_after_a_coordinator_restart(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    agent.wait_log("registered as node")
    coordinator.stop()
    coordinator.start()  # same port, same data dirs: it has forgotten the node
    job = coordinator.submit(
        argv_job([PY, "-c", "import json; json.dump({'ok': 1}, open('metrics.json', 'w'))"])
    )
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert "registering again" in agent.log


def test_symlink_out_of_the_workspace_fails_and_uploads_nothing(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("not for the coordinator")
    script = f"echo '{{{{\"x\": 1}}}}' > metrics.json && ln -s {secret} leak.txt"
    job = coordinator.submit(argv_job(["sh", "-c", script], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait() == 0, agent.log
    assert coordinator.wait_state(job, {"FAILED", "SUCCEEDED"}) == "FAILED"
    failed = [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "out/leak.txt is a symlink" in failed[0]["message"]
    assert coordinator.artifacts(job) == []


def test_task_environment_holds_no_agent_secrets(
    token_coordinator: TokenCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    tc = token_coordinator
    script = "import json,os; json.dump(dict(os.environ), open('metrics.json','w'))"
    job = tc.server.submit(argv_job([PY, "-c", script]))
    agent = start_agent(
        tc.server.url,
        *TRUSTED,
        *tc.agent_args(),
        "--max-tasks",
        "1",
        env={**FAST, **tc.agent_env()},
    )
    assert agent.wait() == 0, agent.log
    assert tc.server.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    env = json.loads(tc.server.artifact(f"jobs/{job}/task-000/metrics.json"))
    dumped = json.dumps(env)
    assert tc.token not in dumped and tc.join_code not in dumped
    assert not any(k.startswith("FLASHNODE_") and k != "FLASHNODE_OWNER" for k in env)
    # The workspace itself is the agent's: the task's home is its own tmp/.
    assert env["HOME"] == env["TMPDIR"] == env["FLASHML_WORK_DIR"] + "/tmp"
    assert tc.token not in agent.log and tc.join_code not in agent.log


def test_sigterm_while_idle_exits_zero(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    agent.wait_log("registered as node")
    agent.signal(signal.SIGTERM)
    assert agent.wait(20) == 0


def test_inputs_are_staged_and_a_missing_input_fails_naming_its_key(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        code = b"import json,sys; json.dump({'data': open(sys.argv[1]).read()}, open(sys.argv[2], 'w'))"
        info = tarfile.TarInfo("run.py")
        info.size = len(code)
        tar.addfile(info, io.BytesIO(code))
    coordinator.put_artifact("shared/code.tar.gz", buf.getvalue())
    coordinator.put_artifact("shared/data.txt", b"forty-two")
    command = [PY, "/work/inputs/code/run.py", "/work/inputs/data.txt", "/work/out/metrics.json"]
    good = coordinator.submit(
        argv_job(
            command,
            inputs={"code": "artifact://shared/code.tar.gz", "data": "artifact://shared/data.txt"},
            unpack_inputs=["code"],
        )
    )
    missing = coordinator.submit(
        argv_job(
            command,
            inputs={"code": "artifact://shared/nope.tar.gz"},
            unpack_inputs=["code"],
            max_attempts=1,
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
    assert agent.wait() == 0, agent.log
    assert coordinator.wait_state(good, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert json.loads(coordinator.artifact(f"jobs/{good}/task-000/metrics.json")) == {
        "data": "forty-two"
    }
    assert coordinator.wait_state(missing, {"SUCCEEDED", "FAILED"}) == "FAILED"
    failed = [
        e["message"] for e in coordinator.events(missing) if e["type"] == "TASK_ATTEMPT_FAILED"
    ]
    assert "input 'code' is missing" in failed[0] and "shared/nope.tar.gz" in failed[0]


# /work where no argv rewrite ever reached: inside a script string, a program's text and a file
# the task reads; and what the task's environment says of its workspace ($1: the state dir).
WORK_EVERYWHERE = r"""
set -e
echo from-sh > /work/out/sh.txt
python3 -c "open('/work/out/py.txt', 'w').write('from-python')"
cp "$(cat /work/inputs/where.txt)" /work/out/copied.txt
python3 - "$1" <<'EOF'
import json, os, sys
state = sys.argv[1]
json.dump(dict(
    env={k: os.environ.get(k) for k in ("HOME", "TMPDIR", "FLASHML_WORK_DIR")},
    cwd=os.getcwd(),
    listing=sorted(os.listdir("/work")),
    leaks=sorted(k for k, v in os.environ.items() if state in v),
    home=os.access(os.environ["HOME"], os.W_OK),
), open("/work/out/metrics.json", "w"))
EOF
"""


def _run_work_everywhere(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], **agent: object
) -> str:
    coordinator.put_artifact("shared/where.txt", b"/work/inputs/data.txt")
    coordinator.put_artifact("shared/data.txt", b"forty-two")
    started = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, **agent)
    job = coordinator.submit(
        argv_job(
            ["sh", "-c", WORK_EVERYWHERE, "sh", str(started.state_dir.resolve())],
            inputs={"where": "artifact://shared/where.txt", "data": "artifact://shared/data.txt"},
            max_attempts=1,
        )
    )
    assert started.wait() == 0, started.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", started.log

    def output(name: str) -> bytes:
        return coordinator.artifact(f"jobs/{job}/task-000/{name}")

    assert (output("sh.txt"), output("py.txt")) == (b"from-sh\n", b"from-python")
    assert output("copied.txt") == b"forty-two"
    seen = json.loads(output("metrics.json"))
    assert seen["env"] == {"HOME": "/work/tmp", "TMPDIR": "/work/tmp", "FLASHML_WORK_DIR": "/work"}
    assert seen["cwd"].startswith("/work") and seen["home"] is True
    assert seen["leaks"] == []  # the workspace's host path is nowhere in its environment
    assert {"inputs", "out", "tmp"} <= set(seen["listing"])
    return job


@pytest.mark.usefixtures("as_root")
def test_work_paths_hold_in_scripts_programs_and_files_the_task_reads(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    host = sorted(os.listdir("/work")) if os.path.isdir("/work") else None
    job = _run_work_everywhere(coordinator, start_agent)
    seen = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    # The host's own /work (here: not empty) is only the mount point: covered in the task's
    # namespace, left as it was.
    assert host is None or not set(host) & set(seen["listing"]) - {"inputs", "out", "tmp"}
    assert host is None or sorted(os.listdir("/work")) == host


@pytest.mark.usefixtures("as_root")
def test_work_holds_with_the_state_dir_under_a_private_dir(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Each task gets its own /tmp: a state dir under /tmp is out of its sight by its path, yet
    its workspace is at /work."""
    state = Path(tempfile.mkdtemp(prefix="flashnode-state-", dir="/tmp"))
    try:
        _run_work_everywhere(coordinator, start_agent, state_dir=state)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_the_same_user_mode_rewrites_work_to_the_workspace(tmp_path: Path) -> None:
    """No namespace to bind /work in (an agent that is not root): /work paths in arguments and
    env values are rewritten to the workspace, and the contract variables name it."""
    from fakes import lease

    from flashnode.config.settings import Settings
    from flashnode.coordinator.lease import Lease, parse_task
    from flashnode.evidence.gpupool import GpuPool
    from flashnode.runners.base import RunnerEnv
    from flashnode.runners.plan import resolve
    from flashnode.sandbox.limits import Limits
    from flashnode.sandbox.workspace import Workspace

    settings = Settings(coordinator="http://127.0.0.1:1", runner="trusted", state_dir=tmp_path)
    runner = trusted.TrustedRunner(
        settings, RunnerEnv("node-1", GpuPool()), None, None, sandbox=False, agent_env={}
    )
    ws = Workspace.create(tmp_path / "attempts", "ls-1")
    env = {"DATA": "/work/inputs/x", "OPT": "--o=/work/out"}
    data = Lease.model_validate(lease(argv=["cat", "/work/inputs/x"], env=env))
    task = parse_task(data)
    plan = resolve(
        task,
        data,
        0,
        ws,
        runner.facts(ws, 0),
        [],
        gpus=[],
        gpu_node=False,
        limits=Limits(1 << 30, 1.0, 64),
        on_exit=print,
        record=print,
    )
    root = str(ws.root)
    assert plan.argv == ("cat", f"{root}/inputs/x") and plan.cwd == f"{root}/out"
    env = dict(plan.env)
    assert (env["DATA"], env["OPT"]) == (f"{root}/inputs/x", f"--o={root}/out")
    assert (env["HOME"], env["TMPDIR"], env["FLASHML_WORK_DIR"]) == (f"{root}/tmp",) * 2 + (root,)


def test_the_mount_point_work_is_checked_and_made_where_it_can_be(tmp_path: Path) -> None:
    """A missing /work is made at start where / is writable; a link or a file in its place, or
    a missing one that cannot be made, stops the agent with the fix (fail closed: no rewrite)."""
    work = tmp_path / "work"
    found = trustedhost._work_mount_point(work, writable=True)
    assert isinstance(found, Ok) and "made at start" in found.detail
    found = trustedhost._work_mount_point(work, writable=False)
    assert isinstance(found, Problem) and found.fatal and "mkdir" in found.fix
    trustedhost.make_work_dir(work)
    assert work.is_dir() and work.stat().st_mode & 0o777 == 0o755
    assert isinstance(trustedhost._work_mount_point(work, writable=False), Ok)
    (work / "mine").write_text("the owner's")
    trustedhost.make_work_dir(work)  # an owner's /work: left as it is
    assert (work / "mine").read_text() == "the owner's"
    link = tmp_path / "link"
    link.symlink_to(work)
    for wrong in (link, work / "mine"):
        found = trustedhost._work_mount_point(wrong, writable=True)
        assert isinstance(found, Problem) and "not a directory" in found.why
    with pytest.raises(PrerequisiteError, match="mkdir -m 0755 /work"):
        trustedhost.make_work_dir(tmp_path / "missing" / "work")
