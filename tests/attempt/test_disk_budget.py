"""What a job brings cannot fill the owner's disk nor bench the node: every input and every
checkpoint the agent writes for an attempt takes its room from the attempt's disk budget before
it is written. Real coordinator, real agent, the state dir on a small tmpfs; each test is the
attack."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from harness import API, AgentProcess, CoordinatorServer, argv_job, lowest_free, tmpfs_disk

POOL = "team-a"
TRUSTED = ("--runner", "trusted", "--pool", POOL)
MiB = 1 << 20
# Quarantine at the first ending the guard counts: a disk reason it must not count shows at once.
ENV = {
    "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
    "FLASHNODE_MIN_FREE_BYTES": "100M",
    "FLASHNODE_QUARANTINE_AFTER": "1",
}
COMMITS = ["sh", "-c", "echo '{}' > metrics.json"]  # a task's cwd is its out/
EMPTY = hashlib.sha256(b"").hexdigest()


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """400 MiB and 40,000 inodes standing in for the owner's disk (its floor: 100 MiB and
    10,000 inodes)."""
    with tmpfs_disk("flashnode-budget-", "size=400m,nr_inodes=40000") as mount:
        yield mount


def first_attempt_plants(
    coordinator: CoordinatorServer, job: str, parts: list[tuple[str, str, int]]
) -> None:
    """The job's first attempt, as a hostile task would do it with its own live lease: a bare
    client claims the task, registers a checkpoint of ``parts`` (name under the checkpoint's
    prefix, sha256, size) and fails."""
    with httpx.Client(base_url=coordinator.url + API, timeout=30) as c:
        node = f"hostile-{random.randrange(10**9)}"
        c.post(
            "/nodes/register",
            json={
                "node_id": node,
                "kubernetes_node": "",
                "hostname": "hostile",
                "capabilities": {"pools": [POOL]},
                "unsandboxed_argv_capable": True,
                "module_capable": False,
            },
        ).raise_for_status()
        claimed = c.post("/leases/claim", json={"node_id": node})
        assert claimed.status_code == 200, claimed.text
        lease = claimed.json()
        task, lease_id = lease["task_id"], lease["lease_id"]
        prefix = f"jobs/{job}/{task}/ckpt/{lease_id}/5/"
        expected = [
            {"key": prefix + name, "sha256": sha, "size_bytes": size} for name, sha, size in parts
        ]
        base = f"/jobs/{job}/tasks/{task}/checkpoints"
        for part in expected:
            c.post(
                base + "/parts", json={"attempt_id": lease_id, "step": 5, "part": part}
            ).raise_for_status()
        c.post(
            base + "/commit",
            json={
                "attempt_id": lease_id,
                "step": 5,
                "expected_parts": expected,
                "storage_prefix": "artifact://" + prefix,
            },
        ).raise_for_status()
        c.post(f"/attempts/{lease_id}/fail", json={"reason": "exit 1"}).raise_for_status()


def checkpoint_job(command: list[str]) -> dict[str, object]:
    return argv_job(command, pool=POOL, checkpoint={"interval_seconds": 30}, max_attempts=3)


def assert_not_benched(agent: AgentProcess, coordinator: CoordinatorServer) -> None:
    """Not quarantined, and the next job commits on the node."""
    assert "quarantined" not in agent.log, agent.log
    job = coordinator.submit(argv_job(COMMITS, pool=POOL))
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED", (
        agent.log
    )
    assert "quarantined" not in agent.log, agent.log


def test_a_checkpoint_of_many_deep_parts_is_not_restored_and_the_task_starts_from_scratch(
    small_disk: Path, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """70 empty parts, each 700 directories deep (49,000 directories, more than the disk's
    inodes): refused before a directory is made, as the relay would refuse to ship it; the
    attempt runs from scratch and commits."""
    job = coordinator.submit(checkpoint_job(COMMITS))
    deep = "/".join(["d"] * 700)
    first_attempt_plants(coordinator, job, [(f"step-5/p{i}/{deep}/f", EMPTY, 0) for i in range(70)])
    agent = start_agent(coordinator.url, *TRUSTED, env=ENV, state_dir=small_disk / "state")
    with lowest_free(small_disk, agent.done) as lowest:
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    assert lowest.inodes >= 10_000, f"the restore left {lowest.inodes} free inodes"
    assert "lies deeper than 16 directories" in agent.log
    assert "starting from scratch" in agent.log
    [line] = agent.ledger()
    assert line["outcome"] == "committed" and line["resumed_from_step"] is None
    assert_not_benched(agent, coordinator)


def test_a_checkpoint_larger_than_the_room_above_the_floor_is_never_written_and_the_node_goes_on(
    small_disk: Path, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Three 120 MiB parts (360 MiB, within max_checkpoint_bytes and task_disk_bytes) on a disk
    with 300 MiB above its floor: weighed whole before its first byte, the node's shortage (the
    lease lapses, never "disk full"), the floor holds, the node is not quarantined."""
    job = coordinator.submit(checkpoint_job(COMMITS))
    part = bytes(120 * MiB)
    sha = hashlib.sha256(part).hexdigest()
    task = coordinator.tasks(job)[0]["task_id"]
    names = [f"step-5/w{i}.bin" for i in range(3)]
    planted: list[tuple[str, str, int]] = [(n, sha, len(part)) for n in names]
    first_attempt_plants(coordinator, job, planted)
    manifest = coordinator.http.get(f"/jobs/{job}/tasks/{task}/checkpoints/latest").json()
    for p in manifest["parts"]:
        coordinator.put_artifact(p["key"], part)
    del part
    agent = start_agent(coordinator.url, *TRUSTED, env=ENV, state_dir=small_disk / "state")
    with lowest_free(small_disk, agent.done) as lowest:
        [line] = agent.wait_ledger(1, timeout=90)
    coordinator.cancel(job)
    assert line["outcome"] == "lapsed", line
    assert "low disk: the checkpoint of step 5 does not fit" in line["reason"], line["reason"]
    assert "disk full" not in agent.log
    assert lowest.bytes >= 100 * MiB, f"the restore left {lowest.bytes} bytes free"
    assert_not_benched(agent, coordinator)


def test_inputs_larger_than_the_room_above_the_floor_stop_at_it_and_the_task_is_not_taken_back(
    small_disk: Path, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Two plain inputs of 170 MiB on a disk with 300 MiB above its floor: the second stops at
    the floor while it downloads, the lease lapses as the node's shortage, and the node holds
    its claims for a while rather than take the same task straight back: at most two claims of
    it in a minute. Then the next job commits."""
    blob = bytes(170 * MiB)
    coordinator.put_artifact("big/a.bin", blob)
    coordinator.put_artifact("big/b.bin", blob)
    del blob
    job = coordinator.submit(
        argv_job(
            COMMITS,
            pool=POOL,
            max_attempts=1,
            lease_seconds=30,  # back on offer 30 s after each lapse, the coordinator's least
            inputs={"a": "artifact://big/a.bin", "b": "artifact://big/b.bin"},
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, env=ENV, state_dir=small_disk / "state")
    t0 = time.monotonic()
    with lowest_free(small_disk, agent.done) as lowest:
        agent.wait_ledger(1, timeout=60)
        time.sleep(max(0.0, 60 - (time.monotonic() - t0)))  # the minute the claims are counted
    coordinator.cancel(job)
    lines = agent.ledger()
    assert 1 <= len(lines) <= 2, [(x["outcome"], x["reason"]) for x in lines]
    for line in lines:
        assert line["outcome"] == "lapsed" and "low disk: input b" in line["reason"], line
    assert "disk full" not in agent.log
    assert "not claiming for up to" in agent.log  # the hold, not the lease's expiry alone
    assert lowest.bytes >= 100 * MiB, f"the inputs left {lowest.bytes} bytes free"
    assert_not_benched(agent, coordinator)
