"""Entering a task's sandbox: what the launch chain does between its parent and the task's user,
as system calls in the chain's own first process (``enter``), where six programs ran before
every task (``unshare``, a setup shell, ``mount`` twice, ``prlimit``, ``setpriv``).

In order, as root: the cgroup joined, the new namespaces (mount, IPC, and the network where the
sandbox has none; every mount private), the private directories (``fstab``: one table; else a
tmpfs over each of ``private`` that exists) with the agent's own install kept in them
(``agent``), this namespace's message queues over the host's, the read-only views bound into
the working directory (relative paths: the directory the chain is in, whatever covers its path
by now), the working directory bound at ``/work`` and entered there, the lent directories
covered (``covers``), the job environments covered (``envs``: the cover the table put together
on ``/tmp``, moved), the device files hidden; then the limits (``rlimits``), and the user taken
for good: no supplementary groups, no capabilities (inheritable, ambient, bounding where it may
be dropped), no_new_privs. Each failure is a ``SetupFailed``; the chain then writes
``flashnode: <why>`` on its fault channel and exits ``SETUP_FAILED`` (``child``).

Two ways in: ``start``, the supervisor's fork of the chain (the hot path: no program and no
interpreter started), and ``main``, run as a program by path for the agent's own helpers
(``python -I -S .../enter.py PLAN ARGV...``: the agent has threads, so it runs no Python code
between a fork and an exec). This module imports nothing of the package.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import resource
import signal
import stat
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

SETUP_FAILED = 125  # the exit status of a chain whose setup failed (with a "flashnode:" line)

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x2000, 0x4000, 0x40000
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
CAP_VERSION_3 = 0x20080522
# A table's options that are flags; any other than these fails the setup.
FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "bind": MS_BIND,
    "remount": MS_REMOUNT,
}
DATA = ("mode", "size")  # and those that are the file system's data (``name=value``)
MKDIR = "X-mount.mkdir"  # a table's option: make the mount point (and its parents), 0755
RLIMITS = {"fsize": resource.RLIMIT_FSIZE, "core": resource.RLIMIT_CORE}
RLIMITS["nproc"] = resource.RLIMIT_NPROC

_libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork (a supervisor's is a fork)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong]
_libc.mount.argtypes += [ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.prctl.argtypes += [ctypes.c_ulong]


class SetupFailed(Exception):
    """A step of the setup failed: the chain runs nothing (its message says which step)."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise SetupFailed(f"{what}: {os.strerror(code)}")


def _mount(
    src: str | None, dst: str, fstype: str | None, flags: int, data: str | None, why: str = ""
) -> None:
    def b(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    _check(_libc.mount(b(src), b(dst), b(fstype), flags, b(data)), why or f"cannot mount {dst}")


def _unescape(field: str) -> str:
    """A table's field as fstab escapes it (octal: ``\\040`` for a space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_table(path: str) -> None:
    """Mount each line of the table at ``path`` in order, as ``mount -a -T`` does with the
    options the agent's tables use (``mounts.py``): lines split at newlines and fields at ASCII
    blanks only (what the tables escape), the whole table read and checked before its first
    mount; any other option fails the setup."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as fh:
            lines = fh.read().split("\n")
    except OSError as exc:
        raise SetupFailed(f"cannot read the mount table {path}: {exc.strerror}") from None
    entries = []
    for line in lines:
        fields = [f for f in re.split("[ \t]+", line) if f]
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) < 4:
            raise SetupFailed(f"a line of the mount table {path} has no options")
        src, dst, fstype = (_unescape(f) for f in fields[:3])
        flags, data, mkdir = 0, [], False
        for option in fields[3].split(","):
            if option in FLAGS:
                flags |= FLAGS[option]
            elif option == MKDIR:
                mkdir = True
            elif option.partition("=")[0] in DATA:
                data.append(option)
            else:
                raise SetupFailed(f"the mount table {path} has an unknown option {option!r}")
        entries.append((src, dst, fstype, flags, ",".join(data) or None, mkdir))
    for src, dst, fstype, flags, options, mkdir in entries:
        if mkdir:
            _makedirs(dst)
        if flags & MS_BIND and not flags & MS_REMOUNT:
            _mount(src, dst, None, MS_BIND, None)
            if flags & ~MS_BIND:
                _mount(None, dst, None, MS_REMOUNT | flags, None)
        else:
            _mount(src, dst, fstype, flags, options)


def _makedirs(path: str) -> None:
    old = os.umask(0o022)  # mount points the task's user passes through
    try:
        os.makedirs(path, 0o755, exist_ok=True)
    except OSError as exc:
        raise SetupFailed(f"cannot make the mount point {path}: {exc.strerror}") from None
    finally:
        os.umask(old)


def _bind_read_only(src: str, dst: str, why: str) -> None:
    _mount(src, dst, None, MS_BIND, None, why)
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None, why)


def _join_cgroup(procs_files: Sequence[str]) -> None:
    pid = str(os.getpid()).encode()
    for path in procs_files:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        except OSError as exc:
            raise SetupFailed(f"cannot join cgroup {path}: {exc.strerror}") from None


def _namespaces(no_network: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if no_network else 0)
    _check(_libc.unshare(flags), "cannot make the task's namespaces")
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)


def _private(plan: Mapping[str, Any]) -> None:
    kept = {d for d, _, _ in plan["agent"]}
    if plan["fstab"]:
        mount_table(plan["fstab"])
    else:
        for d in plan["private"]:
            if d not in kept and os.path.isdir(d):
                _mount("flashnode-private", d, "tmpfs", MS_NOSUID | MS_NODEV, plan["tmpfs"])
    # The private directory put together on a staging directory, with the agent's install
    # bound back read-only, then moved over it.
    for d, stage, keep in plan["agent"]:
        to, why = stage + keep[len(d) :], f"cannot mount {d} keeping {keep}"
        _mount("flashnode-private", stage, "tmpfs", MS_NOSUID | MS_NODEV, plan["tmpfs"], why)
        try:
            os.mkdir(to)
        except OSError as exc:
            raise SetupFailed(f"{why}: {exc.strerror}") from None
        _bind_read_only(keep, to, why)
        _mount(stage, d, None, MS_MOVE, None, why)


def _hidden_devices(devices: Sequence[str]) -> None:
    for dev in devices:
        _mount("/dev/null", dev, None, MS_BIND, None, f"cannot hide {dev}")


def _sandbox(plan: Mapping[str, Any]) -> None:
    _namespaces(plan["no_network"])
    _private(plan)
    for q in plan["mqueues"]:  # every mount of the host's message queues: this namespace's
        _mount("flashnode-mqueue", q, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for src, dst in plan["binds"]:
        _bind_read_only(src, dst, f"cannot mount /work/{dst} read-only")
    if plan["work"]:
        _mount(".", "/work", None, MS_BIND | MS_REC, None, "cannot bind the workspace at /work")
        os.chdir("/work")
    if plan["covers"]:
        mount_table(plan["covers"])
    stage = plan["envs_stage"]
    if plan["envs"]:
        # What lies on the stage is the cover (its 0711, where the private /tmp is sticky);
        # once moved, the task's own /tmp is back.
        why = "cannot cover the job environments"
        if os.stat(stage).st_mode & stat.S_ISVTX:
            raise SetupFailed(why)  # (not moved: the task would see the host's /tmp)
        _mount(stage, plan["envs"], None, MS_MOVE, None, why)
    if plan["fstab"]:
        tmp = os.stat("/tmp")
        if not tmp.st_mode & stat.S_ISVTX or not os.access("/tmp", os.W_OK):
            raise SetupFailed("the private /tmp is not in place")
    _hidden_devices(plan["hidden"])


def _caps_inheritable_cleared() -> None:
    """No inheritable or ambient capability left (the task's exec gains none back)."""
    header = _CapHeader(CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "cannot read the capabilities")
    for part in data:
        part.inheritable = 0
    _check(_libc.capset(ctypes.byref(header), data), "cannot clear the capabilities")
    cleared = _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) == 0
    if not cleared and ctypes.get_errno() != errno.EINVAL:  # EINVAL: no ambient ones here
        _check(-1, "cannot clear the ambient capabilities")


def _drop_bounding_set() -> None:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read())
    except (OSError, ValueError):
        raise SetupFailed("cannot read the last capability's number") from None
    for cap in range(last + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "cannot drop the bounding set")


def _become(user: Mapping[str, Any]) -> None:
    uid, gid = int(user["uid"]), int(user["gid"])
    if user["bounding"]:
        _drop_bounding_set()
    _caps_inheritable_cleared()
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise SetupFailed(f"cannot become the task's user {uid}: {exc.strerror}") from None
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise SetupFailed(f"cannot become the task's user {uid}")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "cannot set no_new_privs")
    header = _CapHeader(CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "cannot read the capabilities")
    if uid != 0 and any(p.effective or p.permitted or p.inheritable for p in data):
        raise SetupFailed("the task's user kept capabilities")


def enter(plan: Mapping[str, Any]) -> None:
    """Take the steps of ``plan`` (``chain.plan``) in this process; SetupFailed says which one
    failed (this process is then half set up: it must exit, never run anything)."""
    _join_cgroup(plan["cgroup"])
    if plan["sandbox"]:
        _sandbox(plan)
    for name, value in plan["rlimits"].items():
        try:
            resource.setrlimit(RLIMITS[name], (int(value), int(value)))
        except (OSError, ValueError, KeyError):
            raise SetupFailed(f"cannot set the limit {name}={value}") from None
    if plan["user"] is not None:
        _become(plan["user"])


def start(
    plan: Mapping[str, Any] | None,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    stdio: tuple[int, int, int],
    keep: int,
) -> int:
    """Fork the chain's first process and return its pid once its setup is done (or failed): in
    a session of its own, umask 077, ``stdio`` as its standard streams (its stderr: the fault
    channel), ``keep`` open at its number, no other descriptor, the signals a program starts
    with; in ``cwd``, it takes ``plan``'s steps (None: none), then execs ``argv`` with exactly
    ``env``. What fails on the way ends it with ``SETUP_FAILED`` and a ``flashnode:`` line, as
    a failed step does (the caller learns it from its exit). So a pid, once known, is a chain
    set up and waiting (its group, its private directories in place), as Popen's was after its
    exec; a setup that hangs holds this call. Only for a process without threads: the fork runs
    Python code before its exec."""
    ready_r, ready_w = os.pipe()  # closed by its exec (close-on-exec) or its exit: "" here
    try:
        pid = os.fork()
    except BaseException:
        os.close(ready_r)
        os.close(ready_w)
        raise
    if pid:
        os.close(ready_w)
        try:
            os.read(ready_r, 1)
        finally:
            os.close(ready_r)
        return pid
    try:
        _default_signals()
        os.setsid()
        os.umask(0o077)
        for fd, number in zip(stdio, (0, 1, 2), strict=True):
            os.dup2(fd, number)
        os.set_inheritable(keep, True)
        top = max(resource.getrlimit(resource.RLIMIT_NOFILE))  # close_range: one system call
        for low, high in ((3, min(keep, ready_w)), (min(keep, ready_w) + 1, max(keep, ready_w))):
            os.closerange(low, high)
        os.closerange(max(keep, ready_w) + 1, top)
        os.chdir(cwd)
    except BaseException as exc:
        _fail(f"cannot start the task's launch: {exc!r}")
    if plan is not None:
        child(plan)
    try:
        os.execve(argv[0], list(argv), env)
    except BaseException as exc:
        _fail(f"cannot run {argv[0]}: {exc!r}")
    os._exit(SETUP_FAILED)


def _default_signals() -> None:
    """The signals a program starts with: not the interpreter's ignored SIGPIPE and SIGXFSZ (an
    ignored signal stays ignored across exec), not a supervisor's caught SIGINT, SIGHUP and
    SIGTERM (a stop sent during the setup ends it, as it ended the programs)."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _fail(why: str) -> NoReturn:
    try:
        os.write(2, f"flashnode: {why}\n".encode("utf-8", "replace"))
    finally:
        os._exit(SETUP_FAILED)


def child(plan: Mapping[str, Any]) -> None:
    """``enter``, in a forked chain before its exec (stderr: its fault channel); a failure, or
    any error, ends the process with ``SETUP_FAILED`` and a ``flashnode:`` line."""
    try:
        _default_signals()
        enter(plan)
    except BaseException as exc:  # nothing may run half set up, nor return into the parent's code
        _fail(str(exc) if isinstance(exc, SetupFailed) else f"cannot set up the task: {exc!r}")


def main(argv: Sequence[str]) -> None:
    """``enter`` the plan in ``argv[0]`` (JSON), then exec the rest of ``argv`` with the plan's
    ``env``: exactly that (the interpreter may have added to its own: PEP 538's locale)."""
    plan = json.loads(argv[0])
    child(plan)
    try:
        os.execve(argv[1], list(argv[1:]), plan["env"])
    except OSError as exc:
        _fail(f"cannot run {argv[1]}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
