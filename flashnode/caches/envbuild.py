"""Building one job environment with uv: how uv runs, as whom and in what, and the fresh copy
of what it built. The cache of built environments is flashnode.caches.envcache; what a job's
lines may say is flashnode.caches.envlines, whose fault uv's failure is flashnode.caches.envfaults,
a build's bounds flashnode.caches.envbox, and its files flashnode.caches.envtree.

An environment is the requirement lines a job names, installed with uv into a relocatable venv
for the Python (``major.minor``) the job names, found on this machine, or fetched as a managed
interpreter under the cache root when the owner allows downloads.

Privileges. No code of a job runs as root, as the agent, or as any user something else runs as:

* A root agent builds as its build user (``procs.BUILD_USER``, which nothing else runs as), one
  build at a time, in a sandbox (private ``/tmp``, ``/var/tmp``, ``/dev/shm``, IPC), in a cgroup
  of its own with the per-task limits, as a task is launched (``procs.enter``: no
  supplementary groups, no capabilities, no_new_privs). uv itself runs so, and its network
  access with it (an owner's per-uid firewall rules apply to it). Before a build starts and
  after it ends every process of that user is killed, and nothing is copied, published or
  built again until none is left.
* By default uv installs binary wheels only (``--only-binary :all:``): installing a wheel unpacks
  files and runs nothing of them. Bytecode is compiled by the base interpreter, isolated and
  without site (``-I -S``): no ``.pth`` file a wheel installed runs. When the owner allows source
  builds, a package's build backend (job code) runs, as the build user.
* The agent finds (or, where the owner allows, fetches) the interpreter itself: no URL of the
  job's is involved. It takes the scratch directory back afterwards (chown to the agent, 0700)
  and publishes a fresh copy of the environment, the agent's and read-only to others, made
  through file descriptors that never follow a symlink, refusing any file that is not the build
  user's own (another owner, a second link).
* A build's disk is bounded while it runs: no file may grow past its room (``prlimit --fsize``),
  and its whole tree (uv's cache with it) is watched against the room; past it the build is
  stopped and fails as the job's, or, where the room was the free space above ``min_free_bytes``
  (less than ``env_cache_bytes``), lapses as the node's shortage (``ShortOfRoom``).

uv reads no configuration and no credentials from the host (``UV_NO_CONFIG``, its own ``HOME``,
no keyring); the only index credentials it ever sees are those in the job's own lines, which are
redacted from every message and record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sysconfig
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from flashnode.caches.envbox import BUDGET_BOUND, POLL_S, BuildBox, BuildWatch, DiskRoom
from flashnode.caches.envfaults import classify, summarize, unreachable
from flashnode.caches.envlines import (
    URL_LINE,
    check_endpoints,
    check_lines,
    normalise,
    redact,
    secrets_in,
)
from flashnode.caches.envtree import copy_tree, others_can_run, reclaim, remove
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.errors import Cancelled, EnvBuildFailed, EnvUnavailable, ShortOfRoom
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.helpers import popen_as
from flashnode.sandbox.procs.mounts import PRIVATE_DIRS, Sandbox

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout of an environment changes: old keys are then never reused
PYTHON_VERSION = re.compile(r"^[0-9]{1,2}\.[0-9]{1,3}$")
OUTPUT_TAIL_BYTES = 64 * 1024

# The agent's environment variables uv may see: how this host reaches the network.
PASS_THROUGH = (
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "UV_HTTP_TIMEOUT",
    "UV_HTTP_RETRIES",
    "UV_HTTP_CONNECT_TIMEOUT",
    "UV_NATIVE_TLS",
    "UV_SYSTEM_CERTS",
    "UV_PYTHON_INSTALL_MIRROR",
    "UV_CONCURRENT_DOWNLOADS",
)


# --- what an environment is --------------------------------------------------------------------


def platform_tag() -> str:
    """The platform environments are built for, e.g. ``linux-x86_64``."""
    return sysconfig.get_platform()


def env_key(python: str, platform: str, lines: Sequence[str]) -> str:
    blob = json.dumps(
        {"format": FORMAT, "python": python, "platform": platform, "lines": list(lines)},
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class EnvSpec:
    """One environment: a Python version, a platform and the normalised requirement lines."""

    python: str
    platform: str
    lines: tuple[str, ...]

    @classmethod
    def make(cls, python: str, lines: Sequence[str], platform: str | None = None) -> EnvSpec:
        """Validate and normalise; raises EnvBuildFailed (the job's fault) for bad input."""
        if not isinstance(python, str) or not PYTHON_VERSION.match(python):
            raise EnvBuildFailed(f"python {str(python)[:40]!r} is not a major.minor version")
        if isinstance(lines, str) or not all(isinstance(line, str) for line in lines):
            raise EnvBuildFailed("dependencies must be a list of requirement lines")
        normal = normalise(lines)
        check_lines(normal)
        return cls(python, platform or platform_tag(), normal)

    @property
    def key(self) -> str:
        return env_key(self.python, self.platform, self.lines)

    def requirements(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    def hidden(self) -> tuple[str, ...]:
        return secrets_in(self.lines)

    def names_index(self) -> bool:
        """Whether the lines name where packages come from (an index, a page of links, a
        direct URL): an endpoint of the job's own."""
        return any(
            line.startswith("-") or URL_LINE.match(line) or "@" in line.split(";", 1)[0]
            for line in self.lines
        )

    def shown_lines(self) -> list[str]:
        hidden = self.hidden()
        return [redact(line, hidden) for line in self.lines]


def _one_line(tail: str) -> str:
    return " / ".join(" ".join(line.split()) for line in tail.splitlines()) or "no output"


# --- the builder ---------------------------------------------------------------------------


class Builder(Protocol):
    def build(
        self, spec: EnvSpec, work: Path, *, stop: threading.Event, deadline: float, room: DiskRoom
    ) -> Path:
        """Build ``spec`` as a relocatable venv inside ``work`` (an empty directory the agent
        owns, 0700) before ``deadline`` (on the cache's monotonic clock), writing at most
        ``room``; return its path, owned by the agent and read-only to everyone else. Raises
        EnvBuildFailed (the job's lines, or a build that outgrew ``room``), EnvUnavailable (the
        node) or Cancelled (``stop`` was set); what it started is dead when it returns or
        raises."""


BUILD_TMP_BYTES = 256 * 1024 * 1024  # each private tmpfs of a build's sandbox


class UvBuilder:
    """Builds environments with uv: interpreter, venv, the job's lines, bytecode.

    A root agent builds as ``build_user`` (default: ``procs.BUILD_USER``), one build at a
    time, in a sandbox (private ``/tmp``, ``/var/tmp``, ``/dev/shm``, IPC), in a cgroup of its
    own with ``limits`` (where ``hierarchy`` is given), with no file larger than its room; its
    tree is watched against its room while it runs. Before a build starts and after it ends,
    every process of ``build_user`` is killed, and a build starts, or its result is copied,
    only once none is left. An agent that is not root builds as itself (it runs its tasks as
    itself too)."""

    def __init__(
        self,
        python_dir: Path,
        *,
        allow_python_downloads: bool = False,
        allow_source_builds: bool = False,
        index_policy: OriginPolicy | None = None,
        build_user: procs.TaskUser | None = None,
        hierarchy: cgroups.Hierarchy | None = None,
        limits: Limits | None = None,
        clock: Clock | None = None,
        uv: str | None = None,
    ) -> None:
        self.python_dir = python_dir
        self.allow_python_downloads = allow_python_downloads
        self.allow_source_builds = allow_source_builds
        self.index_policy = index_policy or OriginPolicy()
        self.build_user = build_user
        self.hierarchy = hierarchy
        self.limits = limits or Limits()
        self.clock = clock or SystemClock()
        self._uv = uv
        self._one = threading.Lock()  # one build at a time: its user is the same for all
        # Build cgroups of this cache only: another agent's (tests share one base) are not ours.
        digest = hashlib.sha256(str(python_dir.resolve()).encode()).hexdigest()
        self._cgroup_prefix = f"build-{digest[:12]}-"

    def uv(self) -> str:
        if self._uv is None:
            try:
                import uv

                self._uv = uv.find_uv_bin()
            except (ImportError, FileNotFoundError) as exc:
                raise EnvUnavailable(f"uv is not installed on this node ({exc})") from None
        return self._uv

    def user(self) -> procs.TaskUser | None:
        """Who builds: ``build_user``, else the agent's build user (a root agent's), else
        None (the agent itself, not root). EnvUnavailable when a root agent has none."""
        if self.build_user is not None:
            return self.build_user
        try:
            return procs.own_user(procs.BUILD_USER)
        except LookupError as exc:
            raise EnvUnavailable(
                f"this node cannot build job environments: {exc} ({procs.USERS_FIX})"
            ) from None

    def build(
        self, spec: EnvSpec, work: Path, *, stop: threading.Event, deadline: float, room: DiskRoom
    ) -> Path:
        check_endpoints(spec.lines, self.index_policy)
        uv = self.uv()
        user = self.user()
        token = procs.new_token()
        for sub in ("home", "tmp", "cache", "agent-cache"):
            (work / sub).mkdir(mode=0o700)
        requirements = work / "requirements.txt"
        requirements.write_text(spec.requirements())
        requirements.chmod(0o644)
        run = _Runner(self.clock, stop, deadline, spec, work)
        # The agent's own steps (finding or fetching an interpreter: no URL or code of the
        # job's) keep a cache apart from the one the build user writes.
        interpreter = self._interpreter(
            uv, spec, self._environment(work, token, "agent-cache"), run
        )
        env = self._environment(work, token, "cache")
        target = work / "env"
        with self._turn(stop, deadline):
            box = self._box(user, token, work, room)
            try:
                if user is not None:
                    for path in (work, work / "home", work / "tmp", work / "cache"):
                        os.chown(path, user.uid, user.gid)
                run(
                    [uv, "venv", "--relocatable", "--no-project", "--python", interpreter, target],
                    env,
                    box,
                    "creating the venv",
                )
                python = target / "bin" / "python"
                install: list[str | Path] = [uv, "pip", "install", "--python", python]
                if not self.allow_source_builds:
                    install += ["--only-binary", ":all:"]
                run([*install, "-r", requirements], env, box, "installing")
                # Bytecode, by the base interpreter (not the environment's, whose site would
                # run the .pth files a wheel installed), isolated and without site: compiling
                # runs no code of the job's.
                sites = sorted(str(p) for p in target.glob("lib/python*/site-packages"))
                compile_all = [interpreter, "-I", "-S", "-m", "compileall", "-q", "-j", "0"]
                run([*compile_all, *sites], env, box, "compiling bytecode", ok=(0, 1))
            finally:
                box.close()
                reclaim(work)
        for sub in ("home", "tmp", "cache", "agent-cache", "requirements.txt"):
            remove(work / sub)
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            raise EnvBuildFailed("the build left no environment")
        if user is not None:
            # Fresh copies that no process has open (none of the build user's is left, but one
            # could have handed a descriptor to another), never the originals.
            fresh = work / "env.copy"
            copy_tree(target, fresh, allowed_uids={user.uid, os.geteuid()})
            remove(target)
            os.rename(fresh, target)
        if os.geteuid() == 0 and not others_can_run(target / "bin" / "python"):
            raise EnvUnavailable(
                f"the Python {spec.python} interpreter uv chose is not readable by task users"
            )
        return target

    @contextlib.contextmanager
    def _turn(self, stop: threading.Event, deadline: float) -> Iterator[None]:
        """This builder's one build at a time."""
        while not self._one.acquire(timeout=POLL_S):
            if stop.is_set():
                raise Cancelled("stopped while waiting for another environment's build")
            if self.clock.monotonic() >= deadline:
                raise EnvUnavailable("another environment's build took the time this one had")
        try:
            yield
        finally:
            self._one.release()

    def _box(self, user: procs.TaskUser | None, token: str, work: Path, room: DiskRoom) -> BuildBox:
        """Where the build's steps run: nothing of the build user's is left from before, a
        cgroup of its own, a sandbox, no file past the room, the watch on the room."""
        rlimits = {"fsize": room.bytes, "core": 0}
        if user is None:
            return BuildBox(None, token, None, None, rlimits, BuildWatch(work, room, self.clock))
        real = work.resolve()
        for private in PRIVATE_DIRS:
            if real.is_relative_to(Path(private).resolve()):
                raise EnvUnavailable(
                    f"the environment cache lies under {private}, of which builds get a private"
                    " copy: move the state dir"
                )
        left = procs.end_processes_of(user, self.clock)
        if left:
            raise EnvUnavailable(
                f"{len(left)} process(es) of {user.name} would not end: no build starts"
            )
        if self.limits.pids is not None:
            rlimits["nproc"] = self.limits.pids
        cgroup = None
        if self.hierarchy is not None:
            self.hierarchy.sweep(self._cgroup_prefix)  # what a crash of this agent left
            try:
                cgroup = self.hierarchy.create(self._cgroup_prefix + token[:12], self.limits)
            except OSError as exc:
                raise EnvUnavailable(
                    f"cannot make the build's cgroup ({exc.strerror or exc})"
                ) from None
        sandbox = Sandbox(BUILD_TMP_BYTES, keep_agent=True)
        return BuildBox(user, token, cgroup, sandbox, rlimits, BuildWatch(work, room, self.clock))

    def _environment(self, work: Path, token: str, cache: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASS_THROUGH if k in os.environ}
        env.update(
            PATH=os.environ.get("PATH") or os.defpath,
            HOME=str(work / "home"),
            TMPDIR=str(work / "tmp"),
            LANG="C.UTF-8",
            NO_COLOR="1",
            UV_NO_CONFIG="1",
            UV_NO_PROGRESS="1",
            UV_CACHE_DIR=str(work / cache),
            UV_PYTHON_INSTALL_DIR=str(self.python_dir),
            UV_PYTHON_INSTALL_BIN="0",
            UV_PYTHON_DOWNLOADS="manual" if self.allow_python_downloads else "never",
            UV_KEYRING_PROVIDER="disabled",
            # No line may name a VCS (check_lines); should uv run git anyway, it reaches nothing.
            GIT_ALLOW_PROTOCOL="none",
        )
        env[procs.OWNER_ENV] = token
        return env

    def _interpreter(self, uv: str, spec: EnvSpec, env: dict[str, str], run: _Runner) -> str:
        """An interpreter for ``spec.python`` that task users can run; installs one (managed,
        under the cache root) if none is found and downloads are allowed."""
        found = self._find(uv, spec, env, run)
        if found is None and self.allow_python_downloads:
            run([uv, "python", "install", "--no-bin", spec.python], env, None, "installing Python")
            found = self._find(uv, spec, env, run)
        if found is None:
            where = "" if self.allow_python_downloads else " (Python downloads are off)"
            raise EnvBuildFailed(f"Python {spec.python} is not available on this node{where}")
        return found

    def _find(self, uv: str, spec: EnvSpec, env: dict[str, str], run: _Runner) -> str | None:
        args = [uv, "python", "list", "--only-installed", "--output-format", "json", spec.python]
        try:
            out = run(args, env, None, f"finding Python {spec.python}", capture=True)
        except EnvBuildFailed as exc:
            raise EnvBuildFailed(
                f"Python {spec.python} is not available on this node: {_one_line(exc.tail)}",
                exc.tail,
            ) from None
        try:
            listed = json.loads(out)
            candidates = [
                (str(e["path"]), e["version_parts"]) for e in listed if isinstance(e, dict)
            ]
        except (ValueError, KeyError, TypeError):
            raise EnvUnavailable("uv python list answered something that is not a list") from None
        major, minor = (int(p) for p in spec.python.split("."))
        for path, parts in candidates:
            if (parts.get("major"), parts.get("minor")) != (major, minor):
                continue
            if os.geteuid() == 0 and not others_can_run(Path(path)):
                log.debug("skipping %s: task users cannot run it", path)
                continue
            return path
        return None


class _Runner:
    """Runs one uv command at a time under the build's stop event, deadline and disk watch."""

    def __init__(
        self, clock: Clock, stop: threading.Event, deadline: float, spec: EnvSpec, work: Path
    ) -> None:
        self.clock, self.stop, self.deadline = clock, stop, deadline
        self.spec, self.work = spec, work

    def __call__(
        self,
        argv: Sequence[str | Path],
        env: Mapping[str, str],
        box: BuildBox | None,
        step: str,
        capture: bool = False,
        ok: tuple[int, ...] = (0,),
    ) -> str:
        """Run to completion; the stdout when ``capture``. ``box``: the build's (None: the
        agent's own step). Raises the classified failure."""
        if self.stop.is_set():
            raise Cancelled(f"stopped before {step}")
        try:
            proc = popen_as(
                [str(a) for a in argv],
                env,
                box.user if box else None,
                box.sandbox if box else None,
                box.cgroup if box else None,
                box.rlimits if box else None,
                cwd=self.work / "home",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                umask=0o022,
            )
        except OSError as exc:
            raise EnvUnavailable(f"cannot run uv ({exc.strerror or exc})") from None
        assert proc.stdout is not None and proc.stderr is not None
        out = _Tail(proc.stdout, 1024 * 1024 if capture else OUTPUT_TAIL_BYTES)
        err = _Tail(proc.stderr, OUTPUT_TAIL_BYTES)
        why: str | None = None
        try:
            while proc.poll() is None:
                if self.stop.is_set():
                    why = "stopped"
                    break
                if self.clock.monotonic() >= self.deadline:
                    why = "timeout"
                    break
                if box is not None and box.watch.over():
                    why = "too big"
                    break
                self.clock.wait(self.stop, POLL_S)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.join()
            err.join()
        if why == "stopped":
            raise Cancelled(f"stopped while {step}")
        if why == "timeout":
            raise EnvBuildFailed(
                f"building the Python {self.spec.python} environment did not finish in time"
                f" (while {step})"
            )
        if box is not None and (
            why == "too big"
            or proc.returncode == -signal.SIGXFSZ
            or (proc.returncode not in ok and box.watch.over(now=True))
        ):
            room = box.watch.room
            if room.bound != BUDGET_BOUND:  # the disk set it: this node is short of disk now
                raise ShortOfRoom(f"low disk: {room.exceeded()}", needed=(room.bytes, 0))
            raise EnvBuildFailed(room.exceeded())
        if proc.returncode not in ok:
            text = err.text() + ("" if capture else out.text())
            tail = summarize(text, self.spec.hidden())
            reason = f"{_one_line(tail)} (uv exit status {proc.returncode})"
            if classify(proc.returncode, text) == "node":
                raise EnvUnavailable(
                    f"cannot build the environment while {step}: {reason}",
                    job_endpoint=self.spec.names_index() and unreachable(text),
                )
            raise EnvBuildFailed(
                f"cannot build the Python {self.spec.python} environment: {reason}", tail
            )
        return out.text()


class _Tail:
    """Reads a pipe on its own thread, keeping its last ``cap`` bytes."""

    def __init__(self, pipe: IO[bytes], cap: int) -> None:
        self._pipe = pipe
        self._cap = cap
        self._data = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        fd = self._pipe.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._data += chunk
            if len(self._data) > self._cap:
                del self._data[: len(self._data) - self._cap]
        self._pipe.close()

    def join(self) -> None:
        # A leftover child holding the pipe must not hold up the build: the reader is a daemon.
        self._thread.join(2.0)

    def text(self) -> str:
        return bytes(self._data).decode("utf-8", errors="replace")
