"""Review of the launch chain's steps as system calls (``procs.enter``), against the programs
they replace (``unshare``, the setup shell, ``mount -a``, ``prlimit``, ``setpriv``).

No way for a task (or a coordinator's answer) to gain or keep a privilege, leave the sandbox or
reach another slot was found: the task's process state (ids, groups, the five capability sets,
no_new_privs, signal dispositions and mask, umask, limits, descriptors, cwd) and its mount table
(flags of every private directory, view, cover and the job environments' cover) are the same as
under the programs. What differed, and is tested here (each fixed), was not a hole but a
regression each:

* ``mount_table`` splits a table as Python splits text (``str.split``/``splitlines``: every
  Unicode space and line break, U+00A0, U+0085, U+2028, U+001C..U+001F), where ``mount -a``
  splits on ASCII blanks only and ``cover_fstab``/``envs_fstab`` escape only those: a lent
  directory (or a state dir) whose path holds such a character, which ``mount -a`` covered, now
  fails the setup of every sandboxed task of the node.
* The agent's helpers (``popen_as``: env builds, the module probe, the schema check) no longer
  get exactly the environment they are given: the interpreter that runs ``enter.py`` coerces
  the C locale (PEP 538, not turned off by ``-I``) and exports ``LC_CTYPE=C.UTF-8``, which the
  exec passes on.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ended_in_sandbox, shared_dir, slot_user

from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.helpers import popen_as
from flashnode.sandbox.procs.mounts import Sandbox, cover_fstab


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory outside the private ones (a task gets its own /tmp)."""
    root = shared_dir("flashnode-review6-")
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.usefixtures("as_root")
def test_a_lent_directory_whose_name_holds_a_no_break_space_is_covered_and_tasks_still_run(
    base: Path, tmp_path: Path
) -> None:
    """The owner lends ``Scans<U+00A0>v2`` (a name pasted from a document). ``cover_fstab``
    writes it raw (it escapes ASCII blanks only) and ``mount -a`` covered it; ``mount_table``
    splits the line at the no-break space and refuses the table ("unknown option 'tmpfs'"):
    no sandboxed task of the node starts any more, each one the node's fault."""
    lent = base / "Scans\u00a0v2"
    lent.mkdir(mode=0o755)
    (lent / "patient-records.csv").write_text("secret\n")
    (lent / "patient-records.csv").chmod(0o644)
    state = base / "state"
    covers = cover_fstab(state, [lent])
    work = base / "work"
    work.mkdir()
    work.chmod(0o777)
    user = slot_user()
    argv = ["sh", "-c", 'ls -A -- "$0" 2>&1; echo listed', str(lent)]
    proc = ended_in_sandbox(argv, Sandbox(1 << 20, work=True, covers=covers), work, tmp_path, user)
    assert proc.launched, f"the setup failed: {proc.setup_failure()}"
    out = (tmp_path / "out").read_text()
    assert "listed" in out and "patient-records" not in out, out


@pytest.mark.usefixtures("as_root")
def test_a_helper_gets_exactly_the_environment_it_is_given(base: Path) -> None:
    """``popen_as``: "with exactly ``env``". Through ``unshare``/``setpriv`` it was; through
    ``python -I -S enter.py`` the interpreter's locale coercion adds ``LC_CTYPE=C.UTF-8``."""
    work = base / "work"
    work.mkdir()
    work.chmod(0o777)
    proc = popen_as(
        ["env"],
        {"PATH": SYSTEM_PATH},
        slot_user(),
        Sandbox(1 << 20, keep_agent=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=work,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    names = {line.partition("=")[0] for line in out.decode().splitlines()}
    assert names - {"PWD", "OLDPWD"} == {"PATH"}, names
