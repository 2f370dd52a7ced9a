"""The supervisors' fork server: one process per agent that has loaded the supervisor's code once
and forks a supervisor (``supervisor.py``, the server's ``target``: a module whose ``run(spec)``
a forked child calls) for each launch chain and container watch.

Each task has a supervisor of its own, so that it runs on while the agent restarts. A new
interpreter for each would start and import for 50 ms of CPU and more, taken from the tasks' own
cycle on a small machine; a fork of one that has is about a millisecond. The agent starts the
server at its first supervisor (``spawn``) and again if it went; the server exits when its agent
does (its socket closes). A supervisor forked from it is what one started alone was: in a session
of its own, its standard input and output ``/dev/null``, its errors into its directory's
``supervisor.log``, with the agent's umask; the server reaps it when it exits, and an agent that
went leaves it to the system's reaper.

One request, one ``SOCK_SEQPACKET`` message: the supervisor's spec (JSON) with its descriptors
attached in the order of its ``fds`` (name -> the agent's number, which the supervisor gets it
at: a launch chain's command line names its stderr's pipe by number). The answer: ``pid <pid>``
with a pidfd of the supervisor attached (opened before the server can reap it: it names that
process and no other), or ``error <text>``. A server that has not answered within ``ANSWER_S``
(stopped, stuck) is killed, that start fails, and the next one starts a new server.

Run as ``python -I -m flashnode.sandbox.procs.forkserver FD TARGET`` (``FD``: its end of the
agent's socket pair).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import Any

MAX_MESSAGE = 1 << 20  # a spec is a few kilobytes: the chain's command line and its paths
MAX_FDS = 16
ANSWER_S = 10.0  # a server that has not answered a request by then is ended and started again


class Child:
    """A supervisor the server forked: its pid, and a pidfd to wait for it and end it by."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid, self.pidfd = pid, pidfd

    def wait(self, timeout: float | None) -> bool:
        """Whether it exited within ``timeout`` seconds (None: until it does)."""
        if self.pidfd < 0:
            return True
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else int(timeout * 1000)))

    def kill(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class ForkServer:
    """The agent's end of its fork server of ``target``, started at first use and again once it
    went. One request at a time (the agent's threads take turns)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._owner = 0  # the process whose server this is (a fork of the agent needs its own)

    def spawn(self, spec: Mapping[str, Any], fds: Mapping[str, int]) -> Child:
        """A supervisor of ``spec`` (its target's ``run``'s), given ``fds`` (its ``spec["fds"]``:
        at the same numbers in it, ``log`` its stderr). OSError when none could be forked."""
        message = json.dumps({**spec, "fds": dict(fds), "umask": _umask()}).encode()
        if len(message) > MAX_MESSAGE or len(fds) > MAX_FDS:
            raise OSError("a supervisor's spec is too large")
        with self._lock:
            sock = self._server()
            try:
                socket.send_fds(sock, [message], list(fds.values()))
            except OSError:  # it went since its last answer: nothing was forked, ask a new one
                self._stop(kill=True)
                sock = self._server()
                socket.send_fds(sock, [message], list(fds.values()))
            sock.settimeout(ANSWER_S)
            try:
                data, got, _flags, _addr = socket.recv_fds(sock, 4096, 1)
            except TimeoutError:  # stopped or stuck: every start would wait behind it
                self._stop(kill=True)
                raise OSError(
                    f"cannot start a task's supervisor: its fork server did not answer in"
                    f" {ANSWER_S:g} s (it is started again)"
                ) from None
            except OSError:
                data, got = b"", []
            for fd in got:  # received inheritable (recv_fds cannot ask otherwise): made not
                os.set_inheritable(fd, False)
            if not data:
                self._stop()
            if data.startswith(b"pid ") and data[4:].isdigit() and len(got) == 1:
                return Child(int(data[4:]), got[0])
            for fd in got:
                os.close(fd)
            text = data.removeprefix(b"error ").decode("utf-8", "replace")
            raise OSError(f"cannot start a task's supervisor: {text or 'its fork server went'}")

    def _server(self) -> socket.socket:
        if self._sock is not None and self._owner == os.getpid():
            return self._sock
        self._sock = None  # a fork's copy is the parent's, not its own
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-I", "-m", __name__, str(theirs.fileno()), self.target],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                close_fds=True,
                cwd="/",
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if not self._owner:
            atexit.register(self._stop)  # the server goes with this process, not after it
        self._sock, self._owner = ours, os.getpid()
        return ours

    def _stop(self, kill: bool = False) -> None:
        """Close the server's socket, so that it exits, and wait for it; ``kill``: it does not
        answer (SIGKILL, which also ends it stopped; the supervisors it forked are not its)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._popen is not None:
            if kill:
                with contextlib.suppress(ProcessLookupError):
                    self._popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(5)  # it exits when its socket closes
            self._popen = None


def _umask() -> int:
    """This process's umask, read without setting it (another thread may be making a file)."""
    try:
        with open("/proc/self/status") as fh:
            line = next(line for line in fh if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        return 0o022


# --- the server's process ----------------------------------------------------------------------


def serve(fd: int, target: str) -> int:
    """Fork a supervisor for each request on ``fd`` until the agent closes its end."""
    run = importlib.import_module(target).run  # loaded once, before any fork

    sock = socket.socket(fileno=fd)
    children: dict[int, int] = {}  # pidfd -> pid: reaped once it says the supervisor exited
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        for ready, _ in poller.poll():
            if ready != sock.fileno():
                poller.unregister(ready)
                os.close(ready)
                os.waitpid(children.pop(ready), 0)
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            except OSError:
                return 0
            if not data:
                return 0
            try:
                pid = os.fork()
                if pid == 0:
                    _child(sock, data, fds, list(children), run)
                pidfd = os.pidfd_open(pid)
            except OSError as exc:
                socket.send_fds(sock, [f"error {exc.strerror or exc}".encode()], [])
                continue
            finally:
                for given in fds:
                    os.close(given)
            children[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            with contextlib.suppress(OSError):
                socket.send_fds(sock, [f"pid {pid}".encode()], [pidfd])


def _child(sock: socket.socket, data: bytes, fds: list[int], siblings: list[int], run: Any) -> None:
    """The forked supervisor (``siblings``: the server's pidfds of the others, not its to
    hold): never returns into the server's loop."""
    code = 1
    try:
        sock.close()
        for fd in siblings:
            os.close(fd)
        os.setsid()
        spec = json.loads(data)
        os.umask(int(spec.pop("umask")))
        numbers: dict[str, int] = spec["fds"]
        if min(numbers.values()) < 3:
            raise ValueError("a supervisor's descriptor would take a standard stream's place")
        # Each at the agent's number: out of the way first, so that none lands on another.
        top = max([*numbers.values(), *fds]) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in fds]
        for fd in fds:
            os.close(fd)
        for fd, number in zip(high, numbers.values(), strict=True):
            os.dup2(fd, number)
            os.close(fd)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        log = numbers.pop("log")
        os.dup2(log, 2)
        os.close(log)
        code = run(spec)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2]))
