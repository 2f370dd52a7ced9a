"""Data end to end: lent local datasets and dataset slices, with the real coordinator,
real agents (trusted and docker) and a local HTTPS origin with a CA made for the test."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import AgentProcess, CoordinatorServer, argv_job, shared_dir, wait_for
from origin import Content, Generated, Origin, TestCA

from flashnode.config.settings import Settings
from flashnode.coordinator.client import Coordinator
from flashnode.evidence.inventory import registration

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
METRICS = "echo '{\"ok\": 1}' > metrics.json"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# A task that reports, in metrics.json (argv 1), what it sees: what is under /work/inputs, the
# sha256 of every file under the given dirs, and what came of trying to change them. No braces:
# the coordinator formats a command with each task's params.
PROBE = r"""
import hashlib, json, os, sys
out, dirs = sys.argv[1], sys.argv[2:]
seen, tries = dict(), dict()
for top in dirs:
    for here, subdirs, files in os.walk(top):
        for name in files:
            path = os.path.join(here, name)
            seen[os.path.relpath(path, os.path.dirname(top))] = hashlib.sha256(
                open(path, "rb").read()).hexdigest()
def attempt(what, fn):
    try:
        fn()
        tries[what] = "done"
    except OSError as exc:
        tries[what] = type(exc).__name__
for top in dirs:
    files = sorted(os.path.join(h, n) for h, _, fs in os.walk(top) for n in fs)
    first = files[0]
    attempt(top + " write", lambda: open(first, "a").write("x"))
    attempt(top + " create", lambda: open(os.path.join(top, "new.txt"), "w").write("x"))
    attempt(top + " delete", lambda: os.unlink(first))
    attempt(top + " rename", lambda: os.rename(first, first + ".moved"))
    attempt(top + " chmod", lambda: os.chmod(first, 0o666))
    attempt(top + " mkdir", lambda: os.mkdir(os.path.join(top, "newdir")))
inputs = sorted(os.listdir(os.path.join(os.path.dirname(out), "..", "inputs")))
json.dump(dict(inputs=inputs, seen=seen, tries=tries, uid=os.getuid()), open(out, "w"))
"""


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    ca.ca_file.chmod(0o644)
    return ca


@pytest.fixture
def origin(ca: TestCA) -> Iterator[Origin]:
    with Origin(ca) as server:
        yield server


@pytest.fixture
def lent() -> Iterator[dict[str, Path]]:
    """Two directories an owner lends (readable by everyone, as a task user needs)."""
    top = shared_dir("flashnode-lent-")
    top.chmod(0o755)
    dirs = {"scans": top / "the scans", "other": top / "other"}  # a space: the bind handles it
    (dirs["scans"] / "sub").mkdir(parents=True)
    (dirs["scans"] / "a.txt").write_text("scan A\n")
    (dirs["scans"] / "sub" / "b.bin").write_bytes(bytes(range(256)) * 8)
    dirs["other"].mkdir()
    (dirs["other"] / "secret.txt").write_text("the other lent set\n")
    for d in dirs.values():
        for path in (d, *d.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    yield dirs
    shutil.rmtree(top, ignore_errors=True)


def lend(dirs: dict[str, Path]) -> dict[str, str]:
    return {"FLASHNODE_LOCAL_DATA": ",".join(f"{k}={v}" for k, v in dirs.items())}


def tree(top: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Everything about the owner's files a task could change: mode, owner, mtime, bytes."""
    found = {}
    for path in (top, *sorted(top.rglob("*"))):
        st = path.lstat()
        data = path.read_bytes() if path.is_file() else b""
        found[str(path.relative_to(top))] = (st.st_mode, st.st_uid, st.st_mtime_ns, data)
    return found


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(origin: Origin, path: str, content: bytes | Content, **how: Any) -> dict[str, Any]:
    """An entry of a dataset slice, served by ``origin`` at /<path>."""
    route = origin.add(f"/{path}", content, **how)
    assert route.content is not None
    return {
        "path": path,
        "url": origin.url(f"/{path}"),
        "size": route.content.size,
        "integrity": {"kind": "sha256", "value": route.content.sha256()},
    }


def data_env(ca: TestCA, budget: int, allow_private: str = "true") -> dict[str, str]:
    """The test origins listen on loopback: the owner allows private origins (by default)."""
    return {
        **FAST,
        "FLASHNODE_DATASET_CA_FILE": str(ca.ca_file),
        "FLASHNODE_DATASET_CACHE_BYTES": str(budget),
        "FLASHNODE_DATASET_ALLOW_PRIVATE_ORIGINS": allow_private,
    }


def metrics(coordinator: CoordinatorServer, job: str, task: str = "task-000") -> dict[str, Any]:
    return dict(json.loads(coordinator.artifact(f"jobs/{job}/{task}/metrics.json")))


def failures(coordinator: CoordinatorServer, job: str) -> list[str]:
    return [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]


def shards(state_dir: Path) -> set[str]:
    return {p.name for p in (state_dir / "data" / "shards").iterdir() if "." not in p.name}


# --- lent local datasets ----------------------------------------------------------------------


@pytest.mark.usefixtures("as_root")
def test_a_trusted_task_reads_only_the_lent_labels_it_asked_for_and_changes_nothing(
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    lent: dict[str, Path],
) -> None:
    # The trusted runner (the docker runner's twin is below).
    before = {label: tree(path) for label, path in lent.items()}
    job = recording_coordinator.submit(
        argv_job(
            ["python3", "-c", PROBE, "/work/out/metrics.json", "/work/inputs/scans"],
            local_inputs=["scans"],
            max_attempts=1,
        )
    )
    # A node that lends nothing is never given the job.
    plain = Settings(coordinator=recording_coordinator.url, runner="trusted", pools=("team-a",))
    client = Coordinator(recording_coordinator.url)
    try:
        node = client.register(registration(plain, "lends-nothing"))
        assert client.claim(node) is None
    finally:
        client.close()
    assert recording_coordinator.tasks(job)[0]["attempts"] == 0

    agent = start_agent(
        recording_coordinator.url, *TRUSTED, "--max-tasks", "1", env={**FAST, **lend(lent)}
    )
    assert agent.wait(60) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = metrics(recording_coordinator, job)
    assert seen["inputs"] == ["scans"]  # not "other"
    assert seen["seen"] == {
        "scans/a.txt": sha(b"scan A\n"),
        "scans/sub/b.bin": sha(bytes(range(256)) * 8),
    }
    assert seen["uid"] != 0
    assert set(seen["tries"].values()) <= {"PermissionError", "OSError"}, seen["tries"]
    assert {label: tree(path) for label, path in lent.items()} == before
    # Nothing of the owner's was uploaded; only labels were advertised, never paths.
    assert recording_coordinator.artifacts(job) == [f"jobs/{job}/task-000/metrics.json"]
    [reg] = [r for r in recording_coordinator.recorded("/nodes/register") if r["node_id"] != node]
    assert reg["local_datasets"] == ["other", "scans"]
    assert str(lent["scans"].parent) not in json.dumps(reg)
    [record] = agent.ledger()
    assert record["local_inputs"] == ["scans"]


@pytest.mark.usefixtures("as_root")
def test_a_label_the_node_does_not_lend_fails_the_attempt_naming_it(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    lent: dict[str, Path],
) -> None:
    from badcoord import BadCoordinator, lease_answer

    bad = BadCoordinator()  # the real coordinator would not place it here
    try:
        bad.claims = [lease_answer(1, local_inputs=["scans", "xrays"])]
        agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "1", env={**FAST, **lend(lent)})
        assert agent.wait(60) == 0, agent.log
        [(_, reason)] = bad.fails
        assert "'xrays'" in reason and "not a dataset this node lends" in reason
    finally:
        bad.close()


# --- lent data only at /work/inputs/<label> ---------------------------------------------------

# What a task reaches of the lent directories other than at /work/inputs: argv 1 its output, the
# rest host paths to try; and every path its own mountinfo names under the lent directories' top
# (argv 2). Each file it could read, with what it read; and what it reads of its own labels.
REACH = r"""
import json, os, sys
out, top, tried = sys.argv[1], sys.argv[2], sys.argv[3:]
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    for path in fields[3:5]:
        path = path.replace("\\040", " ")
        if path.startswith(top):
            tried.append(path)
reached = dict()
for start in tried:
    for here, _, files in os.walk(start):
        for name in files:
            try:
                reached[os.path.join(here, name)] = open(os.path.join(here, name)).read(64)
            except (OSError, UnicodeDecodeError) as exc:
                pass
own = dict()
for label in os.listdir("/work/inputs"):
    for here, _, files in os.walk(os.path.join("/work/inputs", label)):
        for name in files:
            own[os.path.join(here, name)] = len(open(os.path.join(here, name), "rb").read())
json.dump(dict(tried=tried, reached=reached, own=own), open(out, "w"))
"""


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize(
    ("labels", "by_path"),
    [
        ([], ["scans", "other"]),  # it named no label: the lent directories by their host paths
        (["scans"], ["other", "scans"]),  # it named one: another's host path, and its own's
        (["scans"], []),  # only what its own /proc/self/mountinfo names
    ],
    ids=["no-label", "other-label", "mountinfo"],
)
def test_a_task_reaches_lent_data_only_at_the_labels_it_asked_for(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    lent: dict[str, Path],
    labels: list[str],
    by_path: list[str],
) -> None:
    """The attack: lent data is bound for the task that asked, but the owner's directory is
    readable by every task user (a task user must read the files), and its host path is in the
    mountinfo of every task that asked for it, or simply guessable: any task reads every lent
    directory by its host path. The allowed path beside it: a task reads its own label."""
    top = lent["scans"].parent
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env={**FAST, **lend(lent)})
    argv = ["python3", "-c", REACH, "/work/out/metrics.json", str(top)]
    argv += [str(lent[label]) for label in by_path]
    job = coordinator.submit(argv_job(argv, local_inputs=labels or None, max_attempts=1))
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = metrics(coordinator, job)
    assert seen["tried"], seen  # it knew where to look
    assert seen["reached"] == {}, seen["reached"]
    expected = {"/work/inputs/scans/a.txt": 7, "/work/inputs/scans/sub/b.bin": 2048}
    assert seen["own"] == (expected if labels else {})


@pytest.mark.usefixtures("as_root")
def test_a_reload_that_lends_another_directory_covers_it_from_the_next_task_on(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    lent: dict[str, Path],
    tmp_path: Path,
) -> None:
    """The slot's next chain is started ahead with the lent directories covered as they were:
    after a reload lends another one, the next task must not run in a chain that left it open."""
    config = tmp_path / "flashnode.toml"
    config.write_text(f'[local_data]\nscans = "{lent["scans"]}"\n')
    agent = start_agent(coordinator.url, *TRUSTED, "--config", str(config), env=FAST)
    first = coordinator.submit(argv_job(["sh", "-c", METRICS], max_attempts=1))
    assert coordinator.wait_state(first, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    attempts = agent.state_dir / "attempts"
    wait_for("the slot's next chain", lambda: list(attempts.glob(".ahead-*")), timeout=30)
    config.write_text(f'[local_data]\nscans = "{lent["scans"]}"\nother = "{lent["other"]}"\n')
    agent.signal(signal.SIGHUP)
    agent.wait_log("configuration reloaded")
    top = lent["scans"].parent
    argv = ["python3", "-c", REACH, "/work/out/metrics.json", str(top), str(lent["other"])]
    job = coordinator.submit(argv_job(argv, max_attempts=1))
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert metrics(coordinator, job)["reached"] == {}


# --- dataset slices ---------------------------------------------------------------------------


def test_each_task_sees_its_slice_and_a_shared_shard_is_fetched_once(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    origin: Origin,
    ca: TestCA,
) -> None:
    a, shared, c = os.urandom(40 * KiB), os.urandom(70 * KiB), os.urandom(10 * KiB)
    slices = [
        [
            {
                "name": "corpus",
                "entries": [entry(origin, "a.bin", a), entry(origin, "s.bin", shared)],
            }
        ],
        [
            {"name": "corpus", "entries": [entry(origin, "s.bin", shared)]},
            {"name": "extra", "entries": [entry(origin, "deep/c.bin", c)]},
        ],
    ]
    job = coordinator.submit(
        argv_job(
            ["python3", "-c", PROBE, "/work/out/metrics.json", "/work/data"],
            params=[{"n": 0}, {"n": 1}],
            dataset_slices=slices,
            max_attempts=1,
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=data_env(ca, MiB))
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    first, second = metrics(coordinator, job, "task-000"), metrics(coordinator, job, "task-001")
    assert first["seen"] == {"data/corpus/a.bin": sha(a), "data/corpus/s.bin": sha(shared)}
    assert second["seen"] == {"data/corpus/s.bin": sha(shared), "data/extra/deep/c.bin": sha(c)}
    assert [origin.count(p) for p in ("/a.bin", "/s.bin", "/deep/c.bin")] == [1, 1, 1]
    if os.geteuid() == 0:
        for m in (first, second):
            assert set(m["tries"].values()) <= {"PermissionError", "OSError"}, m["tries"]
    # Nothing of the agent's reached the origin.
    assert all(
        "authorization" not in r.headers and "cookie" not in r.headers for r in origin.requests
    )

    records = {r["task_id"]: r for r in agent.ledger()}
    assert records["task-000"]["data"] | {"seconds": 0} == {
        "entries": 2,
        "cache_hits": 0,
        "bytes_fetched": len(a) + len(shared),
        "bytes": len(a) + len(shared),
        "seconds": 0,
    }
    assert records["task-001"]["data"]["cache_hits"] == 1
    assert records["task-001"]["data"]["bytes_fetched"] == len(c)
    assert all(r["timings"]["data"] >= 0 for r in records.values())
    history = subprocess.run(
        [sys.executable, "-m", "flashnode", "history", "--state-dir", str(agent.state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "0.1 MiB fetched, 0 cache hit(s)" in history.stdout, history.stdout
    assert "1 cache hit(s)" in history.stdout


def test_a_job_cannot_read_the_owners_private_service_through_a_dataset_entry(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    origin: Origin,
    ca: TestCA,
) -> None:
    """An entry naming a service on the owner's loopback, with the
    service's own ETag as its integrity. Without the owner's opt-in nothing reaches it, the task
    never runs, and the reason says which check failed and nothing of what the service holds."""
    page = b"private: the owner's router admin page\n"
    tag = '"private-etag-9c1e"'
    origin.add("/private", page, etag=tag)
    private = {
        "path": "page.html",
        "url": origin.url("/private"),
        "size": len(page),
        "integrity": {"kind": "etag", "value": tag},
    }
    job = coordinator.submit(
        argv_job(
            ["python3", "-c", PROBE, "/work/out/metrics.json", "/work/data"],
            dataset_slices=[[{"name": "ds", "entries": [private]}]],
            max_attempts=1,
        )
    )
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "1", env=data_env(ca, MiB, "false")
    )
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED", agent.log
    [reason] = failures(coordinator, job)
    assert "dataset entry ds/page.html: url refused" in reason, reason
    assert "resolves to a loopback address" in reason, reason
    assert "9c1e" not in reason and str(len(page)) not in reason
    assert origin.count() == 0 and origin.server_names == []
    assert not any(key.endswith("metrics.json") for key in coordinator.artifacts(job))
    assert list((agent.state_dir / "data" / "shards").iterdir()) == []


def test_a_dropped_connection_resumes_and_wrong_bytes_fail_naming_the_entry(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    origin: Origin,
    ca: TestCA,
) -> None:
    good, bad = os.urandom(600 * KiB), os.urandom(300 * KiB)
    dropped = entry(origin, "good.bin", good, drop_at=200 * KiB)
    corrupt = entry(origin, "bad.bin", bad, corrupt=True)
    job = coordinator.submit(
        argv_job(
            ["python3", "-c", PROBE, "/work/out/metrics.json", "/work/data"],
            params=[{"n": 0}, {"n": 1}],
            dataset_slices=[
                [{"name": "resumed", "entries": [dropped]}],
                [{"name": "broken", "entries": [corrupt]}],
            ],
            max_attempts=1,
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=data_env(ca, MiB))
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    states = {t["task_id"]: t["state"] for t in coordinator.tasks(job)}
    assert states["task-000"] == "COMPLETED"
    assert metrics(coordinator, job)["seen"] == {"data/resumed/good.bin": sha(good)}
    gets = [r for r in origin.requests if r.path == "/good.bin"]
    assert len(gets) == 2 and gets[1].headers["range"] == f"bytes={200 * KiB}-"
    [reason] = failures(coordinator, job)
    assert "dataset entry broken/bad.bin" in reason and "does not match" in reason
    # Nothing unverified stays in the cache.
    assert shards(agent.state_dir) == {sha(good)}
    assert list((agent.state_dir / "data" / "partial").iterdir()) == []


def test_the_budget_is_advertised_bigger_slices_never_come_and_the_lru_shard_is_evicted(
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    origin: Origin,
    ca: TestCA,
    drop_dir: Path,
) -> None:
    # Room for two 64 KiB shards.
    coordinator, size = recording_coordinator, 64 * KiB
    budget = size * 5 // 2
    one, two, three = (os.urandom(size) for _ in range(3))
    too_big = coordinator.submit(
        argv_job(
            ["true"],
            dataset_slices=[
                [{"name": "big", "entries": [entry(origin, "big.bin", os.urandom(budget + 1))]}]
            ],
        )
    )
    waiter = (
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], 'started'), 'w').close()\n"
        "while not os.path.exists(os.path.join(sys.argv[1], 'release')): time.sleep(0.05)\n"
        "open(sys.argv[2], 'w').write('{\"ok\": 1}')\n"
    )

    def job(name: str, data: bytes, script: str | None = None) -> str:
        command = (
            ["python3", "-c", script, str(drop_dir), "/work/out/metrics.json"]
            if script
            else ["sh", "-c", """echo '{"ok": 1}' > "$1" """, "sh", "/work/out/metrics.json"]
        )
        slices = [[{"name": name, "entries": [entry(origin, f"{name}.bin", data)]}]]
        return coordinator.submit(argv_job(command, dataset_slices=slices, max_attempts=1))

    agent = start_agent(
        coordinator.url, *TRUSTED, "--slots", "2", "--max-tasks", "3", env=data_env(ca, budget)
    )
    held = job("one", one, waiter)
    wait_for("the holding task to start", lambda: (drop_dir / "started").exists(), timeout=60)
    for name, data in (("two", two), ("three", three)):
        done = job(name, data)
        assert coordinator.wait_state(done, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    # "one" is the least recently used, but a running task holds it: "two" went instead.
    assert shards(agent.state_dir) == {sha(one), sha(three)}
    (drop_dir / "release").touch()
    assert coordinator.wait_state(held, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert agent.wait(60) == 0, agent.log

    registered = coordinator.recorded("/nodes/register")
    assert {r["capabilities"]["dataset_cache_bytes"] for r in registered} == {budget}
    assert coordinator.tasks(too_big)[0]["attempts"] == 0
    assert origin.count("/big.bin") == 0


def test_a_1_gb_shard_is_fetched_and_verified_in_bounded_agent_memory(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    origin: Origin,
    ca: TestCA,
) -> None:
    # The agent's resident memory grows by less than 64 MB.
    big = Generated(GiB, seed=18)
    slices = [[{"name": "big", "entries": [entry(origin, "big.bin", big)]}]]
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=data_env(ca, 2 * GiB))
    agent.wait_log("registered as node")
    proc = psutil.Process(agent.proc.pid)
    base = peak = proc.memory_info().rss
    job = coordinator.submit(
        argv_job(
            [
                "sh",
                "-c",
                """printf '{"size": %s}' "$(stat -c %s "$1")" > "$2" """,
                "sh",
                "/work/data/big/big.bin",
                "/work/out/metrics.json",
            ],
            dataset_slices=slices,
            max_attempts=1,
        )
    )

    def done() -> bool:
        nonlocal peak
        if agent.proc.poll() is not None:
            return True
        with contextlib.suppress(psutil.NoSuchProcess):
            peak = max(peak, proc.memory_info().rss)
        return False

    wait_for("the agent to finish", done, timeout=120, every=0.05)
    assert agent.wait(10) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert metrics(coordinator, job) == {"size": GiB}
    assert peak - base < 64 * MiB, f"the agent grew by {(peak - base) >> 20} MiB"
    [record] = agent.ledger()
    assert record["data"]["bytes_fetched"] == GiB


# --- the docker runner --------------------------------------------------------------------------


# In busybox: what the container sees of /work/inputs and /work/data, and whether it can change
# them ("y" for each change that worked).
BOX_PROBE = r"""
inputs=$(ls /work/inputs | tr '\n' ' ')
a=$(cat /work/inputs/scans/a.txt)
x=$(busybox sha256sum /work/data/ds/x.bin | busybox cut -d' ' -f1)
try() { if ( eval "$1" ) 2>/dev/null; then printf y; else printf n; fi; }
w=$(try 'echo x >> /work/inputs/scans/a.txt')$(try 'touch /work/inputs/scans/new')
w=$w$(try 'busybox rm /work/inputs/scans/sub/b.bin')$(try 'mkdir /work/inputs/scans/d')
w=$w$(try 'echo x >> /work/data/ds/x.bin')$(try 'touch /work/data/ds/new')
w=$w$(try 'busybox rm /work/data/ds/x.bin')$(try 'busybox chmod 666 /work/data/ds/x.bin')
other=$(try 'ls /work/inputs/other')
printf '{"inputs": "%s", "a": "%s", "x": "%s", "writes": "%s", "other": "%s"}' \
  "$inputs" "$a" "$x" "$w" "$other" > /work/out/metrics.json
"""


def test_a_container_gets_only_the_labels_it_asked_for_and_its_data_read_only(
    box: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    lent: dict[str, Path],
    origin: Origin,
    ca: TestCA,
) -> None:
    # The docker runner, and a slice laid out in a container.
    from boxes import box_job, unique

    before = {label: tree(path) for label, path in lent.items()}
    x = os.urandom(20 * KiB)
    job = coordinator.submit(
        box_job(
            ["sh", "-c", BOX_PROBE],
            image=box,
            local_inputs=["scans"],
            dataset_slices=[[{"name": "ds", "entries": [entry(origin, "x.bin", x)]}]],
            max_attempts=1,
        )
    )
    env = {
        **data_env(ca, MiB),
        **lend(lent),
        "FLASHNODE_ALLOWED_IMAGES": box,
        "FLASHNODE_KILL_GRACE_SECONDS": "1",
    }
    node = unique("dock-data")
    agent = start_agent(
        coordinator.url, "--runner", "docker", "--node-id", node, "--max-tasks", "1", env=env
    )
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = metrics(coordinator, job)
    assert seen["inputs"].split() == ["scans"]
    assert seen["a"] == "scan A" and seen["x"] == sha(x)
    assert seen["writes"] == "n" * 8 and seen["other"] == "n"
    assert {label: tree(path) for label, path in lent.items()} == before
    [record] = agent.ledger()
    assert record["local_inputs"] == ["scans"] and record["data"]["bytes_fetched"] == len(x)
