"""Whether a task's user can read a lent directory once it is mounted (``flashnode doctor``):
checked by a child process running as that user.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
