"""Building one job environment with uv: what a job's lines may say, how uv runs, whose fault
a failure is. The cache of built environments is flashnode.caches.envcache.

An environment is the requirement lines a job names, installed with uv into a relocatable venv
for the Python (``major.minor``) the job names, found on this machine, or fetched as a managed
interpreter under the cache root when the owner allows downloads.

Privileges. No code of a job runs as root, as the agent, or as any user something else runs as:

* A root agent builds as its build user (``procs.BUILD_USER``, which nothing else runs as), one
  build at a time, in a sandbox (private ``/tmp``, ``/var/tmp``, ``/dev/shm``, IPC), in a cgroup
  of its own with the per-task limits, through ``setpriv`` (no supplementary groups, no
  capabilities, no_new_privs). uv itself runs so, and its network access with it (an owner's
  per-uid firewall rules apply to it). Before a build starts and after it ends every process of
  that user is killed, and nothing is copied, published or built again until none is left.
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
  stopped and fails as the job's.

uv reads no configuration and no credentials from the host (``UV_NO_CONFIG``, its own ``HOME``,
no keyring); the only index credentials it ever sees are those in the job's own lines, which are
redacted from every message and record. A job's lines are accepted only in a form judged in full
(``_line_problem``): they may not make uv read a file of this host (``-r``, ``-c``, ``-e``, a
``/`` outside a URL, a bare archive name and ``file:`` URLs are refused) or run a VCS (no scheme
but http(s)), nor name a URL whose host Python and uv could read apart (a backslash, anything but
a plain host after at most one ``@``), nor, before the build, a URL whose host does not exist or
has an address the owner does not allow (``check_endpoints``: the dataset origins'
``OriginPolicy``, ``env_allow_private_indexes``). uv resolves each host again itself:
DNS rebinding, a public index's redirects and the links its pages list are not checked here.

Why one module of this size: uv's invocation, the checks of a job's lines, the build's bounds and
the classification of uv's failures belong together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sysconfig
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Protocol
from urllib.parse import unquote, urlsplit

from flashnode.caches.datacache import Resolver, resolve
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.errors import Cancelled, EnvBuildFailed, EnvUnavailable
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.helpers import popen_as
from flashnode.sandbox.procs.keyrings import clear_user_keyrings
from flashnode.sandbox.procs.mounts import PRIVATE_DIRS, Sandbox
from flashnode.sandbox.workspace import remove_tree

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout of an environment changes: old keys are then never reused
PYTHON_VERSION = re.compile(r"^[0-9]{1,2}\.[0-9]{1,3}$")
MAX_LINES = 1000
MAX_LINE_CHARS = 4096
TAIL_LINES = 10
MAX_REASON_CHARS = 1000
OUTPUT_TAIL_BYTES = 64 * 1024
POLL_S = 0.05

# Options a job's lines may carry. Everything else (``-r``, ``-c``, ``-e``, local paths, file:
# URLs) would make the agent read files on this host, and is refused.
URL_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
FLAG_OPTIONS = {"--no-index"}
URL_SCHEMES = ("http", "https")
SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # any, anywhere: git+http://, ftp://, ...
# What the resolver answers for a name that does not exist (a job's), not for a failed lookup.
NO_SUCH_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
URL_LINE = re.compile(r"https?://", re.IGNORECASE)
# A URL's host as both Python's urlsplit and uv (WHATWG) read it, nothing they could read apart.
HOST = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")
# A requirement's name (PEP 508); a name with an archive's ending would be read as a local file.
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
ARCHIVES = (".whl", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip", ".egg")

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


COMMENT = re.compile(r"(^|\s+)#.*$")  # pip's rule: a '#' after whitespace (a URL's fragment stays)


def normalise(lines: Sequence[str]) -> tuple[str, ...]:
    """The lines that matter: without comments, stripped, without blank lines, in order."""
    kept = (COMMENT.sub("", line).strip() for line in lines)
    return tuple(line for line in kept if line)


def check_lines(lines: Sequence[str]) -> None:
    """Refuse, with the job's fault, a line that would make uv read anything on this host."""
    if len(lines) > MAX_LINES:
        raise EnvBuildFailed(f"too many dependency lines ({len(lines)} > {MAX_LINES})")
    for line in lines:
        why = _line_problem(line)
        if why:
            shown = redact(line, secrets_in([line]))[:200]
            raise EnvBuildFailed(f"dependency line {shown!r} is refused: {why}")


def _line_problem(line: str) -> str | None:
    if len(line) > MAX_LINE_CHARS:
        return "too long"
    if any(ord(c) < 32 or ord(c) == 127 for c in line):
        return "control characters"
    if "\\" in line:
        return "backslashes are not allowed"
    if "${" in line:
        return "environment variables are not expanded"
    if "file:" in line.lower():
        return "local files are not allowed"
    for scheme in SCHEME.finditer(line):
        if scheme.group(1).lower() not in URL_SCHEMES:
            return "only http(s) URLs are allowed (no VCS or other schemes)"
    words = line.split()
    if line.startswith("-"):
        option, _, value = words[0].partition("=")
        if option in FLAG_OPTIONS and len(words) == 1 and not value:
            return None
        if option not in URL_OPTIONS:
            return "only --index-url, --extra-index-url, --find-links and --no-index are allowed"
        rest = [value] if value else words[1:]
        if len(rest) != 1 or len(words) > (1 if value else 2):
            return f"{option} takes exactly one URL"
        return None if _is_url(rest[0]) else f"{option} needs an http(s) URL"
    if URL_LINE.match(line):
        if len(words) != 1:
            return "a URL line takes nothing after the URL"
        return None if _is_url(words[0]) else "not an http(s) URL with a plain host"
    name = NAME.match(line)
    if not name or not re.match(r"$|[\s\[(<>=!~;@]", line[name.end() :]):
        return "not a requirement (local paths are not allowed)"
    if name.group().lower().endswith(ARCHIVES):
        return "not a requirement (local files are not allowed)"
    outside = line
    if "@" in line.split(";", 1)[0]:
        before, _, after = line.partition("@")
        target = after.split()
        if not target or ";" in target[0] or not _is_url(target[0]):
            return "a direct reference must be an http(s) URL with a plain host"
        outside = " ".join([before, *target[1:]])
    if "/" in outside:
        return "not a requirement (local paths are not allowed)"
    for word in words[1:]:
        if word.startswith("-") and not word.startswith("--hash"):
            return f"option {word.split('=')[0]} is not allowed after a requirement"
    return None


def _is_url(value: str) -> bool:
    """An http(s) URL whose host both Python and uv read alike: letters, digits, dots and
    hyphens, or a bracketed IPv6 literal, after at most one ``@`` (credentials before it; an
    ``@`` in them is written ``%40``, else part of them would go unredacted)."""
    try:
        parts = urlsplit(value)
        _ = parts.port
    except ValueError:
        return False
    if parts.netloc.count("@") > 1:
        return False
    host = re.sub(r":[0-9]*$", "", parts.netloc.rpartition("@")[2])
    return parts.scheme in URL_SCHEMES and bool(parts.hostname) and bool(HOST.fullmatch(host))


def endpoints(lines: Sequence[str]) -> list[tuple[str, str]]:
    """Every URL the (checked) lines name, with its line: an index, an extra index, a page of
    links, a direct reference."""
    found = []
    for line in lines:
        words = line.split()
        if line.startswith("-"):
            option, _, value = words[0].partition("=")
            if option in URL_OPTIONS:
                found.append((line, value or words[1]))
        elif URL_LINE.match(line):
            found.append((line, words[0]))
        elif "@" in line.split(";", 1)[0]:
            found.append((line, line.split("@", 1)[1].split(";", 1)[0].split()[0]))
    return found


def check_endpoints(
    lines: Sequence[str], policy: OriginPolicy, resolver: Resolver = resolve
) -> None:
    """Refuse, with the job's fault, a line whose URL's host has an address the owner's
    ``env_allow_private_indexes`` does not allow (the dataset origins' rule, ``OriginPolicy``):
    by default loopback, private and link-local addresses. Every address the host resolves to
    must pass. A host the resolver says does not exist is the job's too (any job can name
    one); EnvUnavailable when resolving fails otherwise (no network, a resolver that does not
    answer: the node's)."""
    hidden = secrets_in(lines)
    for line, url in endpoints(lines):
        parts = urlsplit(url)
        host = parts.hostname or ""
        shown = redact(line, hidden)[:200]
        try:
            addresses = resolver(host, parts.port or (443 if parts.scheme == "https" else 80))
        except socket.gaierror as exc:
            if exc.errno in NO_SUCH_HOST:
                raise EnvBuildFailed(
                    f"dependency line {shown!r} is refused: its host does not exist"
                ) from None
            addresses = []
        except (OSError, ValueError, UnicodeError):
            addresses = []
        if not addresses:
            raise EnvUnavailable(
                f"dependency line {shown!r}: its host does not resolve here", job_endpoint=True
            )
        for address in addresses:
            problem = policy.problem(address)
            if problem:
                raise EnvBuildFailed(
                    f"dependency line {shown!r} is refused: its host is {problem}"
                    " (the owner allows indexes at such addresses with env_allow_private_indexes)"
                )


def secrets_in(lines: Sequence[str]) -> tuple[str, ...]:
    """Credentials the lines carry in URLs (``https://user:token@host``): never shown."""
    found: set[str] = set()
    for match in re.finditer(r"[A-Za-z][A-Za-z0-9+.-]*://([^/\s@]+)@", "\n".join(lines)):
        userinfo = match.group(1)
        for part in (userinfo, *userinfo.split(":", 1)):
            for form in (part, unquote(part)):
                if len(form) >= 3:
                    found.add(form)
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, hidden: Sequence[str] = ()) -> str:
    """``text`` without URL credentials and without any of ``hidden``."""
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@", r"\1***@", text)
    for secret in hidden:
        text = text.replace(secret, "***")
    return text


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


# --- how uv's failures are classified ----------------------------------------------------------

Fault = Literal["job", "node"]

NODE_RESOURCE = re.compile(
    r"No space left on device|os error 28\)|Disk quota exceeded|os error 122\)"
    r"|Read-only file system|os error 30\)|Too many open files|Cannot allocate memory"
    r"|Permission denied \(os error 13\)"
)
JOB_RESOLUTION = re.compile(r"No solution found when resolving|Failed to build|Failed to parse")
NODE_NETWORK = re.compile(
    r"error sending request|tcp connect error|dns error|failed to lookup address"
    r"|Connection refused|Connection reset|connection closed|network timeout|operation timed out"
    r"|HTTP status server error|invalid peer certificate|certificate verify failed"
    r"|Network is unreachable|No route to host|HTTP status client error \((407|408|429)\b"
)


def unreachable(output: str) -> bool:
    """Whether uv failed for want of an index (connection, DNS, TLS, 5xx, timeouts), not of a
    resource of this node's."""
    return not NODE_RESOURCE.search(output) and bool(NODE_NETWORK.search(output))


def classify(returncode: int, output: str) -> Fault:
    """Whose fault a failed uv run is, from its exit status and its output.

    The node's: killed by a signal it did not ask for, out of disk or memory, an index it cannot
    reach (connection, DNS, TLS, 5xx, timeouts). The job's: everything else, chiefly what the
    resolver or a build says about the job's lines (no such version, a conflict, no wheel for
    this Python, a line uv cannot parse).
    """
    if returncode < 0:
        return "node"
    if NODE_RESOURCE.search(output):
        return "node"
    if JOB_RESOLUTION.search(output):
        return "job"
    if NODE_NETWORK.search(output):
        return "node"
    return "job"


NOISE = re.compile(
    r"^(Using (CPython|Python)|Creating virtual environment|Activate with|Resolved |Prepared |"
    r"Installed |Uninstalled |Audited |Bytecode compiled| [+-] |\s*hint:)"
)
# What a server answered (a status line, its reason phrase): never told back to a job, whose
# lines may name any server it likes; the kind of failure (client or server error) stays.
HTTP_STATUS = re.compile(r"HTTP status (client|server) error \([^)]*\)")


def summarize(output: str, hidden: Sequence[str] = ()) -> str:
    """The last meaningful lines of uv's output, redacted, bounded, one per line; without uv's
    hints and without what a server answered (``HTTP_STATUS``, git's stderr)."""
    lines = [
        HTTP_STATUS.sub(r"HTTP \1 error", redact(line.rstrip(), hidden))
        for line in output.splitlines()
    ]
    if "Git operation failed" in output:  # git's stderr tells what a host answered: not shown
        lines = lines[
            : next((i for i, line in enumerate(lines) if line.strip() == "--- stderr"), None)
        ]
    lines = [line for line in lines if line.strip() and not NOISE.match(line)]
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if start is not None:
        lines = lines[start:]
    lines = [line[:300] for line in lines[-TAIL_LINES:]]
    text = "\n".join(lines)
    if len(text) > MAX_REASON_CHARS:
        text = text[:300] + " … " + text[-(MAX_REASON_CHARS - 305) :]
    return text


def size(n: int) -> str:
    """``1.5 GiB``, ``312.0 KiB``, ``12 B``: for the owner's eyes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


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


@dataclass(frozen=True)
class DiskRoom:
    """What a build may write (its directory and uv's cache together): ``bytes``, and which
    bound that is (``env_cache_bytes``, or the free space above ``min_free_bytes``)."""

    bytes: int
    bound: str

    def exceeded(self) -> str:
        return f"the environment grew past {size(self.bytes)} ({self.bound}) while it was built"


@dataclass(frozen=True)
class TreeStats:
    bytes: int
    files: int


BUILD_TMP_BYTES = 256 * 1024 * 1024  # each private tmpfs of a build's sandbox
WALK_EVERY_S = 1.0  # the disk watch walks the build's tree at least this often
INODE_BYTES = 4096  # what each file and directory counts at least: empty files are not free
MAX_DEPTH = 64  # deeper trees are refused (the published copy refuses them too)


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
                _reclaim(work)
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

    def _box(self, user: procs.TaskUser | None, token: str, work: Path, room: DiskRoom) -> _Box:
        """Where the build's steps run: nothing of the build user's is left from before, a
        cgroup of its own, a sandbox, no file past the room, the watch on the room."""
        rlimits = [f"--fsize={room.bytes}", "--core=0"]
        if user is None:
            return _Box(None, token, None, None, rlimits, _DiskWatch(work, room, self.clock))
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
            rlimits.append(f"--nproc={self.limits.pids}")
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
        return _Box(user, token, cgroup, sandbox, rlimits, _DiskWatch(work, room, self.clock))

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


class _Box:
    """What one build's steps run in (``UvBuilder._box``); ``close`` ends everything it ran."""

    def __init__(
        self,
        user: procs.TaskUser | None,
        token: str,
        cgroup: cgroups.AttemptCgroup | None,
        sandbox: Sandbox | None,
        rlimits: list[str],
        watch: _DiskWatch,
    ) -> None:
        self.user, self.token, self.cgroup, self.sandbox = user, token, cgroup, sandbox
        self.rlimits, self.watch = rlimits, watch

    def close(self) -> None:
        """Kill what the build ran: its cgroup, then every process of its user (or, for an
        agent that is not root, every holder of its token); then empty that user's keyrings
        (they belong to no namespace: the next build would find them). EnvUnavailable when a
        process of the build user is still there: nothing of this build is used then."""
        if self.cgroup is not None and not self.cgroup.remove():
            log.warning("a build's cgroup could not be removed: %s", self.cgroup.paths)
        if self.user is None:
            _kill_owned(self.token, os.geteuid())
            return
        left = procs.end_processes_of(self.user)
        if left:
            raise EnvUnavailable(f"{len(left)} process(es) of {self.user.name} outlived the build")
        why = clear_user_keyrings(self.user)
        if why:
            log.error("cannot clear the keyrings of %s: %s", self.user.name, why)


class _DiskWatch:
    """A build's use of the disk against its room: its tree walked at least every
    ``WALK_EVERY_S`` (less often when a walk is slow: never more than a twentieth of the time),
    and at once when the file system lost more than the room since the build started."""

    def __init__(self, top: Path, room: DiskRoom, clock: Clock) -> None:
        self.top, self.room, self.clock = top, room, clock
        self._free0 = _free_bytes(top)
        self._next = 0.0
        self._soon = 0.0

    def over(self, now: bool = False) -> bool:
        """Whether the build holds more than its room (walked now when ``now``)."""
        t = self.clock.monotonic()
        free = _free_bytes(self.top)
        lost = self._free0 - free if free is not None and self._free0 is not None else 0
        if not now and t < self._next and (lost <= self.room.bytes or t < self._soon):
            return False
        started = time.monotonic()
        used = tree_bytes(self.top)
        took = time.monotonic() - started
        self._next = t + max(WALK_EVERY_S, 20 * took)
        self._soon = t + max(POLL_S, 4 * took)
        return used is None or used > self.room.bytes


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def tree_bytes(top: Path) -> int | None:
    """What the tree under ``top`` holds: the blocks of each inode once, and at least
    ``INODE_BYTES`` per entry; never following a symlink, one directory descriptor open per
    level. None when it is deeper than ``MAX_DEPTH``."""
    seen: set[tuple[int, int]] = set()

    def walk(fd: int, depth: int) -> int | None:
        if depth > MAX_DEPTH:
            return None
        total, subdirs = 0, []
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += INODE_BYTES
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
        for name in subdirs:
            try:
                sub = os.open(name, NOFOLLOW_DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                below = walk(sub, depth + 1)
            finally:
                os.close(sub)
            if below is None:
                return None
            total += below
        return total

    try:
        fd = os.open(top, NOFOLLOW_DIR)
    except OSError:
        return 0
    try:
        return walk(fd, 0)
    finally:
        os.close(fd)


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
        box: _Box | None,
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
                box.rlimits if box else (),
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
            raise EnvBuildFailed(box.watch.room.exceeded())
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


def _kill_owned(token: str, uid: int) -> None:
    """Kill every process of ``uid`` that carries the build's token, until none answers."""
    deadline = time.monotonic() + procs.KILL_ROUNDS_S
    while time.monotonic() < deadline:
        hit = False
        for pid in procs.find_owned(token, uid):
            hit = procs.signal_if_owned(pid, token, None, signal.SIGKILL) or hit
        if not hit:
            return
        time.sleep(0.02)


def _reclaim(work: Path) -> None:
    """Take the scratch directory back from the build user: the agent's, 0700."""
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, os.geteuid(), os.getegid())
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file, link or tree without following a symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_tree(path)
    else:
        path.unlink()


def secure_tree(top: Path) -> TreeStats:
    """Make ``top`` the agent's and read-only to everyone else: dirs 0755, files 0755 if they
    were executable else 0644, no special files; never following a symlink. For a tree only the
    agent wrote (a tree someone else wrote is copied: copy_tree). Returns its bytes (allocated)
    and files."""
    uid, gid = os.geteuid(), os.getegid()
    total = files = 0

    def fail(exc: OSError) -> None:
        raise exc

    for _, dirnames, filenames, dirfd in os.fwalk(top, follow_symlinks=False, onerror=fail):
        st = os.fstat(dirfd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(dirfd, uid, gid)
        os.fchmod(dirfd, 0o755)
        total += st.st_blocks * 512
        for name in (*dirnames, *filenames):
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
                try:
                    if (st.st_uid, st.st_gid) != (uid, gid):
                        os.fchown(fd, uid, gid)
                    os.fchmod(fd, 0o755 if st.st_mode & 0o111 else 0o644)
                finally:
                    os.close(fd)
                files += 1
            else:
                os.unlink(name, dir_fd=dirfd)
                continue
            total += st.st_blocks * 512
    return TreeStats(total, files)


NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def copy_tree(src: Path, dest: Path, allowed_uids: set[int]) -> None:
    """Copy a tree someone else wrote into ``dest`` (new), the agent's, dirs 0755, files 0644 or
    0755 (their times kept), symlinks as symlinks, nothing else. Every open is relative to a
    directory descriptor and never follows a symlink, so swapping a directory for a link
    mid-copy leads nowhere. A file with more than one link, or owned by a uid outside
    ``allowed_uids``, is refused (it could be another file of this host): EnvBuildFailed."""
    top = os.open(src, NOFOLLOW_DIR)
    try:
        os.mkdir(dest, 0o700)
        out = os.open(dest, NOFOLLOW_DIR)
        try:
            _copy_dir(top, out, allowed_uids, depth=0)
            os.fchmod(out, 0o755)
        finally:
            os.close(out)
    finally:
        os.close(top)


def _copy_dir(src: int, dest: int, allowed_uids: set[int], depth: int) -> None:
    if depth > 64:
        raise EnvBuildFailed("the build left a directory tree too deep to copy")
    for entry in os.scandir(src):
        name = entry.name
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dest)
        elif stat.S_ISDIR(st.st_mode):
            sub = os.open(name, NOFOLLOW_DIR, dir_fd=src)
            try:
                os.mkdir(name, 0o700, dir_fd=dest)
                out = os.open(name, NOFOLLOW_DIR, dir_fd=dest)
                try:
                    _copy_dir(sub, out, allowed_uids, depth + 1)
                    os.fchmod(out, 0o755)
                finally:
                    os.close(out)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src, dest, name, allowed_uids)


def _copy_file(src: int, dest: int, name: str, allowed_uids: set[int]) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        if st.st_nlink > 1 or st.st_uid not in allowed_uids:
            raise EnvBuildFailed(f"the build left a file that is not its own ({name})")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(name, flags, 0o600, dir_fd=dest)
        try:
            with open(fd, "rb", closefd=False) as reader, open(out, "wb", closefd=False) as writer:
                shutil.copyfileobj(reader, writer, 1024 * 1024)
            os.fchmod(out, 0o755 if st.st_mode & 0o111 else 0o644)
            # Its times kept: a compiled module's bytecode names its source's modification time.
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def others_can_run(path: Path) -> bool:
    """Whether a user other than the owner can execute ``path`` (every directory above it
    searchable, the file itself readable and executable)."""
    try:
        real = Path(os.path.realpath(path))
        if stat.S_IMODE(real.stat().st_mode) & 0o005 != 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in real.parents)
    except OSError:
        return False
