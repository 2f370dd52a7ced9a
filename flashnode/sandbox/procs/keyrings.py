"""Kernel keyrings, which no namespace holds: the agent's own session keyring, closed to the
tasks it starts, and a slot's user's keyrings, cleared between its tasks.
"""

from __future__ import annotations

import ctypes
import os
import threading

from flashnode.sandbox.procs import TaskUser

KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219}  # the keyctl syscall's number
SETRESUID = {"x86_64": 117, "aarch64": 147, "arm64": 147}  # the setresuid syscall's number
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_SETPERM, KEYCTL_CLEAR = 1, 5, 7
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
# Possessors (every task inherits the agent's session keyring) may view and search it, and
# nothing else: no task can leave a key in it for another.
SESSION_PERM = 0x01000000 | 0x08000000 | 0x00010000
# What the kernel gives a user's own keyrings (possessor all but setattr, user all): a task may
# have opened them to every user, and a clear does not touch permissions.
USER_KEYRING_PERM = 0x1F3F0000


def private_session_keyring() -> str | None:
    """Give this process (call it before any thread starts: threads inherit it) a new session
    keyring that the tasks it starts may not write to. None if done; else why not."""
    number = KEYCTL.get(os.uname().machine)
    if number is None:
        return f"no keyctl syscall number for {os.uname().machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, b"flashnode") < 0:
        errno = ctypes.get_errno()
        if errno in (1, 38):  # EPERM, ENOSYS: keyrings denied (the unit's filter), tasks' too
            return None
        return os.strerror(errno)
    if libc.syscall(number, KEYCTL_SETPERM, KEY_SPEC_SESSION_KEYRING, SESSION_PERM) < 0:
        return os.strerror(ctypes.get_errno())
    return None


def clear_user_keyrings(user: TaskUser) -> str | None:
    """Clear ``user``'s own keyrings (user and user-session: a slot's user is reused by every
    task of its slot, whoever sent it). None when done (or when keyrings are denied to every
    process here, the unit's filter); else why not.

    Without a process (a Python helper cost tens of milliseconds of CPU per task): the kernel
    finds a user's keyrings by the caller's real uid, and credentials belong to each thread, so
    a short-lived thread of the agent takes the user's real and effective uid with the raw
    ``setresuid`` (``os.setresuid`` would change every thread), clears, and ends; its
    credentials end with it. It keeps saved uid 0, so no process of the user may trace it (the
    kernel lets a process trace only a target whose real, effective and saved uids are all its
    own); call it once the user's processes are gone.

    The permissions go back to the kernel's first (a task may have opened its keyrings to every
    user: another slot's task could then leave keys there, or link them into its own keyrings
    and read what the slot's next task keeps there), then the keys go."""
    machine = os.uname().machine
    keyctl, setresuid = KEYCTL.get(machine), SETRESUID.get(machine)
    if keyctl is None or setresuid is None:
        return f"no keyctl or setresuid syscall number for {machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    why: list[str] = []

    def clear() -> None:
        if syscall(setresuid, user.uid, user.uid, 0) < 0:
            why.append(f"setresuid: {os.strerror(ctypes.get_errno())}")
            return
        for keyring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
            for op, args in ((KEYCTL_SETPERM, (USER_KEYRING_PERM,)), (KEYCTL_CLEAR, ())):
                if syscall(keyctl, op, keyring, *args) < 0:
                    errno = ctypes.get_errno()
                    if errno not in (1, 38):  # EPERM, ENOSYS: keyrings denied here to everyone
                        why.append(f"keyctl: {os.strerror(errno)}")

    thread = threading.Thread(target=clear, name=f"keyrings-{user.name}", daemon=True)
    thread.start()
    thread.join()
    return why[0] if why else None
