"""Local datasets the machine's owner lends by label (the ``[local_data]`` table).

The owner maps labels to directories (``scans = "/srv/scans"``); the node advertises the labels,
never the paths (``local_datasets``). A task that asks for labels in ``local_inputs`` gets exactly
those, read-only, at ``/work/inputs/<label>``: the runners mount what ``mounts()`` returns (docker:
read-only bind mounts; trusted: read-only bind mounts in the task's own mount namespace, where the
host paths of every lent directory are then covered: ``procs.cover_fstab``). Both mount as root:
a task's user needs to read the files, never to reach them by their host path (``unreadable``).
The owner's files are never copied, modified or uploaded.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from flashnode.errors import AttemptFailed

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class LentMount:
    """One read-only mount of a lent directory into a task."""

    label: str
    source: Path  # the owner's directory on the host
    target: PurePosixPath  # where the task sees it: <work>/inputs/<label>


def lent_problem(label: str, path: Path) -> str | None:
    """Why ``label = path`` cannot be lent (a bad label, a relative or missing directory);
    None if it can. For the settings."""
    if not LABEL.match(label):
        return f"label {label[:64]!r} is not 1-64 of letters, digits, '.', '_', '-'"
    if not path.is_absolute():
        return f"{label}: {path} is not an absolute path"
    if "\n" in str(path):
        return f"{label}: {str(path)!r} holds a newline"
    if not path.is_dir():
        return f"{label}: {path} is not an existing directory"
    return None


def requested_labels(local_inputs: Any, lent: Mapping[str, Path]) -> tuple[str, ...]:
    """The labels a task's ``local_inputs`` asks for, each once, in order; AttemptFailed for a
    value that is not a list of strings or a label this node does not lend (named)."""
    if local_inputs is None:
        return ()
    if not isinstance(local_inputs, list):
        raise AttemptFailed("payload local_inputs is not a list of labels")
    labels: list[str] = []
    for label in local_inputs:
        if not isinstance(label, str):
            raise AttemptFailed("payload local_inputs is not a list of labels")
        if label not in lent:
            raise AttemptFailed(f"local input {label[:64]!r} is not a dataset this node lends")
        if label not in labels:
            labels.append(label)
    return tuple(labels)


def mounts(
    local_inputs: Any,
    lent: Mapping[str, Path],
    work: PurePosixPath | str,
    staged: Collection[str] = (),
) -> tuple[LentMount, ...]:
    """The read-only mounts a task gets: exactly the labels it asked for, at
    ``<work>/inputs/<label>``. ``work`` is where the task sees its workspace (``/work``).
    ``staged`` are the names already taken under ``inputs/`` (the staged inputs' destinations): a
    label that collides with one fails the attempt. Pure: checks nothing on disk."""
    taken = set(staged)
    found: list[LentMount] = []
    for label in requested_labels(local_inputs, lent):
        if label in taken:
            raise AttemptFailed(f"local input {label!r} collides with a staged input of that name")
        found.append(LentMount(label, lent[label], PurePosixPath(work) / "inputs" / label))
    return tuple(found)


# Run as the task's user, in the directory (entered before the switch to that user: the runners
# mount it as root, so the directories above it need not let the user through): the directory
# must be listable and enterable (ACLs count), and each entry at its top readable; the first that
# is not is named.
CHECK = r"""
test -r . && test -x . || { echo "cannot list or enter it" >&2; exit 1; }
bad=$(find . -mindepth 1 -maxdepth 1 ! -readable -print -quit) || exit 1
[ -z "$bad" ] || { echo "cannot read ${bad##*/} in it" >&2; exit 1; }
"""


def unreadable(path: Path, uid: int, gid: int) -> str | None:
    """Why the user ``uid:gid`` (with no supplementary groups, as tasks run) cannot read the
    directory ``path`` and the entries at its top, once it is mounted for a task; None if it can.
    Checked by a child process running as that user in ``path``, which needs root unless
    ``uid:gid`` is this process's own."""
    if not path.is_dir():
        return "it is not an existing directory"
    as_other = (uid, gid) != (os.geteuid(), os.getegid())
    if as_other and os.geteuid() != 0:
        return f"cannot check for uid {uid} without root"
    user, group = (uid, gid) if as_other else (None, None)
    groups: list[int] | None = [] if as_other else None
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", CHECK],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            stdin=subprocess.DEVNULL,
            cwd=path,  # entered as this process, before the switch to the user
            user=user,
            group=group,
            extra_groups=groups,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the check could not run ({type(exc).__name__})"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1][:200] if lines else f"the check exited with {done.returncode}"
