"""The error families of the agent and its named exit codes.

Edges translate what they see (HTTP statuses, OS errors, bad payloads) into these exceptions at the
boundary, so the loop in the middle handles a small, documented set of outcomes.
"""

from __future__ import annotations

import enum
import errno
import os


class ExitCode(enum.IntEnum):
    """Process exit codes; documented in the README (Operations)."""

    OK = 0
    FAILURE = 1  # an unexpected error: a bug, reported with a traceback
    USAGE = 2  # click's code for a bad command line
    UNAVAILABLE = 69  # a prerequisite is missing (EX_UNAVAILABLE), e.g. no Docker engine
    LOCKED = 75  # another agent holds the state dir (EX_TEMPFAIL: systemd retries later)
    CREDENTIALS = 77  # the coordinator refused the join code or token (EX_NOPERM)
    CONFIG = 78  # the configuration is invalid (EX_CONFIG); systemd must not restart


class FlashnodeError(Exception):
    """Base of every error the agent raises on purpose."""


class ConfigError(FlashnodeError):
    """The configuration (flags, environment, file) is invalid; the agent cannot start.

    ``setting``: the setting refused, where one is; ``where``: where it was set, as the message
    says it (``in FILE, line N``, ``from FLASHNODE_X``, ``from --x``; None: not set, its default).
    """

    def __init__(self, message: str, setting: str | None = None, where: str | None = None):
        super().__init__(message)
        self.setting, self.where = setting, where


class CredentialsError(FlashnodeError):
    """The coordinator refused this node's join code or token."""


class PrerequisiteError(FlashnodeError):
    """Something the chosen runner needs is missing on this host."""


# --- coordinator outcomes --------------------------------------------------------------------


class CoordinatorError(FlashnodeError):
    """The coordinator answered something the agent cannot act on (a 4xx, a malformed body)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CoordinatorUnavailable(CoordinatorError):
    """Transport error, timeout or 5xx: retry later with backoff."""


class Unregistered(CoordinatorError):
    """The coordinator does not know this node (it restarted): register again."""


class LeaseLost(CoordinatorError):
    """The lease is no longer live (410, or 403 in token mode): stop, discard, report nothing."""


class NotFound(CoordinatorError):
    """The artifact (or checkpoint) asked for does not exist (404)."""


class PayloadTooLarge(CoordinatorError):
    """The coordinator refused an upload as too large (413)."""


class CheckpointRefused(CoordinatorError):
    """409 on a checkpoint commit: the manifest was refused; that checkpoint does not exist."""


# --- attempt outcomes ------------------------------------------------------------------------


class AttemptFailed(FlashnodeError):
    """The attempt cannot succeed by the task's own fault (its exit code, timeout, memory, outputs,
    inputs, payload); the reason is reported to the coordinator with ``fail``, which spends the
    task's failure budget.

    The message is the reason: it must be short, specific and free of secrets.
    """


class OverBudget(AttemptFailed):
    """What a job brings (its inputs, unpacked or not) would take what the agent holds on disk
    for its attempt past ``task_disk_bytes`` or ``task_disk_files``: the job's fault, decided
    before the write; the reason names the size and the cap."""


class AttemptLapsed(FlashnodeError):
    """The attempt ends for a reason that is not the task's fault (the node drains, stops or
    restarted; it cannot reach what the task needs; it should not have been given the lease): the
    agent stops renewing and lets the lease lapse, which spends the coordinator's separate expiry
    budget meant for churn. Nothing is reported; the ledger records the reason.

    ``job_endpoint``: what failed is an endpoint the job itself named (its dataset origin, its
    package index), or the task outgrew the disk room the node had for it (less than
    task_disk_bytes): this may as well be the job's doing as the node's, and the black-hole
    guard counts it only where such endings span more than one job."""

    def __init__(self, *args: object, job_endpoint: bool = False) -> None:
        super().__init__(*args)
        self.job_endpoint = job_endpoint


class NoRoom(AttemptLapsed):
    """The state dir's disk leaves a task (next to) no room above ``min_free_bytes`` when it
    would start: the node is short of disk, the task is not at fault. The disk hold answers it
    (the node claims only while a task would have room), so the black-hole guard does not
    count it: a task of any job holding the disk near the floor must not bench the node."""


class ShortOfRoom(NoRoom):
    """What the agent was about to write for an attempt before its task started (an input, a
    checkpoint to restore) does not fit above ``min_free_bytes`` on the state dir's disk now:
    the node is short of disk, decided before the write (never read off an ENOSPC), and the
    job is not at fault. Not counted by the black-hole guard; the node holds its claims for a
    while (``node/holds.py``), so that it does not take the same task straight back.
    ``needed``: the bytes and inodes the attempt would have held then."""

    def __init__(self, *args: object, needed: tuple[int, int] = (0, 0)) -> None:
        super().__init__(*args)
        self.needed = needed


class OutgrewRoom(AttemptLapsed):
    """A task's files, or its input archive unpacked, outgrew the room the state dir's disk had
    for it above ``min_free_bytes`` (less than the task's own caps): the node was short of disk,
    but the job may as well be at fault (it writes much). Counted like a job's endpoint
    (``job_endpoint``, across jobs), and a row of them has the node's checks run before it is
    quarantined: once the task's files are gone, a healthy disk passes them."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args, job_endpoint=True)


class DiskFull(AttemptLapsed):
    """A write of the agent's failed because the state dir's disk (or the agent's quota) is
    full: the node's fault. The attempt ends at once, its lease left to lapse, and its files are
    removed to give the space back."""


class OutOfDescriptors(AttemptLapsed):
    """The agent ran out of file descriptors (its own limit, or the system's) while it read a
    task's files: the node's fault. What could not be read is never taken to be absent."""


class Stopped(AttemptLapsed):
    """The attempt was ended by the node's owner or its service manager, not by a fault: a drain,
    a stop, ``flashnode pause --now``, an owner control's suspension. Its lease is left to lapse,
    and it says nothing about the node's health."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(exc: BaseException | None) -> OSError | None:
    """The ENOSPC or EDQUOT error ``exc`` is, or was raised while handling; None if none."""
    for _ in range(16):  # a bounded walk down the chain of causes
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def disk_full_error(exc: OSError) -> DiskFull:
    """The attempt's ending for a disk-full error, in the words the log, ledger and status use."""
    return DiskFull(f"disk full ({os.strerror(exc.errno) if exc.errno else exc})")


class DataIntegrityError(AttemptFailed):
    """A dataset entry's bytes are not what the task's manifest declared (checksum, size, ETag):
    the task's fault. The message names the entry."""


class DataUnavailable(AttemptLapsed):
    """A dataset could not be fetched for a reason that is not the task's fault: the origin is
    unreachable or keeps answering 5xx, the disk or the cache is full, the fetch was stopped. The
    attempt lets its lease lapse instead of failing it."""


class EnvBuildFailed(AttemptFailed):
    """The job's environment cannot be built because of the job's own lines: no such version, a
    conflict, no wheel for this Python, a Python version this node cannot provide.

    The message names what failed and carries the tool's last lines (bounded, credentials in
    URLs redacted); ``tail`` holds those lines alone.
    """

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


class EnvUnavailable(AttemptLapsed):
    """The node cannot build environments now: an index it cannot reach, a full disk, no ``uv``.

    Not the task's fault: the attempt lets such a lease lapse instead of failing it.
    """


class Detached(Exception):
    """The agent let go of the running task (it restarts): the attempt goes on under the next
    agent, which rejoins it. Nothing of it is ended, removed or recorded here."""


class Cancelled(FlashnodeError):
    """The agent stopped waiting (drain, stop, a lost lease): what was under way was undone.

    Nobody's fault; the attempt ends the way its stop reason says.
    """
