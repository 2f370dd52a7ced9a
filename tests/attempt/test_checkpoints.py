"""Checkpoint relay and resume: the real coordinator, real agents, real tasks; and the
relay's rules against fakes where a real run would only be slower."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease, trusted_runner
from harness import AgentProcess, CoordinatorServer, argv_job, pid_alive, wait_for

from flashnode.attempt import Attempt, LeaseKeeper
from flashnode.attempt.phases import relay, restore
from flashnode.attempt.record import Staged
from flashnode.coordinator.lease import parse_lease, parse_task
from flashnode.coordinator.messages import CheckpointManifest, CheckpointPart
from flashnode.errors import CheckpointRefused, CoordinatorUnavailable, LeaseLost
from flashnode.runners.base import Runner
from flashnode.sandbox.outputs import list_outputs
from flashnode.sandbox.workspace import Workspace

TASK_PYTHON = os.environ.get("FLASHNODE_TEST_TASK_PYTHON", "/opt/flashnode-task-venv/bin/python")
POOL = "team-ckpt"
TRUSTED = ("--runner", "trusted", "--pool", POOL)
FAST = {
    "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
    "FLASHNODE_CHECKPOINT_SCAN_SECONDS": "0.5",
}


# An argv job without task_params runs its command as given (no str.format of the tokens).


def latest(server: CoordinatorServer, job: str, task: str) -> dict[str, Any] | None:
    r = server.http.get(f"/jobs/{job}/tasks/{task}/checkpoints/latest")
    return dict(r.json()) if r.status_code == 200 else None


def ledger_line(agent: AgentProcess) -> dict[str, Any]:
    return wait_for("the attempt in the ledger", lambda: agent.ledger() and agent.ledger()[-1])


# --- 1. kill and recover: sgd_trainer crashes on node A, resumes on node B ---------------------


def sgd_dataset() -> bytes:
    rng = random.Random(16)
    rows = []
    for _ in range(64):
        x = [rng.uniform(-1, 1) for _ in range(3)]
        rows.append(",".join(f"{v:.6f}" for v in x) + f",{int(x[0] + 0.5 * x[1] > 0)}")
    return ("\n".join(rows) + "\n").encode()


def sgd_job(trial: dict[str, Any], dataset: str) -> dict[str, Any]:
    return {
        "apiVersion": "flashml.dev/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "sgd-resume"},
        "spec": {
            "execution": {"backend": "leases"},
            "image": {"repository": "local/tier1", "tag": "dev"},
            "placement": {"pool": POOL},
            "retryPolicy": {"maxTaskAttempts": 3},
            "workload": {
                "type": "hyperparameter_search",
                "parameters": {
                    "module": "flashml_workloads.sgd_trainer",
                    "trials": [trial],
                    "inputs": {"dataset": dataset},
                    "checkpoint": {"interval_seconds": 60},
                    "lease_seconds": 60,
                },
            },
        },
    }


@pytest.mark.usefixtures("task_python")
def test_a_crashed_run_resumes_on_another_node_and_ends_bit_for_bit_as_an_uninterrupted_one(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    from flashml_workloads.sgd_trainer import run_trainer

    data = sgd_dataset()
    coordinator.put_artifact("shared/sgd.csv", data)
    params = {"steps": 600_000, "checkpoint_every": 50_000, "lr": 0.1, "seed": 0}
    job = coordinator.submit(
        sgd_job({**params, "kill_at_step": 430_000}, "artifact://shared/sgd.csv")
    )
    env = {**FAST, "FLASHNODE_TASK_PYTHON": TASK_PYTHON}

    node_a = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=env, name="a")
    assert node_a.wait(90) == 0, node_a.log
    first = ledger_line(node_a)
    assert first["outcome"] == "failed" and "exit code 3" in first["reason"], first
    assert first["checkpoints_shipped"] >= 2 and first["checkpoint_step"] == 400_000, first
    shipped = latest(coordinator, job, "trial-000")
    assert shipped is not None and shipped["step"] == 400_000
    assert shipped["attempt_id"] == first["lease_id"]

    node_b = start_agent(coordinator.url, *TRUSTED, env=env, name="b")
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    node_b.wait_log("resuming from step 400000")
    second = ledger_line(node_b)
    assert second["outcome"] == "committed" and second["resumed_from_step"] == 400_000
    assert second["lease_id"] != first["lease_id"]

    # The same job, uninterrupted, here.
    (tmp_path / "sgd.csv").write_bytes(data)
    reference = tmp_path / "reference"
    spec = {
        "task_id": "trial-000",
        "params": params,
        "inputs": {"dataset": str(tmp_path / "sgd.csv")},
    }
    expected = run_trainer(spec, reference)
    got = json.loads(coordinator.artifact(f"jobs/{job}/trial-000/metrics.json"))
    assert got.pop("resumed") is True and got.pop("started_from_step") == 400_000
    expected.pop("resumed"), expected.pop("started_from_step")
    assert got == expected
    # Bit for bit: node B's last checkpoint holds the very floats of the uninterrupted run.
    final = latest(coordinator, job, "trial-000")
    assert final is not None and final["attempt_id"] == second["lease_id"]
    assert final["step"] == 550_000
    [part] = final["parts"]
    assert coordinator.artifact(part["key"]) == (reference / "ckpt/step-550000.json").read_bytes()
    # Checkpoints are not outputs: nothing under ckpt/ but the relay's own keys.
    prefix = f"jobs/{job}/trial-000/ckpt/"
    leases = {first["lease_id"], second["lease_id"]}
    for key in coordinator.artifacts(job):
        if key.startswith(prefix):
            assert key[len(prefix) :].split("/")[0] in leases, key


# --- 2. a three-file directory checkpoint from an argv task ------------------------------------

DIRECTORY_TASK = """
import json, os, sys
ckpt, resumed = os.environ["FLASHML_CHECKPOINT_DIR"], os.environ.get("FLASHML_RESUME")
report = {"resume": resumed}
if resumed:
    report["files"] = {
        os.path.relpath(os.path.join(d, n), resumed): open(os.path.join(d, n)).read()
        for d, _, names in os.walk(resumed) for n in names
    }
    try:
        open(os.path.join(resumed, "a.txt"), "a").close()
        report["writable"] = True
    except OSError:
        report["writable"] = False
else:
    tmp = os.path.join(ckpt, ".tmp-step-7")
    os.makedirs(os.path.join(tmp, "sub"))
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        open(os.path.join(tmp, name), "w").write(name * 1000)
    os.rename(tmp, os.path.join(ckpt, "step-7"))
    if not os.path.exists(sys.argv[1]):
        open(sys.argv[1], "w").close()
        sys.exit(3)  # crash once, after the checkpoint is in place
json.dump(report, open("metrics.json", "w"))
"""


def directory_job(marker: Path) -> dict[str, Any]:
    return argv_job(
        ["python3", "-c", DIRECTORY_TASK, str(marker)],
        pool=POOL,
        checkpoint={"interval_seconds": 30},
        max_attempts=2,
    )


def test_a_directory_checkpoint_of_three_files_is_resumed_whole_on_the_second_attempt(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    job = coordinator.submit(directory_job(drop_dir / "crashed-once"))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    first, second = agent.ledger()
    assert first["outcome"] == "failed" and first["checkpoints_shipped"] == 1
    assert second["outcome"] == "committed" and second["resumed_from_step"] == 7
    manifest = latest(coordinator, job, "task-000")
    assert manifest is not None and manifest["attempt_id"] == first["lease_id"]
    assert sorted(p["key"].rsplit("/7/", 1)[1] for p in manifest["parts"]) == [
        "step-7/a.txt",
        "step-7/b.txt",
        "step-7/sub/c.txt",
    ]
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report["resume"].endswith("/inputs/resume/step-7")
    assert report["files"] == {n: n * 1000 for n in ("a.txt", "b.txt", "sub/c.txt")}
    assert report["writable"] is False
    assert "resuming from step 7 (3 file(s), 19000 bytes)" in agent.log
    outputs = [k for k in coordinator.artifacts(job) if k.split("/")[3] not in ("ckpt", "logs")]
    assert outputs == [f"jobs/{job}/task-000/metrics.json"]


def test_a_checkpoint_with_a_corrupted_part_is_not_used_and_the_attempt_starts_from_scratch(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    job = coordinator.submit(directory_job(drop_dir / "crashed-once"))
    first = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, name="first")
    assert first.wait(60) == 0, first.log
    manifest = latest(coordinator, job, "task-000")
    assert manifest is not None and manifest["step"] == 7
    part = next(p for p in manifest["parts"] if p["key"].endswith("/b.txt"))
    coordinator.put_artifact(part["key"], b"b.txt" * 999 + b"EVIL!")  # same size, other bytes

    second = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, name="second")
    assert second.wait(60) == 0, second.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert (
        "checkpoint step 7 is not usable (part step-7/b.txt does not match its sha256);"
        " starting from scratch" in second.log
    )
    assert "resuming from step" not in second.log
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report == {"resume": None}
    assert ledger_line(second)["resumed_from_step"] is None


# --- 3. fencing: a superseded attempt ships nothing more --------------------------------------

STEPS_TASK = """
import json, os, sys, time
ckpt, resumed = os.environ["FLASHML_CHECKPOINT_DIR"], os.environ.get("FLASHML_RESUME")
step = json.load(open(resumed))["step"] if resumed else 0
start = step
pause = float(sys.argv[3] if resumed and len(sys.argv) > 3 else sys.argv[2])
while step < int(sys.argv[1]):
    step += 1
    tmp = os.path.join(ckpt, ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.rename(tmp, os.path.join(ckpt, "step-%d.json" % step))
    time.sleep(pause)
json.dump({"started_from": start, "step": step}, open("metrics.json", "w"))
"""


def test_an_attempt_whose_lease_was_revoked_registers_no_part_and_the_live_one_resumes(
    recording_coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    server = recording_coordinator
    job = server.submit(
        argv_job(
            ["python3", "-c", STEPS_TASK, "150", "0.1", "0.02"],
            pool=POOL,
            checkpoint={"interval_seconds": 30},
            max_attempts=3,
        )
    )
    node_a = start_agent(server.url, *TRUSTED, "--max-tasks", "1", env=FAST, name="a")
    wait_for(
        "node A's second committed checkpoint",
        lambda: (m := latest(server, job, "task-000")) and m["step"] >= 2,
        timeout=30,
    )
    manifest = latest(server, job, "task-000")
    assert manifest is not None
    lease_a = manifest["attempt_id"]
    node_b = start_agent(server.url, *TRUSTED, env=FAST, name="b")
    node_b.wait_log("registered as node")
    r = server.http.post(
        f"/jobs/{job}/tasks/task-000/force-expire", json={"reason": "superseded by the test"}
    )
    assert r.status_code == 200, r.text
    revoked_at = time.time()

    assert server.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert node_a.wait(30) == 0, node_a.log
    assert ledger_line(node_a)["outcome"] == "lost"
    writes = server.requests("/checkpoints/parts") + server.requests("/checkpoints/commit")
    from_a = sorted((w for w in writes if w["body"]["attempt_id"] == lease_a), key=lambda w: w["t"])
    late = [w for w in from_a if w["t"] >= revoked_at]
    assert all(w["status"] == 410 for w in late), late
    assert len(late) <= 1, late  # the relay stops at the first refusal
    committed_a = [
        w["body"]["step"] for w in from_a if w["status"] == 200 and "expected_parts" in w["body"]
    ]
    # The live attempt resumed from what A had committed, and its resume point is its own.
    second = ledger_line(node_b)
    assert second["outcome"] == "committed"
    metrics = json.loads(server.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert metrics["step"] == 150 and metrics["started_from"] == second["resumed_from_step"]
    assert second["resumed_from_step"] == max(committed_a)
    final = latest(server, job, "task-000")
    assert final is not None and final["attempt_id"] == second["lease_id"]
    assert final["step"] == 150


# --- 4. the coordinator's silence watchdog -----------------------------------------------------

SILENT_TASK = "echo $$ > {pidfile}; exec sleep 300"


def test_a_task_that_checkpoints_is_never_revoked_and_a_silent_one_is_stopped(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    policy = {"watchdog_seconds": 20}
    steady = coordinator.submit(
        argv_job(
            ["python3", "-c", STEPS_TASK, "12", "5"],
            pool=POOL,
            checkpoint=policy,
            lease_seconds=30,
        )
    )
    pidfile = drop_dir / "silent.pid"
    silent = coordinator.submit(
        argv_job(
            ["sh", "-c", SILENT_TASK.replace("{pidfile}", str(pidfile))],
            pool=POOL,
            checkpoint=policy,
            lease_seconds=30,
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--slots", "2", env=FAST)
    pid = int(wait_for("the silent task's pid", lambda: pidfile.exists() and pidfile.read_text()))
    revoked = wait_for(
        "the silent task's revocation",
        lambda: [e for e in coordinator.events(silent) if e["type"] == "LEASE_RENEWAL_REFUSED"],
        timeout=45,
    )
    assert "no progress" in revoked[0]["message"]
    wait_for("the silent task to be stopped", lambda: not pid_alive(pid), timeout=5)
    wait_for(
        "the silent attempt in the ledger",
        lambda: any(r["outcome"] == "lost" for r in agent.ledger()),
    )
    coordinator.cancel(silent)
    # `flashnode status` shows the running task's checkpoints as its progress.
    running = wait_for("checkpoints in `flashnode status`", lambda: shipped_in_status(agent))
    assert running["checkpoint_step"] >= 1
    assert coordinator.wait_state(steady, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    events = coordinator.events(steady)
    assert not [e for e in events if e["type"] == "LEASE_RENEWAL_REFUSED"]
    [attempt] = [r for r in agent.ledger() if r["job_id"] == steady]
    assert attempt["outcome"] == "committed" and attempt["checkpoints_shipped"] >= 10
    assert attempt["evidence"]["wall_seconds"] >= 55


def shipped_in_status(agent: AgentProcess) -> dict[str, Any] | None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashnode",
            "status",
            "--json",
            "--state-dir",
            str(agent.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        return None
    for attempt in json.loads(done.stdout).get("running", []):
        if attempt.get("checkpoints"):
            return dict(attempt)
    return None


# --- 5. a 500 MB checkpoint in bounded memory --------------------------------------------------

BIG_TASK = """
import os
ckpt = os.environ["FLASHML_CHECKPOINT_DIR"]
block = bytes(range(256)) * 4096
with open(os.path.join(ckpt, ".tmp"), "wb") as f:
    for _ in range(500):
        f.write(block)
os.rename(os.path.join(ckpt, ".tmp"), os.path.join(ckpt, "step-1.bin"))
open("metrics.json", "w").write("{}")
"""


def test_a_500_mb_checkpoint_is_relayed_in_bounded_memory(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    server = CoordinatorServer(tmp_path / "big", env={"FLASHML_MAX_ARTIFACT_MB": "600"})
    server.root.mkdir()
    server.start()
    try:
        agent = start_agent(server.url, *TRUSTED, env=FAST)
        agent.wait_log("registered as node")
        proc = psutil.Process(agent.proc.pid)
        baseline = proc.memory_info().rss
        peak = [baseline]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], proc.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.05)

        threading.Thread(target=watch, daemon=True).start()
        job = server.submit(argv_job(["python3", "-c", BIG_TASK], pool=POOL, checkpoint={}))
        assert server.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=120) == "SUCCEEDED", (
            agent.log
        )
        stop.set()
        manifest = latest(server, job, "task-000")
        assert manifest is not None and manifest["step"] == 1
        [part] = manifest["parts"]
        digest = hashlib.sha256()
        block = bytes(range(256)) * 4096
        for _ in range(500):
            digest.update(block)
        assert part["size_bytes"] == 500 << 20 and part["sha256"] == digest.hexdigest()
        growth = peak[0] - baseline
        print(f"\nagent RSS growth while relaying a 500 MB checkpoint: {growth >> 20} MB")
        assert growth < 64 << 20
    finally:
        server.close()


# --- the docker runner: the same contract inside a container ----------------------------------

BOX_TASK = """
if [ -n "$FLASHML_RESUME" ]; then
  cat "$FLASHML_RESUME/a" "$FLASHML_RESUME/b" > /work/out/seen.txt
  (touch "$FLASHML_RESUME/x" 2>/dev/null && echo writable || echo read-only) >> /work/out/seen.txt
  echo "{\\"resume\\": \\"$FLASHML_RESUME\\"}" > /work/out/metrics.json
else
  mkdir "$FLASHML_CHECKPOINT_DIR/step-3"
  echo one > "$FLASHML_CHECKPOINT_DIR/step-3/a"
  echo two > "$FLASHML_CHECKPOINT_DIR/step-3/b"
  exit 3
fi
"""


@pytest.mark.usefixtures("image")
def test_a_container_task_checkpoints_and_resumes_under_work(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    from boxes import box_job, start, unique

    job = coordinator.submit(
        box_job(["sh", "-c", BOX_TASK], checkpoint={"interval_seconds": 30}, max_attempts=2)
    )
    agent = start(start_agent, coordinator.url, unique("ckpt"), "--max-tasks", "2", env=FAST)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert coordinator.artifact(f"jobs/{job}/task-000/seen.txt") == b"one\ntwo\nread-only\n"
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report == {"resume": "/work/inputs/resume/step-3"}


# --- the relay's rules, against fakes ---------------------------------------------------------


class Setup:
    """An attempt prepared up to its run, its relay at hand (nothing of it runs on its own)."""

    def __init__(
        self,
        tmp_path: Path,
        latest: CheckpointManifest | None = None,
        uploads: dict[str, bytes] | None = None,
        payload: dict[str, Any] | None = None,
        runner: Runner | None = None,
        **settings: Any,
    ) -> None:
        self.clock = FakeClock()
        self.coord = FakeCoordinator(self.clock, latest=latest)
        self.coord.uploads.update(uploads or {})
        ctx = context(tmp_path, self.clock, self.coord, runner or FakeRunner(), **settings)
        data = lease(**{"checkpoint": {"watchdog_seconds": 60}, **(payload or {})})
        self.a = a = Attempt(ctx, data)
        a.lease = parse_lease(data)
        a.keeper = LeaseKeeper(self.coord, a.lease, self.clock, a._lost)
        self.ws = Workspace.create(tmp_path / "attempts", a.lease.lease_id)
        self.ws.task_uid = os.geteuid()
        a.staged = Staged(a.lease, parse_task(a.lease), self.ws)
        self.contributed = restore.run(a, a.staged)
        [r] = a.during_run
        assert isinstance(r, relay.Relay)
        self.relay = r
        self.ckpt = self.ws.out / "ckpt"

    def write(self, name: str, data: bytes = b"x") -> None:
        path = self.ckpt / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def commits(self) -> list[int]:
        return [arg[1] for _, name, arg in self.coord.calls if name == "checkpoint_commit"]

    def calls(self, prefix: str) -> int:
        return len([c for c in self.coord.calls if c[1].startswith(prefix)])


def test_relay_ships_the_newest_complete_checkpoint_and_keeps_only_it(tmp_path: Path) -> None:
    t = Setup(tmp_path)
    assert t.contributed.env == {"FLASHML_CHECKPOINT_DIR": "/work/out/ckpt"}
    t.write("step-1.json")
    t.relay.sweep()
    assert t.commits() == []  # seen once: it may still be being written
    t.write(".step-3.tmp", b"partial")  # a temporary is no checkpoint
    t.relay.sweep()
    assert t.commits() == [1]
    t.write("step-2.json")
    t.write("step-3/a.bin", b"a")
    t.write("step-3/deep/b.bin", b"bb")
    t.write("step-4.json", b"being written")
    t.relay.sweep()
    # step-3 is complete (a newer one exists), step-4 not yet; 1 and 2 are deleted.
    assert t.commits() == [1, 3]
    assert sorted(p.name for p in t.ckpt.iterdir()) == [".step-3.tmp", "step-3", "step-4.json"]
    (_, _, (lease_id, step, parts, prefix, world_size, framework)) = next(
        c for c in reversed(t.coord.calls) if c[1] == "checkpoint_commit"
    )
    assert step == 3 and prefix == f"artifact://jobs/j1/task-000/ckpt/{lease_id}/3/"
    assert (world_size, framework) == (1, "")
    assert [p.key.removeprefix(prefix[len("artifact://") :]) for p in parts] == [
        "step-3/a.bin",
        "step-3/deep/b.bin",
    ]
    assert t.coord.uploads[parts[1].key] == b"bb"
    assert parts[1].sha256 == hashlib.sha256(b"bb").hexdigest() and parts[1].size_bytes == 2
    assert t.a.record.checkpoints_shipped == 2 and t.a.record.checkpoint_step == 3
    t.relay.finish(t.a)  # the task exited: step-4 is as complete as it will ever be
    assert t.commits() == [1, 3, 4]
    snapshot = t.a.snapshot()
    assert snapshot["checkpoints"] == 3 and snapshot["checkpoint_step"] == 4
    # Not outputs: the output walk at commit does not see them.
    (t.ws.out / "metrics.json").write_text("{}")
    assert [f.rel for f in list_outputs(t.ws, 1 << 20, 1 << 20)] == ["metrics.json"]


def test_relay_keeps_running_past_a_409_and_a_transport_error(tmp_path: Path) -> None:
    t = Setup(tmp_path)
    t.coord.checkpoint_errors = [None, CheckpointRefused("checkpoint commit: 409 missing", 409)]
    t.write("step-1.json")
    t.write("step-2.json")
    t.relay.sweep()  # 1 is refused: that checkpoint does not exist
    assert t.a.record.checkpoints_shipped == 0
    t.coord.checkpoint_errors = [CoordinatorUnavailable("checkpoint part: 503")]
    t.write("step-3.json")
    t.relay.sweep()  # 2 meets a transport error: the next one supersedes it
    assert t.a.record.checkpoints_shipped == 0
    t.write("step-4.json")
    t.relay.sweep()
    assert t.commits()[-1] == 3 and t.a.record.checkpoint_step == 3
    assert t.a.keeper is not None and not t.a.keeper.lost.is_set()
    assert t.a.cancelled is None and not t.a.stop.is_set()


def test_relay_stops_the_attempt_at_the_first_410_and_writes_nothing_more(tmp_path: Path) -> None:
    t = Setup(tmp_path)
    t.write("step-1/a")
    t.write("step-1/b")
    t.write("step-2.json")
    t.coord.checkpoint_errors = [LeaseLost("checkpoint part: 410 lease is no longer live", 410)]
    t.relay.sweep()
    assert t.calls("checkpoint_part") == 1 and t.commits() == []
    assert t.a.keeper is not None and t.a.keeper.lost.is_set() and t.a.stop.is_set()
    assert "410" in t.a.keeper.reason
    uploads = t.calls("upload")
    t.write("step-3.json")
    t.relay.sweep()
    t.relay.finish(t.a)  # no last sweep for a lost lease
    assert t.calls("checkpoint_") == 2 and t.calls("upload") == uploads  # latest, one part


def test_relay_refuses_a_checkpoint_holding_a_link_or_too_large_and_deletes_no_target(
    tmp_path: Path,
) -> None:
    t = Setup(tmp_path, max_checkpoint_bytes=100)
    secret = tmp_path / "secret"
    secret.write_text("the owner's")
    (t.ckpt / "step-1").mkdir()
    (t.ckpt / "step-1" / "a").symlink_to(secret)
    t.relay.finish(t.a)
    t.write("step-2.bin", b"x" * 101)
    t.relay.finish(t.a)
    t.write("step-3.bin", b"x" * 100)
    t.relay.finish(t.a)
    assert t.commits() == [3]
    assert not [k for k in t.coord.uploads if "step-1" in k or "step-2" in k]
    assert sorted(p.name for p in t.ckpt.iterdir()) == ["step-3.bin"]
    assert secret.read_text() == "the owner's"


def test_relay_ships_nothing_through_a_planted_link_or_of_another_user(tmp_path: Path) -> None:
    t = Setup(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step-1.json").write_text("the owner's")
    t.ckpt.rmdir()
    t.ckpt.symlink_to(elsewhere)
    t.relay.finish(t.a)
    assert t.calls("upload") == 0 and (elsewhere / "step-1.json").exists()
    if os.geteuid() == 0:  # a file the task's user did not write (a hard link, say)
        t.ckpt.unlink()
        t.write("step-2.json")
        os.chown(t.ckpt / "step-2.json", 65534, 65534)
        t.relay.finish(t.a)
        assert t.calls("upload") == 0


def test_checkpoints_past_their_disk_allowance_stop_the_task(tmp_path: Path) -> None:
    t = Setup(tmp_path, max_checkpoint_bytes=100)
    t.write(".tmp", b"x" * 401)
    t.relay.sweep()
    assert t.a.cancelled is not None and "grew past 400 bytes" in str(t.a.cancelled)


PREFIX = "jobs/j1/task-000/ckpt/ls-old/5/"
FILES = {"step-5/w.bin": b"weights", "step-5/opt/m.bin": b"moments"}


def manifest(size: int | None = None, key: str | None = None, prefix: str = PREFIX) -> Any:
    parts = [
        CheckpointPart(
            key=key or PREFIX + rel,
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data) if size is None else size,
        )
        for rel, data in FILES.items()
    ]
    return CheckpointManifest(step=5, storage_prefix="artifact://" + prefix, parts=parts)


def resumed(tmp_path: Path, m: CheckpointManifest, **uploads: bytes) -> Setup:
    store = {PREFIX + rel: data for rel, data in FILES.items()}
    store.update({PREFIX + rel: data for rel, data in uploads.items()})
    module = {"module": "flashml_workloads.sgd_trainer", "argv": None, "checkpoint": {}}
    return Setup(tmp_path, latest=m, uploads=store, payload=module)


def test_resume_reads_a_single_file_checkpoint_of_flashnode_0_4(tmp_path: Path) -> None:
    key = "jobs/j1/task-000/ckpt/step-5.json"
    old = CheckpointManifest(
        step=5,
        storage_prefix="artifact://jobs/j1/task-000/ckpt/5/",
        parts=[CheckpointPart(key=key, sha256=hashlib.sha256(b"{}").hexdigest(), size_bytes=2)],
    )
    t = Setup(tmp_path, latest=old, uploads={key: b"{}"})
    assert t.contributed.env["FLASHML_RESUME"] == "/work/inputs/resume/step-5.json"
    assert (t.ws.inputs / "resume/step-5.json").read_bytes() == b"{}"


def test_resume_fetches_a_checkpoint_whose_parts_hold_up(tmp_path: Path) -> None:
    t = resumed(tmp_path, manifest())
    assert t.contributed.env["FLASHML_RESUME"] == "/work/inputs/resume/step-5"
    assert t.contributed.module_inputs == {"resume": "/work/inputs/resume/step-5"}
    assert t.a.record.resumed_from_step == 5
    assert (t.ws.inputs / "resume/step-5/opt/m.bin").read_bytes() == b"moments"
    assert not (t.ws.stage / "resume").exists()


@pytest.mark.parametrize(
    ("name", "m", "store", "why"),
    [
        ("altered", manifest(), {"step-5/w.bin": b"WEIGHTS"}, "step-5/w.bin does not match its"),
        ("resized", manifest(size=6), {}, "has 7 bytes, not 6"),
        ("elsewhere", manifest(key="jobs/other/x.bin"), {}, "not under the task's output prefix"),
        ("two-tops", manifest(prefix="elsewhere/"), {}, "not one checkpoint"),
    ],
)
def test_resume_starts_from_scratch_from_a_manifest_that_does_not_hold_up(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    name: str,
    m: CheckpointManifest,
    store: dict[str, bytes],
    why: str,
) -> None:
    t = resumed(tmp_path, m, **store)
    assert "FLASHML_RESUME" not in t.contributed.env
    assert t.contributed.module_inputs == {} and t.a.record.resumed_from_step is None
    assert not (t.ws.inputs / "resume").exists() and not (t.ws.stage / "resume").exists()
    assert "checkpoint step 5 is not usable" in caplog.text and why in caplog.text
    assert "starting from scratch" in caplog.text


# --- flashruntime's manifest layout, against fakes ----------------------------------------------


def write_step(t: Setup, name: str, files: dict[str, bytes], **manifest: Any) -> Path:
    """A checkpoint the way flashruntime's write_manifest writes one: parts, then the manifest
    (``manifest`` overrides what it would say)."""
    from flashruntime.checkpoint.local import write_manifest

    d = t.ckpt / name
    d.mkdir(parents=True)
    for rel, data in files.items():
        (d / rel).write_bytes(data)
    number = name.split("-", 1)[1]
    step = int(number) if number.isdigit() else 0
    write_manifest(d, job_id="j1", attempt_id="a", step=step, framework="pytorch-2.13.0")
    if manifest:
        body = json.loads((d / "manifest.json").read_text())
        body.update(manifest)
        (d / "manifest.json").write_text(json.dumps(body))
    return d


def commit_args(t: Setup) -> list[tuple[Any, ...]]:
    return [arg for _, name, arg in t.coord.calls if name == "checkpoint_commit"]


def test_relay_ships_a_manifest_checkpoint_at_once_as_the_parts_it_lists_and_its_manifest(
    tmp_path: Path,
) -> None:
    t = Setup(tmp_path)
    assert t.contributed.env == {"FLASHML_CHECKPOINT_DIR": "/work/out/ckpt"}
    d = write_step(t, "step-000010", {"model.pt": b"weights", "optimizer.pt": b"moments"})
    (d / "notes.txt").write_text("written after the manifest: not one of its parts")
    t.relay.sweep()  # complete once its manifest is there: no second look
    [(lease_id, step, parts, prefix, world_size, framework)] = commit_args(t)
    assert step == 10 and (world_size, framework) == (1, "pytorch-2.13.0")
    base = prefix.removeprefix("artifact://")
    assert base == f"jobs/j1/task-000/ckpt/{lease_id}/10/"
    assert sorted(p.key.removeprefix(base) for p in parts) == [
        "step-000010/manifest.json",
        "step-000010/model.pt",
        "step-000010/optimizer.pt",
    ]
    assert t.coord.uploads[base + "step-000010/model.pt"] == b"weights"
    assert not [k for k in t.coord.uploads if k.endswith("notes.txt")]
    assert t.a.record.checkpoint_step == 10


def test_relay_takes_the_step_world_size_and_framework_from_the_manifest(tmp_path: Path) -> None:
    t = Setup(tmp_path)
    write_step(t, "checkpoint-final", {"w": b"w"}, step=1234, world_size=4, framework="deepspeed")
    t.relay.sweep()
    [(_, step, _, prefix, world_size, framework)] = commit_args(t)
    assert (step, world_size, framework) == (1234, 4, "deepspeed")
    assert prefix.endswith("/1234/")


def test_a_manifest_being_written_waits_and_a_half_written_step_of_a_crash_is_never_shipped(
    tmp_path: Path,
) -> None:
    t = Setup(tmp_path)
    write_step(t, "step-000010", {"model.pt": b"10"})
    d = write_step(t, "step-000020", {"model.pt": b"20"})
    whole = (d / "manifest.json").read_bytes()
    (d / "manifest.json").write_bytes(whole[: len(whole) // 2])  # written last, not at once
    t.relay.sweep()
    assert [a[1] for a in commit_args(t)] == [10]
    (d / "manifest.json").write_bytes(whole)
    t.relay.sweep()
    assert [a[1] for a in commit_args(t)] == [10, 20]
    # The task dies while writing step 30: parts, no manifest. Once a task has shown that it
    # writes manifests, a directory without one is not a checkpoint, even at its end.
    (t.ckpt / "step-000030").mkdir()
    (t.ckpt / "step-000030" / "model.pt").write_bytes(b"half")
    t.relay.finish(t.a)
    assert [a[1] for a in commit_args(t)] == [10, 20]
    assert t.a.record.checkpoint_step == 20


def test_a_step_directory_is_not_taken_as_complete_while_its_manifest_may_still_come(
    tmp_path: Path,
) -> None:
    """flashruntime.torch.checkpoint writes its parts into step-NNNNNN/ itself, then hashes them
    (seconds, for a large model) and writes the manifest: a directory that stays unchanged over
    a scan is no complete checkpoint."""
    t = Setup(tmp_path)
    (t.ckpt / "step-000010").mkdir()
    (t.ckpt / "step-000010" / "model.pt").write_bytes(b"10")
    t.relay.sweep()
    t.relay.sweep()
    assert commit_args(t) == []
    write_step(t, "step-000010-tmp", {"model.pt": b"10"}, step=10)  # its manifest, made aside
    (t.ckpt / "step-000010-tmp" / "manifest.json").rename(t.ckpt / "step-000010" / "manifest.json")
    t.relay.sweep()
    [(_, step, parts, _, _, _)] = commit_args(t)
    assert step == 10 and sorted(p.key.rsplit("/", 1)[1] for p in parts) == [
        "manifest.json",
        "model.pt",
    ]


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("../../../../../etc/passwd", "is not the name of a file beside the manifest"),
        ("/etc/passwd", "is not the name of a file beside the manifest"),
        ("sub/model.pt", "is not the name of a file beside the manifest"),
        ("manifest.json", "is not the name of a file beside the manifest"),
        ("..", "is not the name of a file beside the manifest"),
    ],
)
def test_a_manifest_naming_a_path_outside_its_directory_ships_and_reads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, why: str
) -> None:
    t = Setup(tmp_path)
    (t.ckpt / "sub").mkdir()
    (t.ckpt / "sub" / "model.pt").write_bytes(b"not in the checkpoint's directory")
    passwd = Path("/etc/passwd").read_bytes()
    part = {"key": key, "sha256": hashlib.sha256(passwd).hexdigest(), "size_bytes": len(passwd)}
    write_step(t, "step-000005", {"model.pt": b"m"}, parts=[part])
    t.relay.finish(t.a)
    assert t.calls("upload") == 0 and commit_args(t) == []
    assert "ckpt/step-000005 is not shipped: its manifest.json cannot be used" in caplog.text
    assert why in caplog.text


def test_a_manifests_storage_prefix_is_never_read_from(tmp_path: Path) -> None:
    t = Setup(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.pt").write_bytes(b"the owner's")
    write_step(t, "step-000005", {"model.pt": b"mine"}, storage_prefix=str(elsewhere))
    t.relay.sweep()
    [(_, _, parts, _, _, _)] = commit_args(t)
    [model] = [p for p in parts if p.key.endswith("/model.pt")]
    assert t.coord.uploads[model.key] == b"mine"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"step": -1}, "its step is not a whole number"),
        ({"step": "5"}, "its step is not a whole number"),
        ({"world_size": 0}, "its world_size is not a whole number"),
        ({"framework": "x\x1b[2J"}, "its framework is not a printable name"),
        ({"parts": []}, "it lists no parts"),
        ({"storage_prefix": 7}, "its storage_prefix is not a string"),
        ({"padding": "x" * (1 << 20)}, "it is larger than 1048576 bytes"),
    ],
)
def test_a_manifest_out_of_shape_is_not_shipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict[str, Any], why: str
) -> None:
    t = Setup(tmp_path)
    write_step(t, "step-000005", {"model.pt": b"m"}, **change)
    t.relay.finish(t.a)
    assert t.calls("upload") == 0 and commit_args(t) == []
    assert why in caplog.text


def test_a_manifest_whose_parts_do_not_hold_up_is_not_shipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = Setup(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("the owner's")
    d = write_step(t, "step-000001", {"model.pt": b"m"})
    (d / "model.pt").write_bytes(b"m" * 9)  # its size no longer the manifest's
    t.relay.finish(t.a)
    d = write_step(t, "step-000002", {"model.pt": b"m"})
    (d / "model.pt").write_bytes(b"M")  # same size, other bytes
    t.relay.finish(t.a)
    d = write_step(t, "step-000003", {"model.pt": b"the owner's"})
    (d / "model.pt").unlink()
    (d / "model.pt").symlink_to(secret)
    t.relay.finish(t.a)
    if os.geteuid() == 0:  # a part the task's user did not write (a hard link, say)
        d = write_step(t, "step-000004", {"model.pt": b"m"})
        os.chown(d / "model.pt", 65534, 65534)
        t.relay.finish(t.a)
        assert "its part 'model.pt' was not written by the task" in caplog.text
    assert commit_args(t) == [] and t.calls("checkpoint_part") == 0
    assert "its part 'model.pt' holds 9 bytes, not 1" in caplog.text
    assert "its part 'model.pt' does not match the sha256 of its manifest" in caplog.text
    assert "its part 'model.pt' is not a regular file" in caplog.text
    assert not [k for k, v in t.coord.uploads.items() if v == b"the owner's"]
    assert secret.read_text() == "the owner's"


def flashruntime_manifest(
    name: str, files: dict[str, bytes], step: int, storage_prefix: str
) -> tuple[CheckpointManifest, dict[str, bytes]]:
    """What the coordinator answers for a checkpoint another attempt shipped in flashruntime's
    layout, and the store's bytes."""
    parts = [
        {"key": rel, "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
        for rel, data in files.items()
    ]
    body = {
        "manifest_id": "ck-x",
        "job_id": "j1",
        "attempt_id": "ls-old",
        "step": step,
        "framework": "pytorch-2.13.0",
        "world_size": 1,
        "compatible_world_sizes": [1],
        "storage_prefix": storage_prefix,
        "parts": parts,
        "validation": "hash_verified",
    }
    store = {**files, "manifest.json": json.dumps(body, indent=2).encode()}
    prefix = f"jobs/j1/task-000/ckpt/ls-old/{step}/"
    keys = {f"{prefix}{name}/{rel}": data for rel, data in store.items()}
    m = CheckpointManifest(
        step=step,
        storage_prefix=f"artifact://{prefix}",
        parts=[
            CheckpointPart(key=k, sha256=hashlib.sha256(v).hexdigest(), size_bytes=len(v))
            for k, v in keys.items()
        ],
    )
    return m, keys


def test_resume_restores_a_manifest_checkpoint_into_the_checkpoint_directory_for_the_task(
    tmp_path: Path,
) -> None:
    from flashruntime.checkpoint.local import latest_valid_manifest

    files = {"model.pt": b"weights", "optimizer.pt": b"moments"}
    # Written on another node, whose task saw its checkpoint directory somewhere else.
    m, store = flashruntime_manifest(
        "step-000030", files, 30, "/var/lib/flashnode/attempts/ls-old/out/ckpt/step-000030"
    )
    t = Setup(tmp_path, latest=m, uploads=store, runner=trusted_runner())
    restored = t.ckpt / "step-000030"
    assert t.contributed.env["FLASHML_RESUME"] == "/work/out/ckpt/step-000030"
    assert t.a.record.resumed_from_step == 30
    assert not (t.ws.inputs / "resume").exists() and not (t.ws.stage / "resume").exists()
    # Where flashruntime's picker looks, its storage_prefix naming where it lies now (this
    # runner shows the task the workspace at its host path).
    found = latest_valid_manifest(t.ckpt)
    assert found is not None and found.step == 30 and found.storage_prefix == str(restored)
    assert (restored / "model.pt").read_bytes() == b"weights"
    # The relay never ships it back; what the task writes after it is shipped.
    t.relay.sweep()
    assert commit_args(t) == []
    write_step(t, "step-000040", {"model.pt": b"40"})
    t.relay.sweep()
    assert [a[1] for a in commit_args(t)] == [40]
    assert not restored.exists()  # older than the newest shipped: deleted like any other


def test_resume_in_a_container_keeps_the_work_path_of_a_manifest_checkpoint(
    tmp_path: Path,
) -> None:
    files = {"model.pt": b"weights"}
    m, store = flashruntime_manifest("step-000030", files, 30, "/work/out/ckpt/step-000030")
    t = Setup(tmp_path, latest=m, uploads=store)
    written = t.coord.uploads[m.parts[-1].key]
    assert (t.ckpt / "step-000030" / "manifest.json").read_bytes() == written  # as shipped


@pytest.mark.usefixtures("as_root")
def test_a_restored_checkpoint_belongs_to_the_task_user_who_may_delete_it(tmp_path: Path) -> None:
    m, store = flashruntime_manifest("checkpoint-3", {"model.safetensors": b"w"}, 3, "x")
    t = Setup(tmp_path, latest=m, uploads=store)
    t.ws.hand_over(65534, 65534, inputs_for="everyone")
    tree = [t.ckpt, t.ckpt / "checkpoint-3", *(t.ckpt / "checkpoint-3").iterdir()]
    assert {(p.lstat().st_uid, p.lstat().st_gid) for p in tree} == {(65534, 65534)}


def test_resume_starts_from_scratch_from_a_manifest_that_does_not_match_its_parts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = {"model.pt": b"weights"}
    m, store = flashruntime_manifest("step-000030", files, 30, "/work/out/ckpt/step-000030")
    key = next(k for k in store if k.endswith("/manifest.json"))
    body = json.loads(store[key])
    body["parts"][0]["sha256"] = "0" * 64  # shipped with other bytes than it names
    store[key] = json.dumps(body).encode()
    m.parts[-1].sha256 = hashlib.sha256(store[key]).hexdigest()
    m.parts[-1].size_bytes = len(store[key])
    t = Setup(tmp_path, latest=m, uploads=store)
    assert "FLASHML_RESUME" not in t.contributed.env
    assert list(t.ckpt.iterdir()) == [] and not (t.ws.stage / "resume").exists()
    assert "its part 'model.pt' does not match its manifest" in caplog.text
