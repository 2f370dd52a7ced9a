"""Job environments end to end: the real coordinator, real agents, real uv, and a
local package index on 127.0.0.1 that the jobs name with an ``--index-url`` line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from badcoord import BadCoordinator, lease_answer
from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    lowest_free,
    shared_dir,
    tmpfs_disk,
    wait_for,
)
from localhttp import LocalHTTPServer
from pkgindex import PackageIndex, Wheel, _record_hash, build_wheel, package_index

from flashnode.caches.envcache import EnvCache
from flashnode.coordinator.datasets import OriginPolicy

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
# The test index listens on loopback: the owner's opt-in to private indexes lets jobs name it.
FAST = {
    "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
    "UV_HTTP_RETRIES": "0",
    "FLASHNODE_ENV_ALLOW_PRIVATE_INDEXES": "127.0.0.1",
}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
PKGS = ("flashnode_envtest_a", "flashnode_envtest_b", "flashnode_envtest_c", "flashnode_envtest_d")
A, B, C, D = PKGS

# The task: imports the package only the local index has, tries to write into its environment,
# and reports what it saw in metrics.json (its first argument). No braces: the coordinator formats
# a command with each task's params.
PROBE = r"""
import json, os, sys, importlib
pkg = importlib.import_module(sys.argv[2])
venv = os.environ.get("VIRTUAL_ENV", "")
writes = dict()
for what, path in (("new file", os.path.join(venv, "pwned")),
                   ("module", pkg.__file__),
                   ("bin", os.path.join(venv, "bin", "pwned"))):
    try:
        with open(path, "a") as fh:
            fh.write("# pwned\n")
        writes[what] = "wrote"
    except OSError as exc:
        writes[what] = type(exc).__name__
try:
    os.rename(pkg.__file__, pkg.__file__ + ".moved")
    writes["rename"] = "renamed"
except OSError as exc:
    writes["rename"] = type(exc).__name__
json.dump(dict(version=pkg.VERSION, python=sys.executable, venv=venv, prefix=sys.prefix,
               writes=writes, uid=os.getuid()), open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def index() -> Iterator[PackageIndex]:
    # Alike in size, so that a budget can be set to fit exactly two of their environments: a MiB
    # of data each, so that an environment is mostly its own files (a build's room counts uv's
    # cache too, which holds little more than its files).
    wheels = [
        build_wheel(
            p,
            "1.0",
            source=f"VERSION = '1.0'\nNAME = '{p}'\n",
            extra_files={f"{p}/data.bin": "\0" * (1 << 20)},
        )
        for p in PKGS
    ]
    with package_index(*wheels) as idx:
        yield idx


@pytest.fixture
def state() -> Iterator[Path]:
    """A state dir outside /tmp: a root agent's tasks get a private /tmp, which would hide the
    job environments under it from them (the agent refuses such tasks). Tests ask for it before
    ``start_agent``, so that it is removed after their agents have stopped."""
    path = shared_dir("flashnode-envs-state-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def deps(index: PackageIndex, *reqs: str) -> list[str]:
    return [f"--index-url {index.url}", *reqs]


def env_job(index: PackageIndex, pkg: str, reqs: list[str] | None = None, **kw: Any) -> dict:
    command = [
        "python",
        "-c",
        kw.pop("script", PROBE),
        "/work/out/metrics.json",
        pkg,
        *kw.pop("args", []),
    ]
    return argv_job(command, dependencies=deps(index, *(reqs or [f"{pkg}==1.0"])), python=PY, **kw)


def metrics(coordinator: CoordinatorServer, job: str, task: str = "task-000") -> dict[str, Any]:
    return dict(json.loads(coordinator.artifact(f"jobs/{job}/{task}/metrics.json")))


def resolutions(index: PackageIndex, pkg: str) -> int:
    """How many times a build asked the index about ``pkg`` (once per build; a wheel's download
    can take several requests)."""
    return index.requests.count(f"/simple/{pkg.replace('_', '-')}/")


def failures(coordinator: CoordinatorServer, job: str) -> list[str]:
    return [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]


def test_an_environment_is_built_once_shared_by_slots_reused_and_read_only_to_tasks(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
) -> None:
    # Two slots need the same new lines at once (downloads are held
    # until both attempts have been claimed): one build; a later job with the same lines reuses it.
    index.files_gate.clear()
    first = coordinator.submit(env_job(index, A, params=[{"n": 0}, {"n": 1}]))
    agent = start_agent(
        coordinator.url, *TRUSTED, "--slots", "2", "--max-tasks", "3", env=FAST, state_dir=state
    )
    try:
        wait_for(
            "both tasks to be claimed",
            lambda: all(t["attempts"] > 0 for t in coordinator.tasks(first)),
            timeout=60,
        )
    finally:
        index.files_gate.set()
    assert coordinator.wait_state(first, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    second = coordinator.submit(env_job(index, A))
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(second, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log

    assert resolutions(index, A) == 1
    records = agent.ledger()
    assert [r["outcome"] for r in records] == ["committed"] * 3
    envs = [r["environment"] for r in records]
    assert len({e["key"] for e in envs}) == 1 and {e["python"] for e in envs} == {PY}
    assert sorted(e["built"] for e in envs) == [False, False, True]
    [built] = [e for e in envs if e["built"]]
    assert built["build_seconds"] > 0
    assert all(r["timings"]["environment"] >= 0 for r in records)
    reused = next(r for r in records if r["job_id"] == second)
    assert reused["environment"]["built"] is False and reused["environment"]["build_seconds"] == 0

    seen = [metrics(coordinator, first, t) for t in ("task-000", "task-001")]
    seen.append(metrics(coordinator, second))
    for m in seen:
        assert m["version"] == "1.0"
        venv = Path(m["venv"])
        assert venv.is_relative_to(state / "envs") and Path(m["prefix"]) == venv
        assert Path(m["python"]).parent == venv / "bin"
    if os.geteuid() == 0:
        assert all(m["uid"] != 0 for m in seen)
        # EACCES (the files are the agent's) or EROFS (the task sees its environment read-only)
        denied = {"PermissionError", "OSError"}
        assert all(set(m["writes"].values()) <= denied for m in seen), seen
        venv = Path(seen[0]["venv"])
        assert not (venv / "pwned").exists() and not (venv / "bin" / "pwned").exists()
        module = next((venv / "lib").glob(f"python*/site-packages/{A}/__init__.py"))
        assert "pwned" not in module.read_text()

    # The owner's view: flashnode doctor shows the cache.
    doctor = subprocess.run(
        [sys.executable, "-m", "flashnode", "doctor", "--coordinator", coordinator.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")},
            "FLASHNODE_RUNNER": "trusted",
            "FLASHNODE_POOLS": "team-a",
            "FLASHNODE_STATE_DIR": str(state),
            **({"FLASHNODE_TASK_USER": "flashnode-task"} if os.geteuid() == 0 else {}),
            **({} if os.geteuid() == 0 else {"FLASHNODE_ALLOW_SAME_USER": "true"}),
        },
    )
    assert "job environments: 1 environment(s)" in doctor.stdout, doctor.stdout
    assert "0 in use" in doctor.stdout


def test_the_budget_evicts_the_least_recently_used_environment_never_one_in_use(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
    drop_dir: Path,
) -> None:
    # How big one such environment is here, to give the agent room for two.
    scratch = shared_dir("flashnode-envsize-")  # not under /tmp: builds get a private one
    scratch.chmod(0o755)
    try:
        cache = EnvCache(scratch / "envs", 1 << 30, index_policy=OriginPolicy(private=True))
        with cache.acquire(PY, deps(index, f"{A}==1.0"), stop=threading.Event(), timeout_s=120):
            pass
        [probe] = cache.entries()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    budget = probe.bytes * 5 // 2

    # B holds its environment until released; C runs and ends; D's build puts the cache over
    # budget: B's environment is the least recently used, but in use, so C's goes.
    holder = (
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[3], 'started'), 'w').close()\n"
        "while not os.path.exists(os.path.join(sys.argv[3], 'release')): time.sleep(0.05)\n" + PROBE
    )
    env = {**FAST, "FLASHNODE_ENV_CACHE_BYTES": str(budget)}
    agent = start_agent(
        coordinator.url, *TRUSTED, "--slots", "2", "--max-tasks", "3", env=env, state_dir=state
    )
    held = coordinator.submit(env_job(index, B, script=holder, args=[str(drop_dir)]))
    wait_for("the holding task to start", lambda: (drop_dir / "started").exists(), timeout=60)
    for pkg in (C, D):
        job = coordinator.submit(env_job(index, pkg))
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log

    def cached() -> set[str]:
        found = set()
        for meta in (state / "envs").glob("*/meta.json"):
            lines = json.loads(meta.read_text())["lines"]
            found |= {p for p in PKGS if any(line.startswith(p) for line in lines)}
        return found

    assert cached() == {B, D}
    (drop_dir / "release").touch()
    assert coordinator.wait_state(held, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert metrics(coordinator, held)["version"] == "1.0"
    assert agent.wait(60) == 0, agent.log
    assert cached() == {B, D}
    assert "evicted" in agent.log


def test_a_bad_pin_fails_with_the_resolvers_message_and_is_not_rebuilt_at_once(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
) -> None:
    # Both attempts land on this node; the second is answered by the negative
    # cache without asking the index again.
    job = coordinator.submit(env_job(index, A, reqs=[f"{A}==9.9"], max_attempts=2))
    before = resolutions(index, A)
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST, state_dir=state)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    reasons = failures(coordinator, job)
    assert len(reasons) == 2
    for reason in reasons:
        assert "No solution found" in reason and "9.9" in reason, reason
    assert resolutions(index, A) - before == 1
    assert [r["outcome"] for r in agent.ledger()] == ["failed", "failed"]
    assert not list((state / "envs").glob("*/meta.json"))


def test_a_python_this_node_lacks_is_refused_naming_the_version(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
) -> None:
    # Python downloads are off by default.
    spec = env_job(index, A, max_attempts=1)
    spec["spec"]["workload"]["parameters"]["python"] = "3.99"
    job = coordinator.submit(spec)
    asked = len(index.requests)
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, state_dir=state)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    [reason] = failures(coordinator, job)
    assert "Python 3.99 is not available on this node (Python downloads are off)" in reason
    assert len(index.requests) == asked  # refused before anything was fetched


# --- the docker runner: the image holds the base; extras are never installed --------------------


def test_the_docker_runner_runs_dependencies_in_its_image_and_never_installs_extras(
    box: str,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
) -> None:
    from boxes import box_job, unique

    docker_env = {**FAST, "FLASHNODE_ALLOWED_IMAGES": box, "FLASHNODE_KILL_GRACE_SECONDS": "1"}
    write = ["sh", "-c", "echo '{\"ok\": 1}' > /work/out/metrics.json"]
    base = deps(index, f"{A}==1.0")
    extras = recording_coordinator.submit(
        box_job(write, image=box, dependencies=base, extra_dependencies=[f"{B}==1.0"])
    )
    plain = recording_coordinator.submit(box_job(write, image=box, dependencies=base, python=PY))
    node = unique("dock-deps")
    asked = len(index.requests)
    agent = start_agent(
        recording_coordinator.url,
        "--runner",
        "docker",
        "--node-id",
        node,
        "--max-tasks",
        "1",
        env=docker_env,
    )
    assert agent.wait(60) == 0, agent.log
    assert recording_coordinator.wait_state(plain, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    [record] = agent.ledger()
    assert record["outcome"] == "committed" and "environment" not in record
    assert len(index.requests) == asked  # the image is used as it is: no index is asked
    # The coordinator never places extras on a node that cannot install them...
    [registration] = recording_coordinator.recorded("/nodes/register")
    assert registration["can_install_dependencies"] is False
    assert recording_coordinator.tasks(extras)[0]["attempts"] == 0

    # ...and were one placed anyway, the runner refuses it without spending the failure budget.
    bad = BadCoordinator()
    try:
        bad.claims = [
            lease_answer(
                1,
                image=box,
                pool=None,
                isolation={"tier": "sandboxed"},
                dependencies=base,
                extra_dependencies=[f"{B}==1.0"],
            )
        ]
        agent = start_agent(
            bad.url, "--runner", "docker", "--node-id", node, "--max-tasks", "1", env=docker_env
        )
        assert agent.wait(60) == 0, agent.log
        assert bad.fails == [] and bad.completes == []
        [record] = agent.ledger()
        assert record["outcome"] == "lapsed"
        assert "installs no extra_dependencies" in record["reason"]
    finally:
        bad.close()


# --- what a job's packages can do while its environment is built ------------------------------


@pytest.mark.usefixtures("as_root")
def test_a_jobs_binary_wheel_never_runs_code_as_root_while_its_environment_is_built(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
    drop_dir: Path,
) -> None:
    """A pool job names a dependency from its own index whose wheel installs a ``.pth`` file
    (every start of that environment's interpreter runs its ``import`` lines). Building the
    environment runs none of it, as root or as anyone (uv runs as the build user, and the
    bytecode is compiled without site); the job's task runs it, as the task user."""
    name = "flashnode_envtest_pth"
    hook = (
        f"import os; open(os.path.join({str(drop_dir)!r}, 'pth-ran-as-%d' % os.geteuid()),"
        " 'w').close()\n"
    )
    index.add(build_wheel(name, "1.0", extra_files={f"{name}_hook.pth": hook}))
    job = coordinator.submit(
        argv_job(
            ["python", "-c", f"import {name}; open('metrics.json', 'w').write('{{}}')"],
            dependencies=deps(index, name),
            python=PY,
            max_attempts=1,
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, state_dir=state)
    assert agent.wait(180) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    task_uid = pwd.getpwnam("flashnode-task-0").pw_uid
    ran_as = sorted(p.name for p in drop_dir.glob("pth-ran-as-*"))
    assert ran_as == [f"pth-ran-as-{task_uid}"], f"the job's code ran as {ran_as}"


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 64 MiB tmpfs standing in for the owner's disk (the state dir is on it)."""
    with tmpfs_disk("flashnode-envs-disk-", "size=64m") as mount:
        yield mount


def _bomb_wheel(name: str, size: int) -> Wheel:
    """A wheel of a few hundred KiB whose one data file unpacks to ``size`` bytes of zeros."""
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": b"VERSION = '1.0'\n",
        f"{name}/weights.bin": b"\0" * size,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return Wheel(f"{name}-1.0-py3-none-any.whl", buf.getvalue())


@pytest.mark.usefixtures("as_root")
def test_a_jobs_environment_cannot_fill_the_owners_disk_past_env_cache_bytes(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    index: PackageIndex,
) -> None:
    """A dependency whose wheel is a few hundred KiB and unpacks to 200 MiB, on a node whose
    disk has 64 MiB: the build is stopped at ``env_cache_bytes`` (8 MiB here) while it runs,
    the owner's disk keeps its free space, and the attempt fails as the job's (its oversized
    environment), not the node's (a full disk)."""
    name = "flashnode_envtest_bomb"
    index.add(_bomb_wheel(name, 200 << 20))
    job = coordinator.submit(
        argv_job(
            ["python", "-c", "open('metrics.json', 'w').write('{}')"],
            dependencies=deps(index, name),
            python=PY,
            max_attempts=1,
        )
    )
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M", "FLASHNODE_ENV_CACHE_BYTES": str(8 << 20)}
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=small_disk / "state")
    try:
        with lowest_free(small_disk, agent.done) as lowest:
            [line] = agent.wait_ledger(1, timeout=120)
    finally:
        coordinator.cancel(job)
    assert lowest.bytes >= 8 << 20, f"the build took the disk down to {lowest.bytes >> 10} KiB free"
    assert line["outcome"] == "failed", line["reason"]
    assert "the environment grew past 8.0 MiB (env_cache_bytes)" in line["reason"]


class _OwnersService:
    """Stands for a service of the owner's on loopback only (an admin page, a router's, a
    metadata service's look-alike): it answers 401 and records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                service.requests.append(self.path)
                body = b"<html><body>owner's private admin page</body></html>"
                self.send_response(401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = LocalHTTPServer(("127.0.0.1", 0), Handler).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def owners_service() -> Iterator[_OwnersService]:
    service = _OwnersService()
    yield service
    service.close()


@pytest.mark.usefixtures("as_root")
def test_a_jobs_package_index_cannot_reach_the_owners_loopback_services(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    owners_service: _OwnersService,
) -> None:
    """A job's lines that name an index, a page of links or a direct reference on the owner's
    loopback make no request there (blind SSRF, a port scan through the reason): the build is
    refused as the job's fault, and the reason names the line, not what answered. The owner
    has not allowed private indexes here."""
    url = owners_service.url
    named = [
        [f"--index-url {url}/admin/delete-everything", "anything"],
        [f"--extra-index-url={url}/extra", "anything"],
        [f"--find-links {url}/links", "anything"],
        [f"anything @ {url}/direct/anything-1.0-py3-none-any.whl"],
    ]
    jobs = [
        coordinator.submit(
            argv_job(
                ["python", "-c", "open('metrics.json', 'w').write('{}')"],
                dependencies=lines,
                python=PY,
                max_attempts=1,
            )
        )
        for lines in named
    ]
    owner_only = {k: v for k, v in FAST.items() if k != "FLASHNODE_ENV_ALLOW_PRIVATE_INDEXES"}
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "4", env=owner_only, state_dir=state
    )
    assert agent.wait(180) == 0, agent.log
    assert owners_service.requests == []
    for job, lines in zip(jobs, named, strict=True):
        coordinator.wait_state(job, {"FAILED"})
        [reason] = failures(coordinator, job)
        assert f"{lines[0]!r} is refused: its host is a loopback address" in reason, reason
        assert "401" not in reason.replace(url, "<url>"), reason  # never what answered


# Another slot's task: find a job environment from the command lines every user can read in
# /proc (a console script's interpreter, a module task's python: <state>/envs/<key>/bin/...),
# then read that job's installed code. No braces (the coordinator formats commands).
SNOOP = r"""
drop=$1
i=0
while [ $i -lt 100 ]; do
  for f in /proc/[0-9]*/cmdline; do
    env=$(tr '\0' '\n' < $f 2>/dev/null | grep -o '^/.*/envs/[0-9a-f]*' | head -n 1)
    if [ -n "$env" ]; then
      grep -rho 'job-a-proprietary-[0-9a-f]*' "$env" > "$drop/.s" 2>/dev/null
      if [ -s "$drop/.s" ]; then mv "$drop/.s" "$drop/stolen"; exit 0; fi
    fi
  done
  i=$((i+1)); sleep 0.1
done
"""


def _cmdline_with(word: str) -> str:
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().decode(errors="replace").split("\0")
            if any(word in a for a in argv) and not any("pytest" in a for a in argv):
                return " ".join(argv)
    return ""


@pytest.mark.usefixtures("as_root")
def test_another_slots_task_cannot_read_a_jobs_private_environment(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
) -> None:
    """Job A installs its own package from its private index and runs its console script: the
    environment's path is in that process's command line, which every local user reads, and
    the environment's files are readable by task users. Job B, a stranger's job in the other
    slot, looks for it there and reads job A's code: it finds nothing, for each task sees the
    job environments' directory empty but for its own environment."""
    secret = "job-a-proprietary-" + os.urandom(6).hex()
    private = build_wheel(
        "flashnode_envtest_priv",
        "1.0",
        source=f"SECRET = {secret!r}\ndef main():\n    import time\n    time.sleep(60)\n",
        scripts={"privrun": "flashnode_envtest_priv:main"},
    )
    with package_index(private) as private_index:
        job_a = coordinator.submit(
            argv_job(
                ["privrun"],
                dependencies=deps(private_index, "flashnode_envtest_priv==1.0"),
                python=PY,
                max_attempts=3,  # another agent on a shared test host may kill its build
            )
        )
        start_agent(coordinator.url, *TRUSTED, "--slots", "2", env=FAST, state_dir=state)
        try:
            seen = wait_for("job A's task running", lambda: _cmdline_with("privrun"), 240)
            job_b = coordinator.submit(
                argv_job(["sh", "-c", SNOOP, "snoop", str(drop_dir)], max_attempts=1)
            )
            coordinator.wait_state(job_b, {"SUCCEEDED", "FAILED"}, 150)
            stolen = drop_dir / "stolen"
            assert not stolen.exists(), f"job B read job A's package via {seen}"
            assert coordinator.job(job_a)["state"] == "RUNNING"  # its own environment works
        finally:
            coordinator.cancel(job_a)


def _refused_build(
    line: str, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], state: Path
) -> str:
    """Run a job whose only line is ``line`` on an agent whose owner allows no private index;
    the reason its attempt failed."""
    job = coordinator.submit(
        argv_job(["python", "-c", "pass"], dependencies=[line], python=PY, max_attempts=1)
    )
    owner_only = {k: v for k, v in FAST.items() if k != "FLASHNODE_ENV_ALLOW_PRIVATE_INDEXES"}
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "1", env=owner_only, state_dir=state
    )
    assert agent.wait(180) == 0, agent.log
    coordinator.wait_state(job, {"FAILED"})
    [reason] = failures(coordinator, job)
    return reason


@pytest.mark.usefixtures("as_root")
def test_a_jobs_vcs_requirement_cannot_reach_the_owners_loopback_services(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    owners_service: _OwnersService,
) -> None:
    """A VCS line names no index the checks see and would have uv run git, which GETs the
    owner's loopback (no DNS, nothing checked): any scheme but http(s) is refused, the job's
    fault, before uv runs."""
    line = f"git+{owners_service.url}/admin/delete-everything"
    reason = _refused_build(line, coordinator, start_agent, state)
    assert owners_service.requests == [], reason
    assert f"{line!r} is refused: only http(s) URLs" in reason, reason


@pytest.mark.usefixtures("as_root")
def test_a_jobs_direct_reference_cannot_hide_a_loopback_host_behind_a_backslash(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    owners_service: _OwnersService,
) -> None:
    """For ``http://127.0.0.1:PORT\\@8.8.8.8/x.whl`` Python's urlsplit reads the host
    8.8.8.8 (public), uv (WHATWG: a backslash ends an http URL's authority) connects to
    127.0.0.1:PORT: a line with a backslash is refused."""
    line = f"pkg @ {owners_service.url}\\@8.8.8.8/pkg-1.0-py3-none-any.whl"
    reason = _refused_build(line, coordinator, start_agent, state)
    assert owners_service.requests == [], reason
    assert "is refused: backslashes are not allowed" in reason, reason


@pytest.fixture
def owners_wheel() -> Iterator[Path]:
    """A wheel of the owner's own, world-readable on this host (a project's dist/): no URL
    points at it."""
    where = shared_dir("flashnode-envs-owner-")
    where.chmod(0o755)
    wheel = build_wheel("ownerpriv", "1.0", source="SECRET = 'the-owners-own-code'\n")
    path = where / wheel.filename
    path.write_bytes(wheel.data)
    path.chmod(0o644)
    yield path
    shutil.rmtree(where, ignore_errors=True)


@pytest.mark.usefixtures("as_root")
def test_a_jobs_dependency_line_cannot_install_a_file_of_this_host(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    owners_wheel: Path,
) -> None:
    """``a/../../<...>/x.whl`` starts with a letter, yet uv takes it as a path relative to the
    build's ``home`` and would install the owner's wheel into the job's environment: a line
    with a ``/`` outside a URL is refused, the job's fault."""
    home = state / "envs" / ".tmp" / "key.token" / "home"  # where uv runs
    line = "a/" + "../" * len(home.parts) + str(owners_wheel).lstrip("/")
    check = "import ownerpriv; open('metrics.json', 'w').write(ownerpriv.SECRET)"
    job = coordinator.submit(
        argv_job(["python", "-c", check], dependencies=[line], python=PY, max_attempts=1)
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, state_dir=state)
    assert agent.wait(180) == 0, agent.log
    state_ = coordinator.wait_state(job, {"SUCCEEDED", "FAILED"})
    reasons = failures(coordinator, job)
    assert state_ == "FAILED", f"the job's task imported the owner's wheel read by {line!r}"
    assert any(f"{line!r} is refused: not a requirement" in r for r in reasons), reasons


@pytest.mark.usefixtures("as_root")
def test_two_jobs_naming_a_host_that_does_not_resolve_cannot_bench_a_healthy_node(
    state: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """Any job can name an index host that exists nowhere (``*.invalid``): the resolver's "no
    such name" is the job's fault, its line named, not a lapse of the node's DNS that, across
    two jobs, would quarantine the node at once."""
    lines = ["--index-url http://flashnode-envs-test.invalid/simple", "anything"]
    jobs = [
        coordinator.submit(
            argv_job(["true"], dependencies=lines, python=PY, params=[{"n": i} for i in range(n)])
        )
        for n in (3, 2)
    ]
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=state)
    try:
        ledger = agent.wait_ledger(5, timeout=120)
    finally:
        for job in jobs:
            coordinator.cancel(job)
    held = [line for line in agent.log.splitlines() if "quarantined" in line]
    outcomes = [(line["outcome"], line["reason"][:160]) for line in ledger]
    assert held == [], f"two jobs' unresolvable index benched a healthy node: {held}; {outcomes}"
    assert all(
        outcome == "failed" and "its host does not exist" in reason for outcome, reason in outcomes
    ), outcomes
