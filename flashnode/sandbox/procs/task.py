"""A started task (``TaskProcess``): its main process, group, token, cgroup and output, and
how it is suspended and ended.

Whose fault (``TaskProcess.launched``): until the task's own exec, the chain's stderr is its
fault channel, a pipe only the task's supervisor reads; every step writes why it failed there,
and the last step writes ``LAUNCHED`` there just before it execs the task, with the task's stderr
put in its place. No descriptor of that channel is left to the task, so nothing the task prints or
exits with can make its failure look like its launch's, and a chain that ended without saying
``LAUNCHED`` never ran any code of the task: the node's fault.

Termination is TERM → grace → KILL over the group, the token holders and the cgroup, repeated
until nothing of the task is left, on an injected clock. The task's supervisor
(``supervisor.py``), not the agent, is the chain's parent: it copies the output pipes into
size-capped files, sees the main process exit and keeps its status, so that the agent can go
away and come back (``detach``, ``rejoin``). The attempt never waits for a pipe held open by a
detached descendant: it ends when the main process exits.

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
from pathlib import Path

from flashnode.clock import Clock, SystemClock
from flashnode.sandbox.cgroups import AttemptCgroup
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
from flashnode.sandbox.procs.supervisor import Gone, Supervised

STOP_ROUNDS_S = 2.0  # SIGSTOP rounds: until no process of the task is left running
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GO_TIMEOUT_S = 30.0  # the longest the chain may take to read its script


class TaskProcess:
    """A started task: its main process, its group, its token, its cgroup and its supervisor.

    ``launch``: a chain started ahead for it (else one is started here, in ``cwd``, ``cgroup``
    and ``sandbox``, as ``user``, its supervisor in a new directory under ``homes``). ``workdir``:
    where the task starts, as it sees it (default ``cwd``). ``hold``: do not send the task its
    script yet (``go``): the caller first records ``identity()``. ``max_file_bytes``: the largest
    file the task may make (``env_script``). Its output goes to ``stdout`` and ``stderr``, each
    capped at ``log_max_bytes``, written by its supervisor."""

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
        homes: Path | None = None,
        reattach_seconds: float = 0.0,
    ) -> None:
        # First: a script that cannot be made (what cannot be encoded) fails before any chain.
        script = env_script(env, argv, workdir or cwd, max_file_bytes)
        if launch is None:
            launch = Launch(cwd, cgroup, user, sandbox, homes, reattach_seconds)
        uid = launch.user.uid if launch.user else os.geteuid()
        # Without a cgroup, a child that drops the token and leaves the group is found only by
        # its uid: a slot's own user runs nothing but this slot's task, so all of its processes
        # are the task's (one agent per set of task users: README).
        whole_uid = launch.user is not None and launch.cgroup is None
        self._watch_over(
            launch.supervised, env[OWNER_ENV], uid, whole_uid, launch.cgroup, clock, on_exit
        )
        self._script: bytes | None = script
        self._script_w = launch.take()
        with contextlib.suppress(OSError):  # the supervisor went: the watcher sees it
            self._sup.tell_task(stdout, stderr, log_max_bytes, self.identity())
        self._start_watcher()
        if not hold:
            self.go()

    def _watch_over(
        self,
        sup: Supervised,
        token: str,
        uid: int,
        whole_uid: bool,
        cgroup: AttemptCgroup | None,
        clock: Clock | None,
        on_exit: Callable[[], None],
    ) -> None:
        self._sup = sup
        self.token, self.uid, self.whole_uid, self.cgroup = token, uid, whole_uid, cgroup
        self._uid_filter = uid if whole_uid else None
        self._clock = clock or SystemClock()
        self.pid = sup.pid
        self.start_time = sup.start_time
        self._ticks: dict[tuple[int, int], int] = {}
        self.exited = threading.Event()
        self.suspended = False
        self._on_exit = on_exit
        self._closing = threading.Event()
        self._stop_r, self._stop_w = os.pipe()  # wakes the watcher when it is to stop watching
        self._script = None
        self._script_w = -1

    def _start_watcher(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name=f"task-{self.pid}", daemon=True)
        self._watcher.start()

    @classmethod
    def rejoin(
        cls,
        identity: Mapping[str, object],
        on_exit: Callable[[], None],
        clock: Clock | None = None,
    ) -> TaskProcess | None:
        """The task an earlier run of the agent started (its recorded ``identity``), taken over
        from its supervisor; None when its supervisor is gone or holds another process."""
        home, token, uid = identity.get("supervisor"), identity.get("token"), identity.get("uid")
        if not isinstance(home, str) or not isinstance(token, str) or not isinstance(uid, int):
            return None
        try:
            sup = Supervised.connect(Path(home))
        except Gone:
            return None
        if sup.pid != identity.get("pid") or sup.start_time != identity.get("start_time"):
            sup.detach()
            return None
        paths, version = identity.get("cgroup"), identity.get("cgroup_version")
        cgroup = None
        if isinstance(paths, dict) and version in (1, 2):
            cgroup = AttemptCgroup(version, {k: Path(v) for k, v in paths.items()}, clock)
        proc = cls.__new__(cls)
        whole = identity.get("whole_uid") is True
        proc._watch_over(sup, token, uid, whole, cgroup, clock, on_exit)
        # Let run, in case it was suspended when let go of: the owner's controls suspend it
        # again if they still say so.
        proc.suspended = True
        proc.resume()
        proc._start_watcher()
        return proc

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
            self._script_w = -1

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
        """What a restarted agent needs to find this task's processes again, and its
        supervisor."""
        return {
            "whole_uid": self.whole_uid,
            "pid": self.pid,
            "start_time": self.start_time,
            "token": self.token,
            "uid": self.uid,
            "cgroup": {k: str(v) for k, v in self.cgroup.paths.items()} if self.cgroup else None,
            "cgroup_version": self.cgroup.version if self.cgroup else None,
            "supervisor": str(self._sup.home),
        }

    @property
    def launched(self) -> bool:
        """Whether the chain reached the task's exec (said so on its fault channel); once the
        main process exited. False: no code of the task ever ran."""
        return self._sup.blob("fault_end").endswith(LAUNCHED)

    @property
    def lost(self) -> bool:
        """Its supervisor went without saying how the task ended."""
        return self._sup.lost

    def setup_failure(self) -> str:
        """Why the chain ended before the task's exec, from its fault channel: its last
        ``flashnode:`` line, with the first line a tool printed before it (what the tool said
        first is its error); "" when it said nothing. Control characters replaced."""
        lines = [
            "".join(c if c.isprintable() else "?" for c in line).strip()
            for line in self._sup.blob("fault").decode("utf-8", "replace").splitlines()
        ]
        lines = [line for line in lines if line]
        ours = [i for i, line in enumerate(lines) if line.startswith("flashnode: ")]
        if not ours:
            return lines[-1][:200] if lines else ""
        why = lines[ours[-1]][len("flashnode: ") :][:200]
        tools = [line for line in lines[: ours[-1]] if not line.startswith("flashnode: ")]
        return f"{why}: {tools[0][:200]}" if tools else why

    def stderr_tail(self) -> bytes:
        """The last bytes the task printed on stderr, once it has exited."""
        return self._sup.blob("stderr_tail")

    def last_line(self) -> str:
        """The last line the task printed (its supervisor writes it about once a second)."""
        return self._sup.last_line()

    def _watch(self) -> None:
        """One thread per task: what its supervisor says, until the main process exited (or
        the supervisor went), or the agent lets go of the task (``close``, ``detach``)."""
        poller = select.poll()
        poller.register(self._sup.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while not self._sup.ended:
            ready = {fd for fd, _ in poller.poll()}
            if self._closing.is_set():
                return
            if self._sup.fileno() in ready and self._sup.hear():
                break
        self.exited.set()
        self._on_exit()

    def _stop_watching(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        os.write(self._stop_w, b"x")
        self._watcher.join(2.0)
        if not self._watcher.is_alive():  # (else it may still poll them: a pipe left open)
            os.close(self._stop_r)
            os.close(self._stop_w)

    @property
    def returncode(self) -> int | None:
        return self._sup.returncode if self.exited.is_set() else None

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
                self._killpg(signal.SIGSTOP)
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
                self._killpg(signal.SIGKILL)
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
        """The task's end is read: its supervisor ends."""
        if self._script is not None:  # never sent: the chain, if still there, runs nothing
            self._script = None
            with contextlib.suppress(OSError):
                os.close(self._script_w)
        self._stop_watching()
        self._sup.done()
        self._sup.remove()

    def lease_left(self, seconds: float) -> None:
        """Its lease lives ``seconds`` from now: its supervisor ends it then, if no agent is
        connected (``Supervised.lease_left``)."""
        self._sup.lease_left(seconds)

    def detach(self) -> None:
        """Let go of the running task without ending it (the agent restarts): its supervisor
        keeps it for an agent that comes back (``rejoin``)."""
        self._stop_watching()
        self._sup.detach()

    def _alive(self) -> bool:
        return not self.exited.is_set() or any(True for _ in self.members())

    def members(self) -> Iterator[int]:
        """Live (non-zombie) processes of the task: its group, and every token holder (every
        process of its user, when that user is the slot's own)."""
        return find_owned(self.token, self.uid, self.pid, self.whole_uid)

    def _killpg(self, sig: signal.Signals) -> None:
        """Signal the task's group while its main process is there: once its supervisor has
        reaped it, the number may be another's (its members are found by token and uid)."""
        if not self.exited.is_set():
            os.killpg(self.pid, sig)

    def _signal_all(self, sig: signal.Signals) -> bool:
        """Signal the group and every token holder; True if anything alive was there."""
        with contextlib.suppress(OSError):
            self._killpg(sig)
        hit = False
        for pid in self.members():
            hit = signal_if_owned(pid, self.token, self.pid, sig, self._uid_filter) or hit
        return hit
