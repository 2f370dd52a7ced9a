"""A task's disk is bounded like its memory: everything it can write
(out/, tmp/ its HOME and TMPDIR, its private /tmp, files it removed but keeps open; a
container's /tmp and /work/out) counts against ``task_disk_bytes``, watched while it runs; the
files and directories it makes in out/ and tmp/ against ``task_disk_files`` (or the inodes the
disk has free above min_free_bytes' share); its outputs may hold at most ``max_output_files``
files. However the task shapes its tree, the walk counts all of it. Past a cap the task is
stopped and fails with the reason, and nothing of it is uploaded. Real agents, the real
coordinator, real tasks as the slot's user."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import AgentProcess, CoordinatorServer, argv_job, lowest_free, tmpfs_disk

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
CAPPED = {**FAST, "FLASHNODE_TASK_DISK_BYTES": "50M", "FLASHNODE_MAX_OUTPUT_TOTAL_BYTES": "50M"}

# Writes WHERE:MB ... (WHERE: a directory, or TMPDIR) in 4 MB steps, printing the MB written so
# far; then, with --hide, removes what it wrote but keeps it open; then sleeps SECONDS (--sleep)
# and writes metrics.json. No braces: the coordinator formats a command with the task's params.
FILL = r"""
import json, os, sys, time
args = sys.argv[1:]
hide = '--hide' in args
pause = float(args[args.index('--sleep') + 1]) if '--sleep' in args else 0.0
held, done = [], 0
for spec in [a for a in args if ':' in a]:
    where, mb = spec.rsplit(':', 1)
    where = os.environ['TMPDIR'] if where == 'TMPDIR' else where
    path = os.path.join(where, 'fill-%d.bin' % len(held))
    f = open(path, 'wb')
    for _ in range(int(mb) // 4):
        f.write(b'x' * (4 << 20))
        f.flush()
        done += 4
        print(done, flush=True)
        time.sleep(0.02)
    if hide:
        os.unlink(path)
    held.append(f)
time.sleep(pause)
print('done', flush=True)
json.dump(dict(written=done), open('metrics.json', 'w'))
"""


def run_one(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    args: list[str],
    env: dict[str, str] | None = None,
) -> tuple[str, list[str], list[str]]:
    """Run one FILL task: its job's state, its failure reasons, and what it printed."""
    job = coordinator.submit(argv_job(["python3", "-c", FILL, *args], max_attempts=1))
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "1", env={**CAPPED, **(env or {})}
    )
    assert agent.wait(90) == 0, agent.log
    state = coordinator.wait_state(job, {"SUCCEEDED", "FAILED"})
    reasons = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    printed = coordinator.artifact(f"jobs/{job}/task-000/logs/stdout.txt").decode().split()
    if state == "FAILED":
        assert not any(k.endswith("metrics.json") for k in coordinator.artifacts(job))
    return state, reasons, printed


def test_a_task_writing_400_mb_into_its_tmp_under_a_50_mb_cap_is_stopped_and_fails(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Stopped by whichever comes first: the watch (the reason then adds "the task was
    stopped"), or the kernel refusing the file's growth past the cap (RLIMIT_FSIZE), after which
    the look at its end finds it at the cap. Either way it fails, naming the cap."""
    state, [reason], printed = run_one(coordinator, start_agent, ["TMPDIR:400"])
    assert state == "FAILED"
    assert "grew past 50 MiB (task_disk_bytes" in reason, reason
    assert "done" not in printed and int(printed[-1]) < 200, printed[-3:]


def test_a_file_removed_but_kept_open_still_counts(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    state, [reason], printed = run_one(
        coordinator, start_agent, ["TMPDIR:80", "--hide", "--sleep", "20"]
    )
    assert state == "FAILED" and "task_disk_bytes" in reason, reason
    assert "done" not in printed


@pytest.mark.usefixtures("as_root")
def test_the_private_tmp_counts_against_the_cap(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    state, [reason], printed = run_one(
        coordinator, start_agent, ["/tmp:28", "/dev/shm:28", "--sleep", "20"]
    )
    assert state == "FAILED" and "task_disk_bytes" in reason, reason
    assert "done" not in printed


def test_a_task_writing_within_its_cap_commits(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    spread = ["TMPDIR:20", ".:8", *(["/tmp:8"] if os.geteuid() == 0 else [])]
    state, reasons, printed = run_one(coordinator, start_agent, spread)
    assert state == "SUCCEEDED" and reasons == [], reasons
    assert printed[-1] == "done"


def test_twenty_thousand_empty_output_files_fail_without_being_uploaded(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    many = (
        "import json\n"
        "for i in range(20000): open('f%05d' % i, 'w').close()\n"
        "json.dump(dict(files=20000), open('metrics.json', 'w'))\n"
    )
    job = coordinator.submit(argv_job(["python3", "-c", many], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    [reason] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "outputs grew past 5000 files (max_output_files)" in reason, reason
    assert not any(
        "/f0" in key or key.endswith("metrics.json") for key in coordinator.artifacts(job)
    )


@pytest.mark.usefixtures("as_root")
def test_a_containers_tmp_and_outputs_count_against_the_cap(
    box: str, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    from boxes import box_job, unique

    fill = (
        "head -c 31457280 /dev/zero > /tmp/a && head -c 31457280 /dev/zero > /work/out/b"
        " && echo written && sleep 20 && printf '\\173\\175' > /work/out/metrics.json"
    )
    job = coordinator.submit(box_job(["sh", "-c", fill], image=box, max_attempts=1))
    env = {**CAPPED, "FLASHNODE_ALLOWED_IMAGES": box}
    agent = start_agent(
        coordinator.url,
        "--runner",
        "docker",
        "--node-id",
        unique("disk"),
        "--max-tasks",
        "1",
        env=env,
    )
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED", agent.log
    [reason] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "task_disk_bytes" in reason and "was stopped" in reason, reason


# A tree 2,000 directories wide, the last 900 holding 400 KB each (360 MB): a walk that opened
# every subdirectory of a directory before reading any needed 2,000 descriptors at once.
WIDE = r"""
import json, os
w = "/work/tmp/w"
os.makedirs(w, exist_ok=True)
for i in range(2000):
    os.mkdir("%s/%04d" % (w, i))
# In the order the kernel lists them, as the agent reads them: the last ones are those a walk
# short of descriptors would leave out.
order = os.listdir(w)
chunk = b"x" * (400 * 1024)
for name in order[1100:]:
    with open("%s/%s/blob" % (w, name), "wb") as fh:
        fh.write(chunk)
json.dump(dict(wrote=len(order) - 1100), open("/work/out/metrics.json", "w"))
"""


def test_a_wide_tree_neither_hides_from_task_disk_bytes_nor_starves_the_agent(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The agent under systemd's default limit of 1,024 descriptors (the packaged unit sets
    more): the task's 360 MB in 2,000 directories side by side are all counted, and the task
    fails for them under a 50 MB cap."""
    job = coordinator.submit(argv_job(["python3", "-c", WIDE], max_attempts=1))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # inherited by the agent
    try:
        agent = start_agent(
            coordinator.url,
            *TRUSTED,
            "--max-tasks",
            "1",
            env={**FAST, "FLASHNODE_TASK_DISK_BYTES": "50M"},
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert agent.wait(120) == 0, agent.log
    finally:
        coordinator.cancel(job)
    [line] = agent.ledger()
    assert line["outcome"] == "failed", line
    assert "grew past 50 MiB (task_disk_bytes" in line["reason"], line["reason"]


@pytest.fixture
def few_inodes() -> Iterator[Path]:
    """A tmpfs standing in for the owner's disk: plenty of bytes, 30,000 inodes."""
    with tmpfs_disk("flashnode-few-inodes-", "size=256m,nr_inodes=30000") as mount:
        yield mount


INODES = r"""
import json, os
os.makedirs("/work/tmp/d", exist_ok=True)
made = 0
try:
    while made < 100000:
        open("/work/tmp/d/%d" % made, "w").close()
        made += 1
except OSError as exc:
    err = exc.strerror
else:
    err = None
json.dump(dict(made=made, error=err), open("/work/out/metrics.json", "w"))
"""


@pytest.mark.usefixtures("as_root")
def test_a_task_cannot_use_up_the_owners_inodes(
    few_inodes: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """Empty files cost ``task_disk_bytes`` nothing: a task makes them in its tmp/ as fast as
    it can. Its files and directories are capped by the inodes the disk had free above
    min_free_bytes' share of them (16 MiB of 256 MiB: 1,875 of 30,000) when it started: it is
    stopped there, and the disk keeps that floor. No kernel limit caps a task's
    inodes as RLIMIT_FSIZE caps a file's bytes, and on a busy machine the agent sees the disk
    late: a task whose own pace would make the rest of its room before the watch, as late as it
    has been, could see it again is stopped then (without that, a CPU burner per core let this
    task take the disk to 0 free inodes). That cap is less than task_disk_files: the node was
    short of inodes, so the lease lapses (it used to fail)."""
    job = coordinator.submit(argv_job(["python3", "-c", INODES], max_attempts=1))
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=few_inodes / "state")
    try:
        with lowest_free(few_inodes, agent.done) as lowest:
            [line] = agent.wait_ledger(1, timeout=120)
    finally:
        coordinator.cancel(job)
    assert line["outcome"] == "lapsed", line
    assert "inodes free above min_free_bytes' share when the task" in line["reason"], line
    assert lowest.inodes >= 1_875 - 64, lowest.inodes  # the floor, less the agent's own files


def test_no_single_file_of_a_task_grows_past_its_disk_cap_however_fast(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    """A watch, however often it looks, sees a fast writer late: the kernel refuses to grow any
    file of the task's past its byte cap (RLIMIT_FSIZE, soft and hard), wherever it is. Here,
    100 MB as fast as the machine writes, under a 50 MB cap, into a directory the watch does not
    walk (so that nothing else stops the task)."""
    big = drop_dir / "big"
    write = f"head -c 100000000 /dev/zero > {big}; echo '{{}}' > metrics.json"
    job = coordinator.submit(argv_job(["sh", "-c", write], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=CAPPED)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert 50 << 20 < big.stat().st_size <= (50 << 20) + 512


@pytest.mark.usefixtures("as_root")
def test_a_containers_files_are_held_to_its_disk_cap_by_the_kernel_too(
    box: str, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """The container's RLIMIT_FSIZE, as its shell sees it (512-byte blocks), soft and hard."""
    from boxes import box_job, unique

    show = "ulimit -S -f; ulimit -H -f; printf '\\173\\175' > /work/out/metrics.json"
    job = coordinator.submit(box_job(["sh", "-c", show], image=box, max_attempts=1))
    env = {**CAPPED, "FLASHNODE_ALLOWED_IMAGES": box}
    node = ("--node-id", unique("fsize"))
    agent = start_agent(coordinator.url, "--runner", "docker", *node, "--max-tasks", "1", env=env)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    printed = coordinator.artifact(f"jobs/{job}/task-000/logs/stdout.txt").decode().split()
    assert len(printed) == 2 and printed[0] == printed[1], printed
    assert 50 << 20 <= int(printed[0]) * 512 <= (50 << 20) + 512, printed  # bytes, floored
