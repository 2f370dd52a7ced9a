"""A started task (``TaskProcess``): its main process, group, token, cgroup and output, and
how it is suspended and ended.

Whose fault (``TaskProcess.launched``): until the task's own exec, the chain's stderr is its
fault channel, a pipe only the agent reads; every step writes why it failed there, and the last
step writes ``LAUNCHED`` there just before it execs the task, with the task's stderr put in its
place. No descriptor of that channel is left to the task, so nothing the task prints or exits
with can make its failure look like its launch's, and a chain that ended without saying
``LAUNCHED`` never ran any code of the task: the node's fault.

Termination is TERM → grace → KILL over the group, the token holders and the cgroup, repeated
until nothing of the task is left, on an injected clock. Output goes through pipes to one thread
per task that keeps a size-capped head and a short tail on disk and sees the main process exit;
the attempt never waits for a pipe held open by a detached descendant: it ends when the main
process exits.

Suspension (an owner control) freezes the task's cgroup where it has a freezer, else stops its
tree with SIGSTOP (group and token holders, in rounds until none runs; SIGCONT resumes it). A
suspended task is resumed before it is terminated, so that it can act on SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashnode.clock import Clock, SystemClock
from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.logcap import CappedFile
from flashnode.sandbox.procs import (
    KILL_ROUNDS_S,
    OWNER_ENV,
    TaskUser,
    cpu_ticks,
    find_owned,
    process_state,
    signal_if_owned,
)
from flashnode.sandbox.procs.chain import LAUNCHED, env_script
from flashnode.sandbox.procs.launch import Launch
from flashnode.sandbox.procs.mounts import Sandbox

READ_CHUNK = 64 * 1024
STOP_ROUNDS_S = 2.0  # SIGSTOP rounds: until no process of the task is left running
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
FAULT_BYTES = 4096  # what is kept of a fault channel


@dataclass(frozen=True)
class Stream:
    """One of the task's output streams as captured: its size-capped file and its tail."""

    file: CappedFile

    @property
    def tail(self) -> bytes:
        return self.file.tail


GO_TIMEOUT_S = 30.0  # the longest the chain may take to read its script


class TaskProcess:
    """A started task: its main process, its group, its token, its cgroup and its output.

    ``launch``: a chain started ahead for it (else one is started here, in ``cwd``, ``cgroup``
    and ``sandbox``, as ``user``). ``workdir``: where the task starts, as it sees it (default
    ``cwd``). ``hold``: do not send the task its script yet (``go``): the caller first records
    ``identity()``. ``max_file_bytes``: the largest file the task may make
    (``env_script``)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        stdout: Path,
        stderr: Path,
        log_max_bytes: int,
        on_exit: Callable[[], None],
        cgroup: AttemptCgroup | None = None,
        user: TaskUser | None = None,
        sandbox: Sandbox | None = None,
        clock: Clock | None = None,
        launch: Launch | None = None,
        hold: bool = False,
        workdir: Path | None = None,
        max_file_bytes: int | None = None,
    ) -> None:
        # First: a script that cannot be made (what cannot be encoded) fails before any chain.
        script = env_script(env, argv, workdir or cwd, max_file_bytes)
        if launch is None:
            launch = Launch(cwd, cgroup, user, sandbox)
        self.token = env[OWNER_ENV]
        self.uid = launch.user.uid if launch.user else os.geteuid()
        # Without a cgroup, a child that drops the token and leaves the group is found only by
        # its uid: a slot's own user runs nothing but this slot's task, so all of its processes
        # are the task's (one agent per set of task users: README).
        self.whole_uid = launch.user is not None and launch.cgroup is None
        self._uid_filter = self.uid if self.whole_uid else None
        self.cgroup = launch.cgroup
        self._clock = clock or SystemClock()
        self._script: bytes | None = script
        self._popen = launch.popen
        self.pid = launch.pid
        self.start_time = launch.start_time
        self._ticks: dict[tuple[int, int], int] = {}
        self.exited = threading.Event()
        self.suspended = False
        self._on_exit = on_exit
        self._closing = threading.Event()
        self.stdout = Stream(CappedFile(stdout, log_max_bytes))
        self.stderr = Stream(CappedFile(stderr, log_max_bytes))
        self._fault = bytearray()  # what the chain said on its fault channel (FAULT_BYTES)
        self._fault_end = b""  # and its last bytes
        self._script_w, out_r, err_r, fault_r = launch.take()
        self._watcher = threading.Thread(
            target=self._watch, args=(out_r, err_r, fault_r), name=f"task-{self.pid}"
        )
        self._watcher.daemon = True
        self._watcher.start()
        if not hold:
            self.go()

    def go(self) -> None:
        """Send the task its script: from here on, the task's own code runs. A chain that ended
        before it read the whole script (its setup failed) runs nothing; its exit says why."""
        script, self._script = self._script, None
        if script is None:
            return
        fd = self._script_w
        try:
            os.set_blocking(fd, False)
            view, deadline = memoryview(script), self._clock.monotonic() + GO_TIMEOUT_S
            poller = select.poll()  # not select(): the agent may hold descriptors past 1023
            poller.register(fd, select.POLLOUT)
            while view and not self.exited.is_set() and self._clock.monotonic() < deadline:
                if poller.poll(200):
                    view = view[os.write(fd, view) :]
        except BrokenPipeError:
            pass
        finally:
            os.close(fd)

    def pids(self) -> set[int]:
        """The task's live processes now (its cgroup, else its group and token holders); each
        is also sampled for CPU time, for hosts without cgroup accounting."""
        found = self.cgroup.pids() if self.cgroup is not None else set(self.members())
        for pid in found:
            sample = cpu_ticks(pid)
            if sample is not None:
                key, ticks = (pid, sample[0]), sample[1]
                self._ticks[key] = max(ticks, self._ticks.get(key, 0))
        return found

    def cpu_seconds(self) -> float | None:
        """CPU time the task used so far: exact from its cgroup, else what sampling saw."""
        if self.cgroup is not None:
            exact = self.cgroup.cpu_seconds()
            if exact is not None:
                return exact
        if not self._ticks:
            return None
        return sum(self._ticks.values()) / CLOCK_TICKS

    def identity(self) -> dict[str, object]:
        """What a restarted agent needs to find this task's processes again."""
        return {
            "whole_uid": self.whole_uid,
            "pid": self.pid,
            "start_time": self.start_time,
            "token": self.token,
            "uid": self.uid,
            "cgroup": {k: str(v) for k, v in self.cgroup.paths.items()} if self.cgroup else None,
            "cgroup_version": self.cgroup.version if self.cgroup else None,
        }

    def _wait(self) -> None:
        self._popen.wait()
        self.exited.set()
        self._on_exit()

    @property
    def launched(self) -> bool:
        """Whether the chain reached the task's exec (said so on its fault channel); once the
        main process exited and ``close`` was called. False: no code of the task ever ran."""
        return self._fault_end == LAUNCHED

    def setup_failure(self) -> str:
        """Why the chain ended before the task's exec, from its fault channel: its last
        ``flashnode:`` line, with the first line a tool printed before it (what the tool said
        first is its error); "" when it said nothing. Control characters replaced."""
        lines = [
            "".join(c if c.isprintable() else "?" for c in line).strip()
            for line in bytes(self._fault).decode("utf-8", "replace").splitlines()
        ]
        lines = [line for line in lines if line]
        ours = [i for i, line in enumerate(lines) if line.startswith("flashnode: ")]
        if not ours:
            return lines[-1][:200] if lines else ""
        why = lines[ours[-1]][len("flashnode: ") :][:200]
        tools = [line for line in lines[: ours[-1]] if not line.startswith("flashnode: ")]
        return f"{why}: {tools[0][:200]}" if tools else why

    def _keep_fault(self, chunk: bytes) -> None:
        room = FAULT_BYTES - len(self._fault)
        if room > 0:
            self._fault += chunk[:room]
        self._fault_end = (self._fault_end + chunk)[-len(LAUNCHED) :]

    def _watch(self, out_fd: int, err_fd: int, fault_fd: int) -> None:
        """One thread per task: copy both pipes into their files until their writers close
        them, or, once ``close`` was called, until nothing more is there (a detached descendant
        holding a pipe never keeps the attempt waiting), and keep what the chain says on its
        fault channel; and see the main process exit, through a pidfd (where there is none, a
        thread of its own waits for it)."""
        streams: dict[int, CappedFile | None] = {
            out_fd: self.stdout.file,
            err_fd: self.stderr.file,
            fault_fd: None,
        }
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            threading.Thread(target=self._wait, name=f"wait-{self.pid}", daemon=True).start()
        poller = select.poll()
        for fd in [*streams, *([pidfd] if pidfd is not None else [])]:
            poller.register(fd, select.POLLIN)
        try:
            while streams or pidfd is not None:
                ready = [fd for fd, _ in poller.poll(200)]
                if not ready and self._closing.is_set() and pidfd is None:
                    return
                for fd in ready:
                    if fd != pidfd and fd not in streams:
                        continue
                    if fd == pidfd:
                        poller.unregister(pidfd)
                        os.close(pidfd)
                        pidfd = None
                        self._wait()
                        continue
                    chunk = os.read(fd, READ_CHUNK)
                    sink = streams[fd]
                    if chunk and sink is None:
                        self._keep_fault(chunk)
                    elif chunk and sink is not None:
                        sink.write(chunk)
                    else:
                        del streams[fd]
                        poller.unregister(fd)
                        os.close(fd)
        finally:
            for fd in [*streams, *([pidfd] if pidfd is not None else [])]:
                os.close(fd)
            self.stdout.file.close()
            self.stderr.file.close()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode if self.exited.is_set() else None

    def suspend(self) -> None:
        """Stop the task from running: its cgroup's freezer, else SIGSTOP to its group and every
        token holder, repeated until none of them runs (a process forked between two rounds is
        caught by the next). Raises OSError when the freezer cannot be written."""
        self.suspended = True
        if self.cgroup is not None and self.cgroup.can_freeze:
            self.cgroup.freeze()
            return
        deadline = self._clock.monotonic() + STOP_ROUNDS_S
        while self._clock.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGSTOP)
            running = [p for p in self.members() if process_state(p) not in ("T", "t")]
            if not running:
                return
            for pid in running:
                signal_if_owned(pid, self.token, self.pid, signal.SIGSTOP, self._uid_filter)
            self._clock.sleep(0.01)

    def resume(self) -> None:
        """Let a suspended task run again (thaw its cgroup, SIGCONT its tree)."""
        if not self.suspended:
            return
        self.suspended = False
        if self.cgroup is not None:
            self.cgroup.thaw()
        self._signal_all(signal.SIGCONT)

    def terminate(self, grace: float) -> None:
        """SIGTERM to the group and every token holder, up to ``grace`` seconds for them to go,
        then SIGKILL until none is left. Idempotent. A suspended task is resumed first, so that
        it can act on SIGTERM; with no grace it is killed at once, suspended or not."""
        if grace <= 0:
            self.kill()
            return
        self.resume()
        if self._signal_all(signal.SIGTERM):
            deadline = self._clock.monotonic() + grace
            while self._clock.monotonic() < deadline and self._alive():
                self._clock.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL everything the task owns, repeating while something still answers: the
        group and everything in its cgroup; without a cgroup, the group and every token holder.
        A cgroup holds every process of the task (the chain joins it before the task runs, and
        no process of an unprivileged user can leave it), so a scan of /proc for the token
        would find nothing more there, at the cost of a look at every process on the host.
        A suspended task is killed before it is let run again: it runs no more of its code."""
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            self.cgroup.kill()  # thawed once killed
            self.resume()
        else:
            self._signal_all(signal.SIGKILL)  # a stopped process dies of it all the same
            self.resume()
            deadline = self._clock.monotonic() + KILL_ROUNDS_S
            while self._signal_all(signal.SIGKILL) and self._clock.monotonic() < deadline:
                self._clock.sleep(0.02)
        self._clock.wait(self.exited, KILL_ROUNDS_S)

    def close(self) -> None:
        if self._script is not None:  # never sent: the chain, if still there, runs nothing
            self._script = None
            with contextlib.suppress(OSError):
                os.close(self._script_w)
        self._closing.set()
        self._watcher.join(2.0)

    def _alive(self) -> bool:
        return not self.exited.is_set() or any(True for _ in self.members())

    def members(self) -> Iterator[int]:
        """Live (non-zombie) processes of the task: its group, and every token holder (every
        process of its user, when that user is the slot's own)."""
        return find_owned(self.token, self.uid, self.pid, self.whole_uid)

    def _signal_all(self, sig: signal.Signals) -> bool:
        """Signal the group and every token holder; True if anything alive was there."""
        with contextlib.suppress(OSError):
            os.killpg(self.pid, sig)
        hit = False
        for pid in self.members():
            hit = signal_if_owned(pid, self.token, self.pid, sig, self._uid_filter) or hit
        return hit
