"""What a root agent's sandbox around a task is made of: the ``Sandbox`` (namespaces, private
directories, read-only views, covers) and the mount tables it is given.

``/work``: in the sandbox, the chain binds its working directory (the attempt's workspace, or
an empty directory the workspace is later moved into, for a chain started ahead) at ``/work`` in
the task's mount namespace, so that every ``/work/...`` path works wherever a task names it.

Lent directories (``Sandbox.covers``): after the task's own read-only views are bound, each
lent directory's host path is covered by an empty read-only tmpfs in the task's namespace, so
that a task reaches lent data only at the ``/work/inputs/<label>`` it asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import secrets
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from flashnode import statefile
from flashnode.sandbox.workspace import WORK

# World-writable places a task could leave things in for later tasks of its user: each its own
# empty tmpfs in the task's mount namespace (those that exist), plus the POSIX message queues of
# its own IPC namespace.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# Where the cover over the job environments is put together before it is moved over them: over
# the task's private /tmp, which the move uncovers again (``envs_fstab``).
ENVS_STAGE = "/tmp"
ENVS_TABLE = "envs-"  # how such a table's name starts


@functools.lru_cache(maxsize=1)
def agent_kept() -> tuple[tuple[str, str, str], ...]:
    """(private directory, staging directory, kept directory) for each private directory that
    holds the agent's own install (its venv, its package: a checkout under /tmp), where the
    sandboxes of its own helpers and builds would hide it: the top directory of it under the
    private one is bound back there read-only. The staging directory (made once, the agent's,
    0700) is where the private tmpfs is put together before it is moved into place, in the
    sandbox's own mount namespace; one kept directory per private one (the first found)."""
    found: dict[str, str] = {}
    for path in (sys.prefix, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        real = os.path.realpath(path)
        for d in PRIVATE_DIRS:
            if real.startswith(d + "/") and d not in found:
                top = d + "/" + real[len(d) + 1 :].split("/", 1)[0]
                if "\n" not in top:
                    found[d] = top
    kept = tuple(
        (d, tempfile.mkdtemp(prefix=".flashnode-stage-", dir=d), k) for d, k in found.items()
    )
    for _, stage, _ in kept:  # left empty here (it is filled in the sandboxes' namespaces)
        atexit.register(_remove_empty, stage)
    return kept


def _remove_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


@dataclass(frozen=True)
class Sandbox:
    """What a root agent sets up around a task before dropping to its user. Bind paths may not
    hold a newline (``command`` refuses them)."""

    tmp_bytes: int  # size of each private tmpfs
    # (host path, target relative to the working directory: bound before it is bound at /work)
    read_only_binds: tuple[tuple[str, str], ...] = field(default=())
    hidden_devices: tuple[str, ...] = field(default=())  # device files the task sees as /dev/null
    # The private tmpfs mounts as one table (``private_table``), if written; with ``envs``, the
    # table that also puts their cover together (``envs_fstab``).
    fstab: str = ""
    work: bool = False  # bind the chain's working directory at /work and enter it there
    covers: str = ""  # the lent directories' covers as one table (``cover_fstab``), if any
    no_network: bool = False  # a network namespace of its own: no interface but a down loopback
    # The job environments' directory, covered by an empty tmpfs (no task sees another job's
    # environment), and what under it is bound back read-only at its same path (the task's own
    # environment, the managed interpreters): shebangs and pyvenv.cfg keep working.
    envs: str = ""
    # The agent's own install (its interpreter, its package, uv), where it lies under a private
    # directory (a checkout under /tmp): bound back read-only in the agent's own helpers' and
    # builds' sandboxes, which run it (``agent_kept``).
    keep_agent: bool = False


def private_table(tmp_bytes: int) -> str:
    """The table of a task's private tmpfs mounts (those of ``PRIVATE_DIRS`` that exist here,
    ``tmp_bytes`` each), for ``Sandbox.fstab`` once written (``enter.mount_table`` mounts it).
    Each mount's source name is new: no mount of the host's is named."""
    source = f"flashnode-private-{secrets.token_hex(4)}"
    options = f"nosuid,nodev,mode=1777,size={tmp_bytes}"
    return "".join(f"{source} {d} tmpfs {options} 0 0\n" for d in PRIVATE_DIRS if os.path.isdir(d))


def cover_fstab(directory: Path, lent: Iterable[Path]) -> str:
    """Write the table of the covers of the ``lent`` directories (an empty read-only tmpfs over
    each, by its resolved path) into ``directory``, and return its path for ``Sandbox.covers``:
    named for what it covers, so that a chain started under another table can tell, and written
    anew at every call (a file of that name that is there already is never trusted); "" when
    there is nothing to cover. Deepest first (a cover over a parent would hide the child's
    mount point); none under the private directories or ``/work``, which the task gets its own
    of anyway. Paths are written the way fstab escapes them."""
    targets = set()
    for path in lent:
        real = os.path.realpath(path)
        if not any(real == d or real.startswith(d + "/") for d in (*PRIVATE_DIRS, WORK)):
            targets.add(real)
    if not targets:
        return ""
    ordered = sorted(targets, key=lambda t: (-t.count("/"), t))
    digest = hashlib.sha256("\0".join(ordered).encode("utf-8", "surrogateescape")).hexdigest()
    path = directory / f"covers-{digest[:16]}.fstab"
    source = f"flashnode-cover-{secrets.token_hex(4)}"
    options = "ro,nosuid,nodev,noexec,mode=0555,size=4k"
    table = "".join(f"{source} {_fstab_escape(t)} tmpfs {options} 0 0\n" for t in ordered)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    statefile.write(path, table.encode("utf-8", "surrogateescape"), 0o600)
    return str(path)


def envs_fstab(directory: Path, private: str, envs: str, kept: Iterable[str]) -> str:
    """Write the table of a task's private mounts (``private``: ``private_table``'s lines, which
    mount its private /tmp) that also puts together the cover over the job environments'
    directory ``envs`` into ``directory``, and return its path for ``Sandbox.fstab``: after the
    private mounts, an empty tmpfs over the private /tmp (``ENVS_STAGE``), each of ``kept``
    bound into it read-only at its place under ``envs`` (its mount point made on the way), then
    the tmpfs made read-only; the chain then moves it over ``envs``, which uncovers the private
    /tmp. One table for all of it (``enter.mount_table``). Named for what it holds, so that a
    chain started under another table can tell; written anew at every call (a file of that name
    that is there already is never trusted: ``EnvsTables`` keeps the tables it wrote).
    ValueError for a kept path outside ``envs``, with a newline, or that leaves it on the way
    (``..``, a link), or for private mounts without a /tmp."""
    kept = sorted(kept)
    real = os.path.realpath(envs)
    if any(
        "\n" in k or not k.startswith(envs + "/") or os.path.realpath(k) != real + k[len(envs) :]
        for k in kept
    ):
        raise ValueError("a kept environment's path holds a newline or lies elsewhere")
    if not any(line.split()[1:2] == [ENVS_STAGE] for line in private.splitlines()):
        raise ValueError(f"the private mounts have no {ENVS_STAGE} to put the cover together on")
    digest = hashlib.sha256("\0".join([private, envs, *kept]).encode("utf-8", "surrogateescape"))
    path = directory / f"{ENVS_TABLE}{digest.hexdigest()[:16]}.fstab"
    source = f"flashnode-envs-{secrets.token_hex(4)}"
    lines = [private, f"{source} {ENVS_STAGE} tmpfs nosuid,nodev,mode=0711,size=64k 0 0\n"]
    for k in kept:
        to = _fstab_escape(ENVS_STAGE + k[len(envs) :])
        lines.append(f"{_fstab_escape(k)} {to} none bind,ro,nosuid,nodev,X-mount.mkdir 0 0\n")
    lines.append(f"{source} {ENVS_STAGE} tmpfs remount,ro,nosuid,nodev 0 0\n")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    statefile.write(path, "".join(lines).encode("utf-8", "surrogateescape"), 0o600)
    return str(path)


class EnvsTables:
    """The tables one agent run's sandboxes cover the job environments with (``envs_fstab``),
    in ``directory``, each over the same ``private`` mounts: written by this run the first time
    a set of kept directories needs it, under a lock (the slots' chains are made at once), and
    reused after; a file of that name this run did not write is never used."""

    def __init__(self, directory: Path, private: str) -> None:
        self._directory, self._private = directory, private
        self._lock = threading.Lock()
        self._written: dict[tuple[str, tuple[str, ...]], str] = {}

    def table(self, envs: str, kept: Iterable[str]) -> str:
        key = (envs, tuple(sorted(kept)))
        with self._lock:
            path = self._written.get(key)
            if path is None:
                path = self._written[key] = envs_fstab(self._directory, self._private, envs, key[1])
            return path


def _fstab_escape(path: str) -> str:
    """A path as a field of fstab: whitespace and backslashes as octal escapes."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def mqueue_mounts() -> list[str]:
    """Where the host's POSIX message queues are mounted (this process's mount table, which a
    task's new mount namespace copies), as the table writes them."""
    try:
        with open("/proc/self/mounts") as fh:
            return [f[1] for f in (line.split() for line in fh) if len(f) > 2 and f[2] == "mqueue"]
    except OSError:
        return []
