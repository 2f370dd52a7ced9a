"""A task's supervisor: the process that holds a trusted task while the agent comes and goes.

The agent starts one per launch chain (``Launch``), in a session of its own. The supervisor is
the chain's parent, so it is what learns the task's exit status; it copies the task's output
pipes into their size-capped files (``logcap.CappedFile``) and keeps what the chain says on its
fault channel; and it keeps the task only while an agent is there for it. Its first agent is
connected through a socket pair from the start; a later agent on the same state dir connects to
``sock`` in the supervisor's directory (``home``: in the agent's state dir, root's alone; only a
peer of the supervisor's own user is accepted). With no agent connected for ``reattach_seconds``
(none came back after a restart or a crash), or past the end of the task's lease as last told,
it ends the task (every process in its cgroup, its group while it is unreaped, its token
holders), removes its cgroup and its directory, and exits; as it does on an error of its own. A
chain no task took yet (one kept ahead) is ended as soon as its agent goes. It holds the lock of
the task's user while it runs (``userlocks``): no other agent takes that user meanwhile.

Lines on the socket. The supervisor says ``pid <pid> <start time>`` to every agent that
connects, and ``exit <json>`` once the task's main process has exited (its exit status, the
fault channel, the last bytes of its stderr: on the socket, never only in a file, so that a task
that filled the disk cannot take its end along). An agent says ``task <json>`` (where the task's
output goes, its cap, and the task's identity: what to end), ``lease <seconds>`` (the lease
lives that long from now), ``done`` (it has read the task's end: the supervisor exits),
``end`` (it will not rejoin the task: end it now) and, to a container's watch, ``started``
(the container runs: its engine client may load now). The last line the task printed is written
to ``last`` at most once a second, for the owner's live view.

Forked by the agent's fork server (``forkserver``: ``run``); ``Supervised`` is the agent's side.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Everything its way of ending a task needs is loaded at its start: the package may be removed or
# upgraded under a supervisor that waits for its agent.
from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.logcap import CappedFile, latest_line
from flashnode.sandbox.procs import enter, forkserver, reap, start_time
from flashnode.sandbox.removal import remove_tree

HOMES = "tasks"  # <state dir>/tasks/<dir>: each running task's supervisor
SOCK = "sock"
LAST = "last"
FAULT_BYTES = 4096  # what is kept of a fault channel
FAULT_END = 64  # and of its last bytes (the chain's last word)
READ_CHUNK = 64 * 1024
DRAIN_S = 0.2  # after the main process exits, output is read while it keeps coming this often
DRAIN_MAX_S = 2.0  # ... and no longer than this (a detached descendant may hold a pipe)
LAST_EVERY_S = 1.0
ANSWER_S = 10.0  # the longest an agent waits for a supervisor's first line
REMOVE_TRIES_S = 3600.0  # how long a container's watch asks an engine that is away
END_WAIT_S = 15.0  # the longest an agent waits for a supervisor it told to end its task
LOAD_AFTER_S = 2.0  # a container's watch loads its engine client this long after its start
SERVER = forkserver.ForkServer(__name__)  # this agent's, forking this module's ``run``


# --- the supervisor's process ------------------------------------------------------------------


class _Lifeline:
    """The agents connected: the first one's socket pair, then whoever connects to ``sock``
    (only the supervisor's own user); what they say, line by line (``heard``)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.home = spec["home"]
        self.reattach_s = float(spec["reattach_seconds"])
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCK)
        self.listener.bind(SOCK)
        self.listener.listen(8)
        life = socket.socket(fileno=spec["fds"]["life"])
        self.conns: dict[int, tuple[socket.socket, bytearray]] = {
            life.fileno(): (life, bytearray())
        }
        self.alone_since: float | None = None
        self.lease_until = float("inf")  # monotonic: when the task's lease ends, as last told
        self.done = False
        self.ending = False

    def hello(self, conn: socket.socket) -> None:
        """What an agent that connects is told first."""

    def heard(self, word: str, arg: str) -> None:
        if word == "done":
            self.done = True
        elif word == "end":  # an agent that will not rejoin it: end it now
            self.ending = True
        elif word == "lease":
            with contextlib.suppress(ValueError):
                self.lease_until = time.monotonic() + float(arg)

    def alone_for(self, now: float) -> float:
        """How long no agent has been connected (0 while one is)."""
        if self.conns:
            self.alone_since = None
            return 0.0
        if self.alone_since is None:
            self.alone_since = now
        return now - self.alone_since

    def given_up(self, now: float, limit: float) -> bool:
        """No agent connected, for ``limit`` seconds or past the lease's end (an agent that
        came back then could not renew it)."""
        alone = self.alone_for(now)
        if self.ending:
            return True
        return not self.conns and (alone >= limit or now >= self.lease_until)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.geteuid():
            conn.close()
            return
        self.conns[conn.fileno()] = (conn, bytearray())
        self.hello(conn)

    def _hear(self, fd: int) -> None:
        conn, buf = self.conns[fd]
        try:
            chunk = conn.recv(READ_CHUNK)
        except OSError:
            chunk = b""
        if not chunk:
            conn.close()
            del self.conns[fd]
            return
        buf += chunk
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            word, _, arg = line.decode("utf-8", "replace").partition(" ")
            self.heard(word, arg)

    def _say(self, data: bytes, only: socket.socket | None = None) -> None:
        for fd, (conn, _) in list(self.conns.items()):
            if only is not None and conn is not only:
                continue
            try:
                conn.sendall(data)
            except OSError:
                conn.close()
                del self.conns[fd]

    def _remove_home(self) -> None:
        """No agent reads what is here any more: the directory goes (the next agent reaps by
        the record)."""
        for name in (SOCK, LAST, LAST + ".tmp", "supervisor.log"):
            with contextlib.suppress(OSError):
                os.unlink(name)
        with contextlib.suppress(OSError):
            os.rmdir(self.home)


class _ContainerWatch(_Lifeline):
    """A container's watch: the engine runs the container; this only removes it when no agent
    came back within ``reattach_seconds``."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__(spec)
        self.container = str(spec["container"])
        self.docker_host = str(spec["docker_host"])
        self._engine: Any = None  # its client: made when it first removes (the engine may be away)
        self._say(b"pid 0 0\n")
        # Its engine client's code (a few hundred milliseconds of CPU to load) waits while the
        # agent creates and starts the container, until the agent says something or goes, and
        # no longer than LOAD_AFTER_S: the container's start does not share the CPU with it.
        waiting = select.poll()
        for fd in self.conns:
            waiting.register(fd, select.POLLIN)
        with contextlib.suppress(OSError):
            waiting.poll(LOAD_AFTER_S * 1000)
        import docker

        self._docker = docker

    def hello(self, conn: socket.socket) -> None:
        self._say(b"pid 0 0\n", conn)

    def run(self) -> None:
        poller = select.poll()
        while not self.done:
            if self.given_up(time.monotonic(), self.reattach_s):
                self._remove_container()
                self._remove_home()
                return
            watched = [self.listener.fileno(), *self.conns]
            for fd in watched:
                poller.register(fd, select.POLLIN)
            try:
                ready = poller.poll(1000)
            finally:
                for fd in watched:
                    poller.unregister(fd)
            for fd, _ in ready:
                if fd == self.listener.fileno():
                    self._accept()
                elif fd in self.conns:
                    self._hear(fd)
        with contextlib.suppress(OSError):
            os.unlink(SOCK)

    def _remove_container(self) -> None:
        """Until the engine says it is gone (an engine away, even when the client is made, is
        asked again)."""
        deadline = time.monotonic() + REMOVE_TRIES_S
        while time.monotonic() < deadline:
            try:
                if self._engine is None:
                    self._engine = self._docker.DockerClient(base_url=self.docker_host, timeout=30)
                self._engine.containers.get(self.container).remove(force=True)
                return
            except self._docker.errors.NotFound:
                return
            except Exception:  # the engine away, or busy: ask again
                time.sleep(2.0)


class _Chain:
    """The chain's first process, this supervisor's child: its pid, and its exit status once
    reaped (as Popen's: a negative number, the signal that ended it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class _Supervisor(_Lifeline):
    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__(spec)
        fds: dict[str, int] = spec["fds"]
        # Its first process takes the chain's steps as root, then execs the last step; its pid
        # comes once it is set up (this process has no thread: the fork server's fork).
        self.chain = _Chain(
            enter.start(
                spec["enter"],
                spec["last_step"],
                spec["env"],
                spec["cwd"],
                (fds["script_r"], fds["out_w"], fds["fault_w"]),
                fds["err_w"],
            )
        )
        for name in ("script_r", "out_w", "err_w", "fault_w"):
            os.close(fds[name])
        self.pid = self.chain.pid
        self.start_time = start_time(self.pid)
        self.pidfd: int | None = os.pidfd_open(self.pid)
        self.outs: dict[int, Any] = {}  # output pipe -> its CappedFile, once the task is told
        self.closed: list[Any] = []  # the CappedFiles of pipes read to their end
        self.err_tail = b""
        self.pipes = {"out": fds["out_r"], "err": fds["err_r"]}
        self.fault_fd: int | None = fds["fault_r"]
        self.fault = bytearray()
        self.fault_end = b""
        self.task: dict[str, Any] | None = None
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.exit_line = b""
        self.last_written = 0.0
        self.last_dirty = False
        self._say(f"pid {self.pid} {self.start_time}\n".encode())

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        poller = select.poll()
        while not self.done:
            now = time.monotonic()
            if self._abandoned(now):
                self._end_task()
                break
            watched = self._watched()
            for fd in watched:
                poller.register(fd, select.POLLIN)
            try:
                ready = poller.poll(self._timeout(now) * 1000)
            finally:
                for fd in watched:
                    poller.unregister(fd)
            for fd, _ in ready:
                self._ready(fd)
            if self.exited_at is not None and self.returncode is None:
                self._finish_exit()
            self._write_last()
        if self.chain.returncode is None:  # told it is done before the chain ended (discarded)
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            self.chain.wait()
        with contextlib.suppress(OSError):
            os.unlink(SOCK)

    def _watched(self) -> list[int]:
        fds = [self.listener.fileno(), *self.conns]
        if self.pidfd is not None:
            fds.append(self.pidfd)
        if self.fault_fd is not None:
            fds.append(self.fault_fd)
        fds.extend(self.outs)
        return fds

    def _timeout(self, now: float) -> float:
        waits = [1.0]
        if self.exited_at is not None and self.returncode is None:
            waits.append(DRAIN_S)
        return max(0.01, min(waits))

    def _abandoned(self, now: float) -> bool:
        """No agent for long enough: for a task, ``reattach_seconds``; for a chain no task
        took, at once (no agent can use it)."""
        return self.given_up(now, self.reattach_s if self.task is not None else 0.0)

    def _ready(self, fd: int) -> None:
        if fd == self.listener.fileno():
            self._accept()
        elif fd in self.conns:
            self._hear(fd)
        elif fd == self.pidfd:
            os.close(fd)
            self.pidfd = None
            self.exited_at = time.monotonic()
        elif fd == self.fault_fd:
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                os.close(fd)
                self.fault_fd = None
            else:
                self.fault += chunk[: max(FAULT_BYTES - len(self.fault), 0)]
                self.fault_end = (self.fault_end + chunk)[-FAULT_END:]
        elif fd in self.outs:
            chunk = os.read(fd, READ_CHUNK)
            if chunk:
                self.outs[fd].write(chunk)
                self.last_dirty = True
            else:
                self._close_output(fd)

    # --- agents -----------------------------------------------------------------------------

    def hello(self, conn: socket.socket) -> None:
        self._say(f"pid {self.pid} {self.start_time}\n".encode(), conn)
        if self.returncode is not None:
            self._say(self.exit_line, conn)

    def heard(self, word: str, arg: str) -> None:
        if word == "task" and self.task is None:
            self._take_task(json.loads(arg))
        super().heard(word, arg)

    # --- the task ---------------------------------------------------------------------------

    def _take_task(self, task: dict[str, Any]) -> None:
        self.task = task
        cap = int(task["cap"])
        for name in ("out", "err"):
            fd = self.pipes[name]
            os.set_blocking(fd, False)
            self.outs[fd] = CappedFile(Path(task[f"std{name}"]), cap)

    def _close_output(self, fd: int) -> None:
        capped = self.outs.pop(fd)
        if fd == self.pipes["err"]:
            self.err_tail = capped.tail
        self.closed.append(capped)
        capped.close()
        os.close(fd)

    def _finish_exit(self) -> None:
        """The main process has exited: its output read while it keeps coming (bounded), then
        its status written and told."""
        assert self.exited_at is not None
        quiet = time.monotonic() - self.exited_at >= DRAIN_MAX_S
        if self.outs and not quiet:
            ready = select.poll()
            for fd in self.outs:
                ready.register(fd, select.POLLIN)
            if ready.poll(0):
                return  # the loop reads it, and comes back
        rc = self.chain.wait()
        while self.fault_fd is not None:  # the chain's fault channel: closed by now, or soon
            chunk = b""
            with contextlib.suppress(BlockingIOError):
                os.set_blocking(self.fault_fd, False)
                chunk = os.read(self.fault_fd, READ_CHUNK)
            if not chunk:
                os.close(self.fault_fd)
                self.fault_fd = None
                break
            self.fault += chunk[: max(FAULT_BYTES - len(self.fault), 0)]
            self.fault_end = (self.fault_end + chunk)[-FAULT_END:]
        for fd in list(self.outs):
            self._close_output(fd)
        self.last_dirty = True
        self._write_last(force=True)
        status = {
            "returncode": rc,
            "fault": base64.b64encode(bytes(self.fault)).decode(),
            "fault_end": base64.b64encode(self.fault_end).decode(),
            "stderr_tail": base64.b64encode(self.err_tail).decode(),
        }
        # On the socket, not in a file: a task that filled the disk must not take its end along.
        self.exit_line = f"exit {json.dumps(status)}\n".encode()
        self.returncode = rc
        self._say(self.exit_line)

    def _write_last(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.last_dirty or (not force and now - self.last_written < LAST_EVERY_S):
            return
        files = [*self.outs.values(), *self.closed]
        if not files:
            return
        self.last_dirty, self.last_written = False, now
        with contextlib.suppress(OSError):
            _write_file(Path(LAST), latest_line(*files).encode())

    def _end_task(self) -> None:
        """No agent came back, or one said ``end``: nothing of the task is left, its cgroup
        removed."""
        identity = dict(self.task["identity"]) if self.task else {}
        identity.setdefault("pid", self.pid)
        identity.setdefault("start_time", self.start_time)
        cgroup = None
        paths, version = identity.get("cgroup"), identity.get("cgroup_version")
        if isinstance(paths, dict) and version in (1, 2):
            cgroup = AttemptCgroup(version, {k: Path(v) for k, v in paths.items()})
        if self.chain.returncode is None:  # its group's number is its own until it is reaped
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.kill()
        if self.chain.returncode is None:
            self.chain.wait()  # first: a zombie of its own would look alive to ``reap``
        reap(identity)
        if cgroup is not None:
            cgroup.remove()
        for fd in list(self.outs):
            self._close_output(fd)
        self._remove_home()


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _ignore(signum: int, frame: object) -> None:
    pass


def run(spec: Mapping[str, Any]) -> int:
    """The supervisor's life, in a process the fork server made for it (``forkserver``)."""
    os.chdir(spec["home"])
    # The agent's terminal and its stop are not the supervisor's: it goes when its task does.
    # Caught, not ignored: an ignored signal stays ignored across exec, in the task.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, _ignore)
    if "container" in spec:
        watch = _ContainerWatch(spec)
        try:
            watch.run()
        except BaseException:  # a bug, or no room for its own log: its container goes with it
            watch._remove_container()
            raise
    else:
        supervisor = _Supervisor(spec)
        try:
            supervisor.run()
        except BaseException:  # a bug, or no room for its own log: its task goes with it
            supervisor._end_task()
            raise
    return 0


# --- the agent's side --------------------------------------------------------------------------


class Gone(Exception):
    """No supervisor answers (it ended, or was never there)."""


class Supervised:
    """The agent's end of a supervisor: its chain's pid, the task's end once it came. Built by
    ``start`` (a new chain) or ``connect`` (a task an earlier run of the agent started)."""

    def __init__(
        self,
        sock: socket.socket,
        home: Path,
        child: forkserver.Child | None,
        answered: bool = True,
    ):
        """``child``: the supervisor, where this agent started it; ``answered``: its first line
        is read now (else by ``answer``)."""
        self._sock = sock
        self.home = home
        self._child = child
        self._buf = bytearray()
        self.returncode: int | None = None
        self.ended = False  # the main process exited (``status`` says how), or the supervisor went
        self.lost = False  # the supervisor went without telling the end
        self.status: dict[str, Any] = {}
        self.pid = 0
        self.start_time: int | None = None
        if answered:
            self.answer()

    def answer(self) -> None:
        """Its first line (its chain's pid), within ``ANSWER_S``; Gone when none comes."""
        self._sock.settimeout(ANSWER_S)
        line = self._line()
        self._sock.settimeout(None)
        if line is None:
            raise Gone(f"the task's supervisor in {self.home} did not answer")
        word, pid, started = [*line.split(" "), "", ""][:3]
        if word != "pid" or not pid.isdigit():
            raise Gone(f"the task's supervisor in {self.home} said {line[:60]!r}")
        self.pid = int(pid)
        self.start_time = int(started) if started.isdigit() else None
        self._take_lines()  # what came with it ("exit", from one whose task has ended)

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        steps: Mapping[str, Any] | None,
        cwd: Path,
        env: Mapping[str, str],
        fds: Mapping[str, int],
        home: Path,
        reattach_seconds: float,
    ) -> Supervised:
        """Start a supervisor of ``command`` (the launch chain's last step, after ``steps``:
        ``chain.plan``'s), handing it ``fds`` (the chain's ends of its pipes and the agent's
        ends it reads: kept at their numbers)."""
        # Named anew ("last_step", not the whole chain's "command"): a supervisor of an older
        # version fails on it rather than run the last step without the steps before it.
        spec = {"last_step": list(command), "enter": steps, "cwd": str(cwd), "env": dict(env)}
        return cls._spawn(spec, fds, home, reattach_seconds)

    @classmethod
    def watch(
        cls, container: str, docker_host: str, home: Path, reattach_seconds: float
    ) -> Supervised:
        """Start a watch of a container (its id or name; the engine runs it): it removes the
        container when no agent came back within ``reattach_seconds``. Started before the
        container is created, by its name, it leaves none behind an agent killed in between.
        Not waited for (its engine client takes a few hundred milliseconds to load): the
        caller reads its answer (``answer``) once the container runs; the watch is there
        from now on, whether the agent waits for it or not."""
        spec = {"container": container, "docker_host": docker_host}
        return cls._spawn(spec, {}, home, reattach_seconds, answered=False)

    @classmethod
    def _spawn(
        cls,
        spec: Mapping[str, Any],
        fds: Mapping[str, int],
        home: Path,
        reattach_seconds: float,
        answered: bool = True,
    ) -> Supervised:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        full = {**spec, "home": str(home), "reattach_seconds": reattach_seconds}
        try:
            log = os.open(home / "supervisor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                child = SERVER.spawn(full, {"life": theirs.fileno(), "log": log, **fds})
            finally:
                os.close(log)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            return cls(ours, home, child, answered)
        except Gone as exc:
            ours.close()
            child.kill()
            child.wait(None)
            child.close()
            raise OSError(f"cannot start a task's supervisor: {exc}") from None

    @classmethod
    def connect(cls, home: Path) -> Supervised:
        """The supervisor an earlier run of the agent started in ``home``; Gone when none
        answers there."""
        try:
            dirfd = os.open(home, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Gone(f"no supervisor in {home} ({exc.strerror or exc})") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ANSWER_S)  # a listener whose queue is full blocks a connect
        try:
            sock.connect(f"/proc/self/fd/{dirfd}/{SOCK}")  # a state dir's path may be long
        except OSError as exc:
            sock.close()
            raise Gone(f"no supervisor answers in {home} ({exc.strerror or exc})") from None
        finally:
            os.close(dirfd)
        try:
            return cls(sock, home, None)
        except (Gone, OSError) as exc:
            sock.close()
            raise Gone(str(exc)) from None

    def fileno(self) -> int:
        return self._sock.fileno()

    def _line(self) -> str | None:
        while b"\n" not in self._buf:
            try:
                chunk = self._sock.recv(4096)
            except (TimeoutError, OSError):
                return None
            if not chunk:
                return None
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf[:] = rest
        return line.decode("utf-8", "replace")

    def tell_task(
        self, stdout: Path, stderr: Path, cap: int, identity: Mapping[str, object]
    ) -> None:
        """Where the task's output goes (capped at ``cap`` bytes each), and what to end when no
        agent comes back."""
        task = {"stdout": str(stdout), "stderr": str(stderr), "cap": cap, "identity": identity}
        self._sock.sendall(f"task {json.dumps(task)}\n".encode())

    def hear(self) -> bool:
        """Read what the supervisor said (its socket is readable); whether the task has ended
        (or the supervisor went without saying how: ``lost``)."""
        try:
            chunk = self._sock.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            self.lost = not self.ended
            self.ended = True
            return True
        self._buf += chunk
        self._take_lines()
        return self.ended

    def _take_lines(self) -> None:
        while b"\n" in self._buf:
            line, _, rest = bytes(self._buf).partition(b"\n")
            self._buf[:] = rest
            if line.startswith(b"exit "):
                self._take_status(line[5:])

    def _take_status(self, data: bytes) -> None:
        try:
            status = json.loads(data)
            rc = status["returncode"]
        except (ValueError, KeyError, TypeError):
            self.ended = self.lost = True
            return
        self.status = status if isinstance(status, dict) else {}
        self.returncode = rc if isinstance(rc, int) else None
        self.ended = True

    def started(self) -> None:
        """A container's watch: the container runs, its engine client may load now (else it
        does after ``LOAD_AFTER_S``). OSError when the watch is gone."""
        self._sock.sendall(b"started\n")

    def lease_left(self, seconds: float) -> None:
        """The task's lease lives ``seconds`` from now: with no agent connected then, the
        supervisor ends the task (before ``reattach_seconds`` if that comes first). OSError
        when the supervisor is gone."""
        self._sock.sendall(f"lease {max(seconds, 0.0):.3f}\n".encode())

    def blob(self, key: str) -> bytes:
        """One of the status's byte strings (``fault``, ``fault_end``, ``stderr_tail``)."""
        try:
            return base64.b64decode(str(self.status.get(key, "")))
        except ValueError:
            return b""

    def last_line(self) -> str:
        try:
            return (self.home / LAST).read_text("utf-8", "replace")
        except OSError:
            return ""

    def done(self) -> None:
        """The task's end is read: the supervisor exits (its directory goes with ``remove``)."""
        with contextlib.suppress(OSError):
            self._sock.sendall(b"done\n")
        self._sock.close()
        if self._child is not None:
            if not self._child.wait(5):
                self._child.kill()
                self._child.wait(None)
            self._child.close()

    def detach(self) -> None:
        """Let go of the task without ending it: the supervisor waits ``reattach_seconds`` for
        an agent to come back."""
        self._sock.close()
        if self._child is not None:
            self._child.close()

    def end(self) -> None:
        """Tell the supervisor to end the task now, and itself (an agent that will not rejoin
        it); ``gone`` says when it has."""
        with contextlib.suppress(OSError):
            self._sock.sendall(b"end\n")

    def gone(self) -> bool:
        """Whether the supervisor has closed its end (it exited); reads what is there."""
        try:
            self._sock.setblocking(False)
            while chunk := self._sock.recv(4096):
                self._buf += chunk
        except BlockingIOError:
            return False
        except OSError:
            pass
        self._sock.close()
        if self._child is not None:
            self._child.close()
        return True

    def remove(self) -> None:
        for name in (SOCK, LAST, LAST + ".tmp", "supervisor.log"):
            with contextlib.suppress(OSError):
                (self.home / name).unlink()
        with contextlib.suppress(OSError):
            self.home.rmdir()


def sweep_homes(state_dir: Path, keep: set[str]) -> None:
    """End every supervisor an earlier run left but those of ``keep`` (rejoined), with its
    task, before this agent claims anything (a task no record names must not wait on beside
    this agent's own under the same user), all at once and for at most ``END_WAIT_S``, and
    remove their directories."""
    try:
        homes = [h for h in (state_dir / HOMES).iterdir() if str(h) not in keep]
    except OSError:
        return
    ending: list[Supervised] = []
    for home in homes:
        with contextlib.suppress(Gone):
            sup = Supervised.connect(home)
            sup.end()
            ending.append(sup)
    deadline = time.monotonic() + END_WAIT_S
    while ending and time.monotonic() < deadline:
        ending = [sup for sup in ending if not sup.gone()]
        time.sleep(0.05)
    for sup in ending:
        sup.detach()
    for home in homes:
        remove_tree(home)


def new_home(parent: Path | None) -> Path:
    """A new directory for one supervisor, root's alone: under ``parent`` (the agent's state
    dir's ``tasks/``), or a temporary one."""
    if parent is None:
        return Path(tempfile.mkdtemp(prefix="flashnode-task-"))
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=parent))
