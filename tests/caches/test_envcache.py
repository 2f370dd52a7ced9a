"""The job environment cache against real uv and a local package index on 127.0.0.1."""

from __future__ import annotations

import json
import os
import platform
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import psutil
import pytest
from harness import TASK_USER, free_port, shared_dir, wait_for
from localhttp import LocalHTTPServer
from pkgindex import PackageIndex, build_sdist, build_wheel, package_index

from flashnode.caches import envbuild
from flashnode.caches.envbuild import (
    DiskRoom,
    EnvSpec,
    UvBuilder,
    check_endpoints,
    check_lines,
    classify,
    others_can_run,
    summarize,
)
from flashnode.caches.envcache import EnvCache
from flashnode.caches.envrecords import describe
from flashnode.clock import SystemClock
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.errors import (
    AttemptFailed,
    Cancelled,
    EnvBuildFailed,
    EnvUnavailable,
    ShortOfRoom,
)
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.limits import Limits

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
GiB = 1 << 30
A = "flashnode_testpkg_a"
B = "flashnode_testpkg_b"
C = "flashnode_testpkg_c"
SRC = "flashnode_testpkg_src"


def data(name: str) -> dict[str, str]:
    """A MiB of data in the package: its environment is mostly its own files, not the venv's
    and uv's (a build's room counts uv's cache too), so that budgets can be set by size."""
    return {f"{name}/data.bin": "\0" * (1 << 20)}


@pytest.fixture(scope="module")
def index() -> Iterator[PackageIndex]:
    with package_index(
        build_wheel(
            A,
            "1.0",
            source="VERSION = '1.0'\ndef main():\n    print('a says hi')\n",
            scripts={"flashnode-tpa": f"{A}:main"},
            extra_files=data(A),
        ),
        build_wheel(B, "1.0", requires=[f"{A}>=1.0"], extra_files=data(B)),
        build_wheel(C, "1.0", extra_files=data(C)),
        build_sdist(SRC, "1.0"),
    ) as idx:
        yield idx


@pytest.fixture(autouse=True)
def _no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unreachable index fails at once instead of after uv's three retries with backoff.
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")


@pytest.fixture
def root() -> Iterator[Path]:
    """A cache root other users can reach (pytest's tmp_path is private to root), outside /tmp
    (a root agent's builds, like its tasks, get a private /tmp)."""
    base = shared_dir("flashnode-envs-")
    base.chmod(0o755)
    yield base / "envs"
    shutil.rmtree(base, ignore_errors=True)


class CountingBuilder(UvBuilder):
    """The real uv builder, counting its builds; ``gate`` (when given) holds each build at its
    start until it is set."""

    def __init__(self, python_dir: Path, gate: threading.Event | None = None, **kw: object):
        super().__init__(python_dir, **kw)  # type: ignore[arg-type]
        self.builds = 0
        self.started = threading.Event()
        self.gate = gate

    def build(
        self, spec: EnvSpec, work: Path, *, stop: threading.Event, deadline: float, room: DiskRoom
    ) -> Path:
        self.builds += 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        return super().build(spec, work, stop=stop, deadline=deadline, room=room)


class SpyClock(SystemClock):
    """The system clock; remembers which threads waited on an event other than their stop
    event (that is, on someone else's build), and lets a test move monotonic time ahead."""

    def __init__(self) -> None:
        self.skew = 0.0
        self.ticks = 0.0
        self.waiting: set[int] = set()
        self.stops: set[int] = set()

    def monotonic(self) -> float:
        return time.monotonic() + self.skew

    def wall(self) -> float:
        # Strictly increasing, so least-recently-used order never ties.
        self.ticks += 1.0
        return 1.8e9 + self.ticks

    def wait(self, event: threading.Event, timeout: float) -> bool:
        if id(event) not in self.stops:
            self.waiting.add(threading.get_ident())
        return event.wait(max(0.0, timeout))


def make_cache(
    root: Path,
    budget: int = GiB,
    *,
    gate: threading.Event | None = None,
    clock: SpyClock | None = None,
    **kw: object,
) -> tuple[EnvCache, CountingBuilder]:
    clock = clock or SpyClock()
    # What EnvCache would give the UvBuilder it makes, given to the counting one instead.
    builder_kw = {k: kw.pop(k) for k in ("build_user", "hierarchy") if k in kw}
    if "build_limits" in kw:
        builder_kw["limits"] = kw.pop("build_limits")
    sources = {k: kw.pop(k) for k in ("allow_source_builds",) if k in kw}
    # The test index listens on loopback: the owner's opt-in to private indexes.
    builder_kw.setdefault("index_policy", kw.pop("index_policy", OriginPolicy(private=True)))
    builder = CountingBuilder(root / ".python", gate, clock=clock, **builder_kw, **sources)
    cache = EnvCache(root, budget, builder=builder, clock=clock, **sources, **kw)  # type: ignore[arg-type]
    return cache, builder


def lines(index: PackageIndex, *reqs: str) -> list[str]:
    return ["# the job's extras", f"--index-url {index.url}", "", *reqs]


def acquire(cache: EnvCache, reqs: Sequence[str], *, python: str = PY, timeout: float = 120):
    return cache.acquire(python, reqs, stop=threading.Event(), timeout_s=timeout)


def run_as(user: str | None, argv: Sequence[str], env: dict[str, str] | None = None):
    prefix = []
    if user is not None:
        pw = pwd.getpwnam(user)
        prefix = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--"]
    return subprocess.run(
        [*prefix, *argv], capture_output=True, text=True, timeout=60, env=env, cwd="/"
    )


# --- building and reuse ------------------------------------------------------------------------


def test_build_once_then_reuse_also_after_a_restart(root: Path, index: PackageIndex) -> None:
    cache, builder = make_cache(root)
    reqs = lines(index, B)
    with acquire(cache, reqs) as env:
        assert env.built and env.build_seconds > 0
        assert env.python == env.path / "bin" / "python"
        # A module task runs the env's interpreter; the dependency comes along.
        done = run_as(None, [str(env.python), "-c", f"import {B}, {A}; print({A}.VERSION)"])
        assert done.stdout.strip() == "1.0", done.stderr
        # An argv task finds the env's console scripts first on PATH, with VIRTUAL_ENV set.
        task_env = env.env("/usr/bin:/bin")
        assert task_env["VIRTUAL_ENV"] == str(env.path)
        assert task_env["PATH"].split(":")[0] == str(env.path / "bin")
        done = run_as(None, ["flashnode-tpa"], env=task_env)
        assert done.stdout.strip() == "a says hi", done.stderr
        first = env.path

    # The same lines, differently laid out (comments, blanks, spaces) are the same environment.
    with acquire(cache, [f"  --index-url {index.url}  ", f"{B}   ", "# other comment"]) as env:
        assert not env.built and env.build_seconds == 0
        assert env.path == first
    assert builder.builds == 1

    restarted, builder2 = make_cache(root)
    with acquire(restarted, reqs) as env:
        assert not env.built and env.path == first
    assert builder2.builds == 0
    [info] = restarted.entries()
    assert info.python == PY and info.bytes > 0 and not info.in_use
    assert restarted.usage() == (info.bytes, GiB)


def test_the_order_of_the_lines_is_part_of_the_key(index: PackageIndex) -> None:
    one = EnvSpec.make(PY, [f"--index-url {index.url}", A, B])
    assert EnvSpec.make(PY, ["", f" --index-url {index.url}", "# c", A, f"{B} "]).key == one.key
    assert (
        EnvSpec.make(PY, [f"--index-url {index.url}  # ours", A, f"{B}\t# pinned"]).key == one.key
    )
    assert EnvSpec.make(PY, [f"--index-url {index.url}", B, A]).key != one.key
    assert EnvSpec.make("3.12", [f"--index-url {index.url}", A, B]).key != one.key


def test_several_threads_asking_for_new_lines_at_once_get_one_build(
    root: Path, index: PackageIndex
) -> None:
    gate = threading.Event()
    clock = SpyClock()
    cache, builder = make_cache(root, gate=gate, clock=clock)
    reqs = lines(index, A)
    got: list[object] = []

    def ask() -> None:
        stop = threading.Event()
        clock.stops.add(id(stop))
        try:
            got.append(cache.acquire(PY, reqs, stop=stop, timeout_s=120))
        except Exception as exc:
            got.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for("the first build to start", builder.started.is_set)
    # Every other thread is inside acquire, waiting on that build, before it may finish.
    wait_for("three waiters", lambda: len(clock.waiting) >= 3)
    gate.set()
    for t in threads:
        t.join(60)
    assert builder.builds == 1
    handles = [h for h in got if not isinstance(h, Exception)]
    assert len(handles) == 4, got
    assert sorted(h.built for h in handles) == [False, False, False, True]  # type: ignore[attr-defined]
    assert len({h.path for h in handles}) == 1  # type: ignore[attr-defined]
    [info] = cache.entries()
    assert info.in_use
    for h in handles:
        h.release()  # type: ignore[attr-defined]
    assert not cache.entries()[0].in_use


# --- budget -----------------------------------------------------------------------------------


def test_budget_evicts_the_least_recently_used_env_never_a_pinned_one(
    root: Path, index: PackageIndex
) -> None:
    probe, _ = make_cache(root)
    sizes = {}
    for name in (A, B, C):
        with acquire(probe, lines(index, name)) as env:
            sizes[name] = next(i.bytes for i in probe.entries() if i.path == env.path)
    probe.prune(everything=True)
    assert probe.entries() == []
    small = min(sizes.values())
    budget = sum(sorted(sizes.values())[1:]) + small // 2  # any two fit, never three

    cache, builder = make_cache(root, budget)
    pinned = acquire(cache, lines(index, B))  # the least recently used, but in use
    with acquire(cache, lines(index, A)):
        pass
    with acquire(cache, lines(index, C)) as c_env:  # over budget: A goes, B is pinned
        kept = {i.path for i in cache.entries()}
        assert kept == {pinned.path, c_env.path}
    assert builder.builds == 3
    used, limit = cache.usage()
    assert used <= limit

    # Once B is released, an env that comes back (A) pushes out the least recently used: B.
    pinned.release()
    with acquire(cache, lines(index, C)):
        pass
    with acquire(cache, lines(index, A)) as a_env:
        assert a_env.built
        assert {i.path for i in cache.entries()} == {a_env.path, c_env.path}


def test_an_env_over_the_whole_budget_is_kept_while_in_use(
    root: Path, index: PackageIndex, caplog: pytest.LogCaptureFixture
) -> None:
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, A)) as env:
        cache.reconfigure(1, 0, Limits())  # a reload lowers the budget below what is in use
        assert env.python.exists()
        assert [i.path for i in cache.entries()] == [env.path]
        assert "over its budget" in caplog.text
    assert cache.entries() == []


def test_a_build_is_bounded_by_the_budget_while_it_runs(root: Path, index: PackageIndex) -> None:
    """A build may write no more than ``env_cache_bytes`` (uv's cache with it): past it, it is
    stopped and fails as the job's, and leaves nothing."""
    cache, _ = make_cache(root, budget=64 * 1024, negative_ttl_s=0)
    with pytest.raises(EnvBuildFailed, match=r"grew past 64.0 KiB \(env_cache_bytes\)"):
        acquire(cache, lines(index, A))
    assert cache.entries() == [] and list((root / ".tmp").iterdir()) == []


def test_a_build_past_the_room_the_disk_set_is_the_nodes_shortage(
    root: Path, index: PackageIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the free space above ``min_free_bytes`` is less than ``env_cache_bytes``, a build
    past it is stopped as the node's shortage of disk (a lapse the black-hole guard does not
    count), never as the job's failure."""
    from flashnode.caches.envcache import publish

    # A disk with 64 KiB above a 1 GiB floor, whatever else writes to the real one meanwhile.
    monkeypatch.setattr(
        publish.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(4 * GiB, 0, GiB + 65536)
    )
    cache, _ = make_cache(root, min_free_bytes=GiB, negative_ttl_s=0)
    with pytest.raises(ShortOfRoom, match=r"low disk: .*grew past .*above min_free_bytes"):
        acquire(cache, lines(index, A))
    assert cache.entries() == [] and list((root / ".tmp").iterdir()) == []


def test_prune_everything_spares_what_is_in_use(root: Path, index: PackageIndex) -> None:
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, A)) as env:
        with acquire(cache, lines(index, C)):
            pass
        evicted = cache.prune(everything=True)
        assert [i.path for i in cache.entries()] == [env.path]
        assert len(evicted) == 1 and evicted[0].path != env.path
        # Another process (the owner's `flashnode envs prune`) sees the pin too.
        other = EnvCache(root, GiB)
        assert other.prune(everything=True) == []
        assert [i.in_use for i in other.entries()] == [True]
    assert [i.path for i in EnvCache(root, GiB).prune(everything=True)] == [env.path]
    assert sorted(p.name for p in root.iterdir()) == [".failed", ".locks", ".python", ".tmp"]
    assert [list((root / d).iterdir()) for d in (".locks", ".tmp")] == [[], []]


# --- whose fault -----------------------------------------------------------------------------


def test_a_bad_pin_fails_with_the_resolver_message_and_is_not_rebuilt_for_a_while(
    root: Path, index: PackageIndex
) -> None:
    clock = SpyClock()
    cache, builder = make_cache(root, clock=clock, negative_ttl_s=600)
    reqs = lines(index, f"{A}==9.9")
    with pytest.raises(EnvBuildFailed) as failed:
        acquire(cache, reqs)
    assert isinstance(failed.value, AttemptFailed)
    assert f"no version of {A.replace('_', '-')}==9.9" in str(failed.value)
    assert "==9.9" in failed.value.tail
    assert builder.builds == 1

    with pytest.raises(EnvBuildFailed) as again:
        acquire(cache, reqs)
    assert str(again.value) == str(failed.value)
    assert builder.builds == 1
    # A restarted agent remembers it too (on disk).
    restarted, builder2 = make_cache(root, clock=clock, negative_ttl_s=600)
    with pytest.raises(EnvBuildFailed):
        acquire(restarted, reqs)
    assert builder2.builds == 0
    # After the window, it is built again.
    clock.skew += 601
    with pytest.raises(EnvBuildFailed):
        acquire(cache, reqs)
    assert builder.builds == 2
    assert list(root.glob("*/env")) == []


def test_a_package_with_no_wheel_fails_when_source_builds_are_off(
    root: Path, index: PackageIndex
) -> None:
    cache, _ = make_cache(root)
    with pytest.raises(EnvBuildFailed, match="no usable wheels"):
        acquire(cache, lines(index, SRC))


@pytest.mark.parametrize("python", ["3.4", "3.99"])
def test_a_python_not_on_this_node_fails_naming_the_version(
    root: Path, index: PackageIndex, python: str
) -> None:
    cache, _ = make_cache(root)
    with pytest.raises(EnvBuildFailed, match=rf"Python {python}\b.*not available"):
        acquire(cache, lines(index, A), python=python)


@pytest.mark.parametrize("python", ["3", "python3.11", "3.11.4", ""])
def test_a_malformed_python_fails_without_a_build(root: Path, python: str) -> None:
    cache, builder = make_cache(root)
    with pytest.raises(EnvBuildFailed, match="major.minor"):
        acquire(cache, ["flashnode_testpkg_a"], python=python)
    assert builder.builds == 0


def test_an_unreachable_index_is_the_node_s_fault_and_is_not_remembered(root: Path) -> None:
    cache, builder = make_cache(root)
    reqs = [f"--index-url http://127.0.0.1:{free_port()}/simple/", A]
    with pytest.raises(EnvUnavailable, match="Connection refused"):
        acquire(cache, reqs)
    with pytest.raises(EnvUnavailable):
        acquire(cache, reqs)
    assert builder.builds == 2
    assert not isinstance(EnvUnavailable("x"), AttemptFailed)
    assert list((root / ".tmp").iterdir()) == []


def test_an_index_the_job_named_that_cannot_be_reached_is_an_endpoint_of_the_job(
    root: Path,
) -> None:
    """The black-hole guard counts such a lapse only across jobs: one job's dead index would
    otherwise bench every node it lands on. Lines that name no index, page or URL leave the
    default index: not the job's endpoint."""
    cache, _ = make_cache(root)
    with pytest.raises(EnvUnavailable) as caught:
        acquire(cache, [f"--index-url http://127.0.0.1:{free_port()}/simple/", A])
    assert caught.value.job_endpoint
    for named in (["--extra-index-url https://x.example/simple", A], [f"{A} @ https://x/a.whl"]):
        assert EnvSpec.make(PY, named).names_index()
    assert not EnvSpec.make(PY, [A, "numpy>=1; python_version >= '3.8'"]).names_index()


def test_credentials_in_an_index_url_never_reach_a_message(root: Path, index: PackageIndex) -> None:
    url = index.url.replace("http://", "http://ci-user:s3cr3t-t0ken@")
    cache, _ = make_cache(root)
    with pytest.raises(EnvBuildFailed) as failed:
        acquire(cache, [f"--index-url {url}", f"{A}==9.9"])
    text = str(failed.value) + failed.value.tail
    assert "s3cr3t" not in text and "ci-user" not in text
    with acquire(cache, [f"--index-url {url}", A]):
        [info] = cache.entries()
    assert not any("s3cr3t" in line for line in info.lines)
    assert "s3cr3t" not in (root / info.key / "meta.json").read_text()


@pytest.mark.usefixtures("as_root")
def test_a_vcs_line_past_the_checks_still_reaches_no_host(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second wall behind ``check_lines`` refusing VCS lines: git, should uv run it, may
    use no transport (``GIT_ALLOW_PROTOCOL``), and a reason never quotes its stderr."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = LocalHTTPServer(("127.0.0.1", 0), Handler).start()
    monkeypatch.setattr(envbuild, "check_lines", lambda lines: None)
    cache, _ = make_cache(root)
    try:
        with pytest.raises(EnvBuildFailed) as failed:
            acquire(cache, [f"git+http://127.0.0.1:{server.server_address[1]}/admin"])
    finally:
        server.close()
    assert seen == [], str(failed.value)
    assert "fatal:" not in str(failed.value) + failed.value.tail, str(failed.value)


def test_summaries_never_quote_gits_stderr() -> None:
    output = (
        "error: Git operation failed\n"
        "  Caused by: process didn't exit successfully: `/usr/bin/git fetch --force"
        " 'http://10.0.0.5/x'` (exit status: 128)\n"
        "--- stderr\n"
        "fatal: unable to access 'http://10.0.0.5/x/': The requested URL returned error: 401\n"
    )
    text = summarize(output)
    assert "Git operation failed" in text and "401" not in text and "fatal" not in text, text


# --- privileges ------------------------------------------------------------------------------


@pytest.mark.usefixtures("as_root")
def test_a_task_user_cannot_write_into_a_cached_env(root: Path, index: PackageIndex) -> None:
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, B)) as env:
        site = next(env.path.glob("lib/python*/site-packages"))
        attack = textwrap.dedent(
            f"""
            import os, sys
            import {A}  # the task can read and run what is there
            failures = []
            for path, mode in [
                ({str(site / A / "__init__.py")!r}, "a"),
                ({str(site / "evil.pth")!r}, "w"),
                ({str(env.path / "bin" / "python3.evil")!r}, "w"),
                ({str(env.path / "pyvenv.cfg")!r}, "a"),
            ]:
                try:
                    open(path, mode).write("import os; os.system('id')\\n")
                    failures.append(path)
                except PermissionError:
                    pass
            for victim in ({str(site / A)!r}, {str(env.path / "bin")!r}):
                try:
                    os.rename(victim, victim + ".moved")
                    failures.append(victim)
                except PermissionError:
                    pass
            print("WROTE" if failures else "REFUSED", failures)
            """
        )
        for user in ("nobody", f"{TASK_USER}-0", procs.BUILD_USER):
            try:
                pwd.getpwnam(user)
            except KeyError:
                continue
            done = run_as(user, [str(env.python), "-c", attack])
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("REFUSED"), done.stdout
        for path in [env.path, *env.path.rglob("*")]:
            st = path.lstat()
            assert st.st_uid == 0, path
            if not stat.S_ISLNK(st.st_mode):
                assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH), path
                assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), path


def build_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(procs.BUILD_USER)
    except KeyError:
        pytest.skip(f"{procs.BUILD_USER} does not exist (scripts/task-users makes it)")


def uv_for_others(root: Path) -> None:
    uv = UvBuilder(root / ".python").uv()
    if not others_can_run(Path(uv)):
        pytest.skip(f"{uv} is not reachable by other users")


def processes_of_the_build_user() -> list[str]:
    pw = build_user()
    return [psutil.Process(p).name() for p in procs.processes_of(pw.pw_uid)]


@pytest.mark.usefixtures("as_root")
def test_a_source_build_runs_as_the_build_user_and_leaves_an_env_it_cannot_write(
    root: Path, index: PackageIndex
) -> None:
    uv_for_others(root)
    pw = build_user()
    cache, builder = make_cache(root, allow_source_builds=True)
    with acquire(cache, lines(index, SRC)) as env:
        done = run_as(None, [str(env.python), "-c", f"import {SRC}; print({SRC}.BUILT_BY_UID)"])
        assert done.stdout.strip() == str(pw.pw_uid), done.stderr
        for path in [env.path, *env.path.rglob("*")]:
            assert path.lstat().st_uid == 0, path
        done = run_as(
            pw.pw_name, [str(env.python), "-c", f"import {SRC}, os; open({SRC}.__file__, 'a')"]
        )
        assert "PermissionError" in done.stderr
    assert builder.builds == 1


@pytest.mark.usefixtures("as_root")
def test_a_binary_build_runs_uv_as_the_build_user_and_no_code_of_the_job(
    root: Path, index: PackageIndex, drop_dir: Path
) -> None:
    """uv runs as the build user (its network access too), and the bytecode of the packages is
    compiled without running the .pth files a wheel installed: a binary build runs nothing of
    the job's, as anyone; the task that uses the environment runs them, as itself."""
    uv_for_others(root)
    pth = "flashnode_testpkg_pth"
    hook = (
        f"import os; open(os.path.join({str(drop_dir)!r}, 'pth-%d' % os.getuid()), 'w').close()\n"
    )
    index.add(build_wheel(pth, "1.0", extra_files={f"{pth}_hook.pth": hook}))
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, pth)) as env:
        assert list(drop_dir.iterdir()) == [], "a .pth of the job's ran while it was built"
        site = next(env.path.glob("lib/python*/site-packages"))
        assert list((site / pth / "__pycache__").glob("__init__.*.pyc")), "no bytecode"
        done = run_as(f"{TASK_USER}-0", [str(env.python), "-c", f"import {pth}"])
        assert done.returncode == 0, done.stderr
        task_uid = pwd.getpwnam(f"{TASK_USER}-0").pw_uid
        assert sorted(p.name for p in drop_dir.iterdir()) == [f"pth-{task_uid}"]
        # The task loads that bytecode (it could not write its own there) as it is.
        done = run_as(f"{TASK_USER}-0", [str(env.python), "-v", "-c", f"import {pth}"])
        assert f"matches {site / pth / '__init__.py'}" in done.stderr, done.stderr[-2000:]
    assert processes_of_the_build_user() == []


# A build backend's leftover (an sdist's, with source builds allowed): it runs as the build user
# with an empty environment, in a session of its own (no ownership token, no process group of
# the build's), watches /proc for the next build of another job (a process of its own uid whose
# working directory is a build's home/), and drops a .pth into that build's site-packages while
# uv still installs. Were it alive then, the agent would publish the .pth (a file of the build
# user's) in the other job's environment, and that job's tasks would run it.
TROJAN = r"""
import glob, os, re, time
MARKER = {marker!r}
here = os.getcwd()
while here != "/" and not os.path.exists(os.path.join(here, "requirements.txt")):
    here = os.path.dirname(here)
mine = here
me = os.getuid()
pat = re.compile(r"^(.*/\.tmp/[0-9a-f]{{64}}\.[0-9a-f]{{12}})/home$")
pth = "import os; open(os.path.join(%r, 'ran-as-%%d' %% os.getuid()), 'w').close()\n" % MARKER
open(os.path.join(MARKER, "lingering"), "w").close()
deadline = time.time() + 180
while time.time() < deadline:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat("/proc/" + pid).st_uid != me:
                continue
            m = pat.match(os.readlink("/proc/%s/cwd" % pid))
        except OSError:
            continue
        if not m or m.group(1) == mine:
            continue
        for sp in glob.glob(m.group(1) + "/env/lib/python*/site-packages"):
            try:
                with open(os.path.join(sp, "zz_flashnode_review.pth"), "w") as fh:
                    fh.write(pth)
            except OSError:
                continue
            open(os.path.join(MARKER, "planted"), "w").close()
            raise SystemExit(0)
    time.sleep(0.002)
"""


@pytest.mark.usefixtures("as_root")
def test_a_source_build_leaves_nothing_that_can_write_into_another_jobs_environment(
    root: Path, index: PackageIndex, drop_dir: Path
) -> None:
    """Job A (source builds allowed) depends on an sdist whose build backend leaves a process
    behind (TROJAN). Every process of the build user is killed when A's build ends, before
    anything of it is published and before job B's build starts: B's environment holds nothing
    of A's, and B's task runs nothing of A's."""
    uv_for_others(root)
    evil, victim = "flashnode_testpkg_trojan", "flashnode_testpkg_victim"
    index.add(
        build_sdist(evil, "1.0", linger_code=TROJAN.format(marker=str(drop_dir))),
        build_wheel(victim, "1.0"),
    )
    cache, _ = make_cache(root, allow_source_builds=True)
    with acquire(cache, lines(index, evil)):
        pass
    assert (drop_dir / "lingering").exists(), "job A's backend never left its process"
    left_after_a = processes_of_the_build_user()
    # Job B: binary wheels only in its lines, nothing of its own to build.
    with acquire(cache, lines(index, victim)) as env:
        planted = sorted(p.name for p in env.path.rglob("*.pth"))
        done = run_as(f"{TASK_USER}-0", [str(env.python), "-c", f"import {victim}"])
        assert done.returncode == 0, done.stderr
    ran = sorted(p.name for p in drop_dir.glob("ran-as-*"))
    assert (left_after_a, planted, ran) == ([], [], []), "job A's build reached job B's"
    assert not (drop_dir / "planted").exists()


@pytest.mark.usefixtures("as_root")
def test_a_build_process_that_escapes_the_kill_cannot_write_into_the_published_env(
    root: Path, index: PackageIndex, drop_dir: Path
) -> None:
    """A backend's leftover that opened a file of the environment while it was built: it is
    gone before the environment is published, and what it held open is not what is
    published."""
    uv_for_others(root)
    evil = "flashnode_testpkg_evil"
    index.add(build_sdist(evil, "1.0", linger_marker=str(drop_dir)))
    cache, _ = make_cache(root, allow_source_builds=True)
    with acquire(cache, lines(index, evil)) as env:
        assert (drop_dir / "opened").exists(), "the lingering process never got its descriptor"
        assert processes_of_the_build_user() == []
        assert not (drop_dir / "wrote").exists()
        assert "PWNED" not in (env.path / "pyvenv.cfg").read_text()
        for path in [env.path, *env.path.rglob("*")]:
            assert path.lstat().st_uid == 0, path


# What a build backend reports of where it runs (as a process it leaves behind, which the end of
# the build kills: it writes first).
WHERE = r"""
import json, os
info = {{"uid": os.getuid(), "groups": os.getgroups(), "tmp": sorted(os.listdir("/tmp"))}}
info["cgroup"] = open("/proc/self/cgroup").read()
info["limits"] = open("/proc/self/limits").read()
info["status"] = open("/proc/self/status").read()
info["cg_limits"] = {{}}
for line in info["cgroup"].splitlines():
    _, controllers, path = line.split(":", 2)
    for c in controllers.split(",") if controllers else [""]:
        for f in ("pids.max", "memory.max", "memory.limit_in_bytes"):
            try:
                info["cg_limits"][f] = open(f"/sys/fs/cgroup/{{c}}{{path}}/{{f}}").read().strip()
            except OSError:
                pass
with open(os.path.join({marker!r}, "where.json"), "w") as fh:
    json.dump(info, fh)
"""


@pytest.mark.usefixtures("as_root")
def test_a_build_runs_as_its_user_in_a_sandbox_and_a_cgroup_of_its_own_with_limits(
    root: Path, index: PackageIndex, drop_dir: Path
) -> None:
    uv_for_others(root)
    pw = build_user()
    hierarchy, why = cgroups.detect()
    if hierarchy is None:
        pytest.skip(f"no cgroups here: {why}")
    probe = "flashnode_testpkg_where"
    index.add(build_sdist(probe, "1.0", linger_code=WHERE.format(marker=str(drop_dir))))
    limits = Limits(memory_bytes=1 << 30, cpus=1.0, pids=321)
    cache, _ = make_cache(
        root, 64 << 20, allow_source_builds=True, hierarchy=hierarchy, build_limits=limits
    )
    with tempfile.NamedTemporaryFile(prefix="flashnode-host-tmp-") as host_tmp:
        with acquire(cache, lines(index, probe)):
            pass
        seen = json.loads((drop_dir / "where.json").read_text())
        assert Path(host_tmp.name).name not in seen["tmp"]  # a private /tmp
    assert (seen["uid"], seen["groups"]) == (pw.pw_uid, [])
    assert "NoNewPrivs:\t1" in seen["status"] and "CapEff:\t0000000000000000" in seen["status"]
    fsize = next(x for x in seen["limits"].splitlines() if x.startswith("Max file size"))
    assert fsize.split()[3] == str(64 << 20)
    paths = [line.split(":", 2)[2] for line in seen["cgroup"].splitlines()]
    [name] = {p.rsplit("/", 1)[1] for p in paths if "/build-" in p}
    got = seen["cg_limits"]
    assert got["pids.max"] == "321"
    assert got.get("memory.max", got.get("memory.limit_in_bytes")) == str(1 << 30)
    assert processes_of_the_build_user() == []
    for base in hierarchy.bases.values():  # removed with the build
        assert not (base / name).exists()


# Adds a key to its user's own keyring (KEY_SPEC_USER_KEYRING): that keyring belongs to the uid,
# not to any process or namespace, and would outlive the build.
PLANT_KEY = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(248, b"user", b"{name}", b"left by job A", 13, -4)  # add_key
"""
# Searches its user's keyring for that key: prints its id, or -1.
FIND_KEY = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.syscall(250, 10, -4, b"user", b"{name}", 0))  # keyctl(SEARCH)
"""


@pytest.mark.usefixtures("as_root")
def test_a_build_leaves_nothing_in_its_users_keyrings_for_the_next(
    root: Path, index: PackageIndex
) -> None:
    uv_for_others(root)
    pw = build_user()
    if platform.machine() != "x86_64":
        pytest.skip("the syscall numbers here are x86_64's")
    as_build = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--"]
    plant = subprocess.run(
        [*as_build, sys.executable, "-c", PLANT_KEY.format(name="flashnode-probe")], cwd="/"
    )
    found = subprocess.run(
        [*as_build, sys.executable, "-c", FIND_KEY.format(name="flashnode-probe")],
        capture_output=True,
        text=True,
        cwd="/",
    )
    if plant.returncode != 0 or found.stdout.strip() in ("", "-1"):
        pytest.skip("keyrings are denied here")
    keeper = "flashnode_testpkg_keeper"
    index.add(build_sdist(keeper, "1.0", linger_code=PLANT_KEY.format(name="job-a")))
    cache, _ = make_cache(root, allow_source_builds=True)
    with acquire(cache, lines(index, keeper)):
        pass
    found = subprocess.run(
        [*as_build, sys.executable, "-c", FIND_KEY.format(name="job-a")],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert found.stdout.strip() == "-1", "the build user's keyring kept job A's key"


@pytest.mark.usefixtures("as_root")
def test_a_root_agent_without_its_build_user_builds_nothing(
    root: Path, index: PackageIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procs, "BUILD_USER", "flashnode-no-such-user")
    cache, builder = make_cache(root)
    with pytest.raises(EnvUnavailable, match="flashnode-no-such-user does not exist"):
        acquire(cache, lines(index, C))
    assert builder.builds == 1 and cache.entries() == []
    assert list((root / ".tmp").iterdir()) == []


# --- stopping, timeouts, crashes --------------------------------------------------------------


def _wait_for_download(index: PackageIndex) -> None:
    wait_for("a file download", lambda: any(p.startswith("/files/") for p in index.requests))


def test_stop_kills_the_build_and_leaves_nothing(root: Path, index: PackageIndex) -> None:
    cache, _ = make_cache(root)
    index.requests.clear()
    index.files_gate.clear()
    stop = threading.Event()
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            cache.acquire(PY, lines(index, C), stop=stop, timeout_s=120)
        except BaseException as exc:
            outcome.append(exc)

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t = threading.Thread(target=ask)
    try:
        t.start()
        _wait_for_download(index)
        stop.set()
        t.join(30)
    finally:
        index.files_gate.set()
    assert not t.is_alive()
    assert [type(e) for e in outcome] == [Cancelled]
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, left
    assert cache.entries() == [] and list((root / ".tmp").iterdir()) == []


def test_a_build_that_outlasts_its_timeout_fails(root: Path, index: PackageIndex) -> None:
    cache, _ = make_cache(root, negative_ttl_s=0)
    index.files_gate.clear()
    try:
        started = time.monotonic()
        with pytest.raises(EnvBuildFailed, match="did not finish in time"):
            acquire(cache, lines(index, C), timeout=3)
        assert time.monotonic() - started < 20
    finally:
        index.files_gate.set()
    assert cache.entries() == [] and list((root / ".tmp").iterdir()) == []


CRASHING_AGENT = """
import sys, threading
from pathlib import Path
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.caches.envcache import EnvCache
cache = EnvCache(Path(sys.argv[1]), 1 << 30, index_policy=OriginPolicy(private=True))
cache.acquire(sys.argv[2], sys.argv[3:], stop=threading.Event(), timeout_s=120)
print("built")
"""


def test_a_crash_mid_build_leaves_no_usable_entry(root: Path, index: PackageIndex) -> None:
    reqs = lines(index, C)
    index.requests.clear()
    index.files_gate.clear()
    agent = subprocess.Popen(
        [sys.executable, "-c", CRASHING_AGENT, str(root), PY, *reqs],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        start_new_session=True,
    )
    try:
        _wait_for_download(index)
        family = [agent.pid] + [p.pid for p in psutil.Process(agent.pid).children(recursive=True)]
        for pid in family:
            os.kill(pid, signal.SIGKILL)
        agent.wait(10)
    finally:
        index.files_gate.set()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert any((root / ".tmp").iterdir()), "the crash should have left a half build"
    assert not list(root.glob("*/env"))

    cache, builder = make_cache(root)
    assert cache.entries() == []
    assert list((root / ".tmp").iterdir()) == []  # swept at start
    with acquire(cache, reqs) as env:
        assert env.built
        done = run_as(None, [str(env.python), "-c", f"import {C}"])
        assert done.returncode == 0, done.stderr
    assert builder.builds == 1


# --- pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "-r /etc/shadow",
        "--requirement=/etc/shadow",
        "-c constraints.txt",
        "-e .",
        "--editable git+https://example.org/x.git",
        "./local/pkg",
        "/abs/path/pkg.whl",
        "~/pkg",
        "pkg @ file:///etc/passwd",
        "file:///etc/passwd",
        "--index-url file:///etc",
        "--index-url ftp://example.org/simple",
        "--index-url https://example.org/a https://example.org/b",
        "--trusted-host example.org",
        "--extra-index-url",
        "pkg==1.0 -r /etc/shadow",
        "--index-url https://${HOME}@example.org/simple",
        "pkg\x00==1",
        "pkg @ /etc/passwd",
        "a/../../home/owner/private.whl",
        "pkg/sub",
        "private.whl",
        "pkg-1.0.tar.gz",
        "pkg.zip",
        "pkg.egg",
        "pkg==1.0; sys_platform == 'linux' and extra == '/etc/passwd'",
    ],
)
def test_lines_that_would_read_this_host_are_refused(line: str) -> None:
    with pytest.raises(EnvBuildFailed, match="refused"):
        check_lines([line])


@pytest.mark.parametrize(
    "line",
    [
        "numpy==2.0",
        "torch>=2; platform_machine == 'x86_64'",
        "requests[socks]~=2.31",
        "pkg==1.0 --hash=sha256:" + "a" * 64,
        "pkg @ https://example.org/pkg-1.0-py3-none-any.whl",
        "https://example.org/pkg-1.0-py3-none-any.whl",
        "--index-url https://example.org/simple",
        "-i https://user:pw@example.org/simple/",
        "--extra-index-url=https://example.org/simple",
        "--find-links https://example.org/wheels/",
        "--no-index",
    ],
)
def test_ordinary_lines_are_accepted(line: str) -> None:
    check_lines([line])


@pytest.mark.parametrize(
    "line",
    [
        "git+http://127.0.0.1:8080/admin",
        "GIT+HTTPS://example.org/x.git",
        "pkg @ git+https://example.org/x.git",
        "hg+http://127.0.0.1/x",
        "svn+svn://127.0.0.1/x",
        "bzr+ftp://127.0.0.1/x",
        "https://example.org/go?to=gopher://127.0.0.1/x",
        "--index-url ssh://example.org/simple",
        "pkg @ http://127.0.0.1:8080\\@8.8.8.8/pkg-1.0-py3-none-any.whl",
        "http://127.0.0.1\\@8.8.8.8/pkg-1.0-py3-none-any.whl",
        "--index-url http://127.0.0.1\\@8.8.8.8/simple",
        "pkg @ http://127.0.0.1%2f.example.org/pkg-1.0-py3-none-any.whl",
        "pkg @ http://127%2e0.0.1/pkg-1.0-py3-none-any.whl",
        "pkg @ https://[::1%25lo]/pkg-1.0-py3-none-any.whl",
        "pkg @ http://exa_mple.org/pkg-1.0-py3-none-any.whl",
        "pkg @ http:/127.0.0.1/pkg-1.0-py3-none-any.whl",
        "pkg @ https://example.org/pkg-1.0-py3-none-any.whl;python_version>'3'",
        "-i http://example.org:port/simple",
        "-i https://user:tok@en@example.org/simple",
    ],
)
def test_lines_whose_url_uv_could_read_otherwise_than_the_checks_are_refused(line: str) -> None:
    with pytest.raises(EnvBuildFailed, match="refused"):
        check_lines([line])


@pytest.mark.parametrize(
    ("line", "host"),
    [
        ("-i https://user:tok%40en@example.org/simple", "example.org"),
        ("pkg @ HTTPS://Example.org:8443/pkg-1.0-py3-none-any.whl", "example.org"),
        ("HTTP://[2001:db8::1]:8080/pkg-1.0-py3-none-any.whl", "2001:db8::1"),
    ],
)
def test_the_host_checked_is_the_one_uv_connects_to(line: str, host: str) -> None:
    check_lines([line])
    asked: list[str] = []

    def resolver(name: str, port: int) -> list[str]:
        asked.append(name)
        return ["8.8.8.8"]

    check_endpoints([line], OriginPolicy(), resolver)
    assert asked == [host]


# Outputs of uv 0.13 (NO_COLOR), as the builds above print them.
RESOLVER = """Using Python 3.11.2 environment at: env
error: No solution found when resolving dependencies
  cause: Because there is no version of flashnode-testpkg-a==9.9 and you require flashnode-testpkg-a==9.9, we can conclude that your requirements are unsatisfiable.
"""
NO_WHEEL = """error: No solution found when resolving dependencies
  cause: Because flashnode-testpkg-c==1.0 has no usable wheels and only flashnode-testpkg-c==1.0 is available, we can conclude that all versions of flashnode-testpkg-c cannot be used.
hint: Wheels are required for `flashnode-testpkg-c` because building from source is disabled
"""
NOT_FOUND = """error: No solution found when resolving dependencies
  cause: Because timeout-decorator was not found in the package registry and you require timeout-decorator, we can conclude that your requirements are unsatisfiable.
"""
PARSE = """error: Couldn't parse requirement in `requirements.txt` at position 43
  cause: Expected one of `@`, `(`, `<`, `=`, `>`, `~`, `!`, `;`, found `i`
"""
REFUSED = """error: Request failed after 3 retries in 10.6s
  cause: Failed to fetch: http://127.0.0.1:9/simple/x/
  cause: error sending request for url (http://127.0.0.1:9/simple/x/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: Connection refused (os error 111)
"""
DNS = """error: Request failed after 3 retries in 7.9s
  cause: Failed to fetch: http://nonexistent.invalid/simple/x/
  cause: dns error
  cause: failed to lookup address information: Name or service not known
"""
SERVER = """error: Request failed after 3 retries in 4.3s
  cause: Failed to fetch: http://127.0.0.1:45385/files/x-1.0-py3-none-any.whl
  cause: HTTP status server error (503 Service Unavailable) for url (http://127.0.0.1:45385/files/x-1.0-py3-none-any.whl)
"""
FORBIDDEN = """error: Failed to fetch: https://example.org/files/x-1.0-py3-none-any.whl
  cause: HTTP status client error (403 Forbidden) for url (https://example.org/files/x-1.0-py3-none-any.whl)
"""
DISK = """error: Failed to install: x-1.0-py3-none-any.whl (x==1.0)
  cause: failed to write to file `/var/lib/flashnode/envs/.tmp/k/env/lib/x.py`: No space left on device (os error 28)
"""
BUILD = """error: Failed to build `x @ https://example.org/x-1.0.tar.gz`
  cause: The build backend returned an error
  cause: Call to `setuptools.build_meta.build_wheel` failed (exit status: 1)
"""


@pytest.mark.parametrize(
    ("code", "output", "fault"),
    [
        (1, RESOLVER, "job"),
        (1, NO_WHEEL, "job"),
        (1, NOT_FOUND, "job"),
        (2, PARSE, "job"),
        (1, BUILD, "job"),
        (2, FORBIDDEN, "job"),
        (2, REFUSED, "node"),
        (2, DNS, "node"),
        (2, SERVER, "node"),
        (2, DISK, "node"),
        (-9, "", "node"),
    ],
)
def test_uv_failures_are_classified_by_output_and_exit_status(
    code: int, output: str, fault: str
) -> None:
    assert classify(code, output) == fault


@pytest.mark.parametrize(
    "line",
    [
        "--index-url http://127.0.0.1:8080/simple",
        "-i http://169.254.169.254/latest/meta-data/",
        "--extra-index-url=http://192.168.1.1/admin",
        "--find-links http://10.0.0.5/links",
        "x @ https://[::1]:8443/x-1.0-py3-none-any.whl",
        "http://[::ffff:127.0.0.1]/x-1.0-py3-none-any.whl",
        "--index-url https://rebound.example/simple",  # resolves to loopback (below)
    ],
)
def test_lines_naming_non_public_addresses_are_the_jobs_fault(line: str) -> None:
    def resolver(host: str, port: int) -> list[str]:
        return ["93.184.215.14", "127.0.0.1"] if host == "rebound.example" else [host]

    with pytest.raises(EnvBuildFailed, match="is refused: its host is a") as caught:
        check_endpoints([line, "x"], OriginPolicy(), resolver)
    assert "env_allow_private_indexes" in str(caught.value)


def test_the_owner_allows_private_indexes_by_network_but_never_link_local_by_true() -> None:
    def resolver(host: str, port: int) -> list[str]:
        return [host]

    lan = ["--index-url http://10.0.0.5/simple", "x"]
    check_endpoints(lan, OriginPolicy.of(["10.0.0.0/8"]), resolver)
    with pytest.raises(EnvBuildFailed):
        check_endpoints(["--index-url http://10.1.0.5/simple"], OriginPolicy.of(["10.0.0.0/24"]))
    check_endpoints(lan, OriginPolicy.of(True), resolver)
    metadata = ["--index-url http://169.254.169.254/", "x"]
    with pytest.raises(EnvBuildFailed, match="link-local"):
        check_endpoints(metadata, OriginPolicy.of(True), resolver)
    check_endpoints(["--index-url https://8.8.8.8/simple", "x"], OriginPolicy(), resolver)


def test_a_host_that_does_not_exist_is_the_jobs_fault_naming_its_line() -> None:
    def resolver(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    line = "--index-url https://nowhere.invalid/simple"
    with pytest.raises(EnvBuildFailed, match="does not exist") as caught:
        check_endpoints([line, "x"], OriginPolicy(), resolver)
    assert repr(line) in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        OSError("Network is unreachable"),
    ],
)
def test_a_resolver_that_fails_is_the_nodes_at_the_jobs_endpoint(error: OSError) -> None:
    def resolver(host: str, port: int) -> list[str]:
        raise error

    with pytest.raises(EnvUnavailable, match="does not resolve") as caught:
        check_endpoints(
            ["--index-url https://nowhere.invalid/simple", "x"], OriginPolicy(), resolver
        )
    assert caught.value.job_endpoint


def test_summaries_quote_no_hint_and_no_status_a_server_answered() -> None:
    unauthorized = (
        "error: Failed to fetch: `http://10.0.0.5/admin/x/`\n"
        "  Caused by: HTTP status client error (401 Unauthorized) for url (http://10.0.0.5/admin/x/)\n"
        "hint: An index URL (http://10.0.0.5/admin) could not be queried due to a lack of valid"
        " authentication credentials (401 Unauthorized).\n"
    )
    text = summarize(unauthorized)
    assert "401" not in text and "Unauthorized" not in text and "hint" not in text, text
    assert "HTTP client error" in text and "http://10.0.0.5/admin/x/" in text, text


def test_summaries_are_bounded_and_redacted() -> None:
    noisy = (
        "Resolved 3 packages in 2ms\n"
        + RESOLVER
        + "cause: see https://bob:hunter22@idx.example.org/simple\n"
    )
    text = summarize(noisy, ("hunter22",))
    assert text.startswith("error: No solution found")
    assert "hunter22" not in text and "bob" not in text and "Resolved" not in text
    assert len(summarize("error: x\n" + "y" * 5000 + "\n" * 30 + "z")) <= 1000


def test_describe_names_entries_bytes_and_budget(root: Path, index: PackageIndex) -> None:
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, A)):
        text = "\n".join(describe(cache.entries(), cache.budget))
    assert (
        A in text and "in use" in text and "1 environment(s)" in text and "1.0 GiB budget" in text
    )


# --- the owner's view ---------------------------------------------------------------------------


def test_the_owner_lists_and_prunes_envs_never_one_in_use(
    root: Path, index: PackageIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from flashnode.cli import envs as envs_cli

    monkeypatch.delenv("FLASHNODE_COORDINATOR", raising=False)
    state = ["--state-dir", str(root.parent)]
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, A)):
        pass
    pinned = acquire(cache, lines(index, C))
    cli = CliRunner()

    listed = cli.invoke(envs_cli.envs, ["list", *state])
    assert listed.exit_code == 0, listed.output
    assert A in listed.output and C in listed.output
    assert "2 environment(s)" in listed.output and "1 in use" in listed.output
    rows = [
        json.loads(line)
        for line in cli.invoke(envs_cli.envs, ["list", "--json", *state]).output.splitlines()
    ]
    assert {r["in_use"] for r in rows} == {True, False} and all(r["python"] == PY for r in rows)

    pruned = cli.invoke(envs_cli.envs, ["prune", "--all", *state])
    assert pruned.exit_code == 0, pruned.output
    assert "removed" in pruned.output and "1 environment(s)" in pruned.output
    assert [i.path for i in cache.entries()] == [pinned.path]
    assert pinned.python.exists()
    pinned.release()
    assert "removed" in cli.invoke(envs_cli.envs, ["prune", "--all", *state]).output
    assert cache.entries() == []

    nothing = cli.invoke(envs_cli.envs, ["list", "--state-dir", str(root.parent / "none")])
    assert nothing.exit_code == 0 and "no environment cache" in nothing.output
    assert not (root.parent / "none").exists()


class RecordingReport:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str]] = []

    def ok(self, what: str, detail: str = "") -> None:
        self.lines.append(("ok", what, detail))

    def warn(self, what: str, detail: str) -> None:
        self.lines.append(("warn", what, detail))

    def fail(self, what: str, problem: str, fix: str) -> None:
        self.lines.append(("fail", what, problem))


def test_doctor_shows_the_cache_entries_bytes_and_budget(root: Path, index: PackageIndex) -> None:
    from flashnode.cli import envs as envs_cli
    from flashnode.config.settings import Settings

    settings = Settings(
        coordinator="http://127.0.0.1:1",
        runner="trusted",
        pools=("p",),
        state_dir=root.parent,
        task_user=TASK_USER,
        env_cache_bytes=GiB,
    )
    cache, _ = make_cache(root)
    with acquire(cache, lines(index, A)):
        report = RecordingReport()
        envs_cli.doctor(report, settings)
    levels = {what: (level, detail) for level, what, detail in report.lines}
    assert levels["uv"][0] == "ok"
    level, detail = levels["job environments"]
    assert level == "ok" and "1 environment(s)" in detail and "of 1.0 GiB budget" in detail
    assert "1 in use" in detail and "binary wheels only" in detail


def test_a_rejoined_task_pins_its_environment_again_and_no_eviction_takes_it(
    root: Path, index: PackageIndex
) -> None:
    """An agent that restarts under a running task pins that task's environment again by its
    key (the pin of the agent before went with it): the budget evicts another one instead."""
    probe, _ = make_cache(root)
    sizes = {}
    for name in (A, B, C):
        with acquire(probe, lines(index, name)) as env:
            sizes[name] = next(i.bytes for i in probe.entries() if i.path == env.path)
    probe.prune(everything=True)
    budget = sum(sorted(sizes.values())[1:]) + min(sizes.values()) // 2  # two fit, never three

    first, _ = make_cache(root, budget)
    with acquire(first, lines(index, B)) as used:
        key, path = used.key, used.path
    restarted, _ = make_cache(root, budget)  # the next agent
    assert restarted.pin("../" + key) is None and restarted.pin("0" * 64) is None
    pinned = restarted.pin(key)
    assert pinned is not None and pinned.path == path
    with acquire(restarted, lines(index, A)):
        pass
    with acquire(restarted, lines(index, C)):  # over budget: A goes, the rejoined one stays
        assert path in {i.path for i in restarted.entries()}
    pinned.release()
