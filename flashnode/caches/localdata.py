"""Local datasets the machine's owner lends by label (the ``[local_data]`` table).

The owner maps labels to directories (``scans = "/srv/scans"``); the node advertises the labels,
never the paths (``local_datasets``). A task that asks for labels in ``local_inputs`` gets exactly
those, read-only, at ``/work/inputs/<label>``: the runners mount what ``mounts()`` returns (docker:
read-only bind mounts; trusted: read-only bind mounts in the task's own mount namespace, where the
host paths of every lent directory are then covered: ``procs.mounts.cover_fstab``). Both mount as
root: a task's user needs to read the files, never to reach them by their host path (checked by
``sandbox/lentcheck.py``).
The owner's files are never copied, modified or uploaded.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from flashnode.errors import AttemptFailed


@dataclass(frozen=True)
class LentMount:
    """One read-only mount of a lent directory into a task."""

    label: str
    source: Path  # the owner's directory on the host
    target: PurePosixPath  # where the task sees it: <work>/inputs/<label>


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
