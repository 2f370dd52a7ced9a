"""The agent's own helpers (the module probe, the schema check, job environment builds) run in
sandboxes whose /tmp, /var/tmp and /dev/shm are private: the agent's own install must stay
within their reach wherever it lies, a checkout under /tmp included."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashnode.sandbox import procs
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.helpers import popen_as, python_imports
from flashnode.sandbox.procs.mounts import Sandbox, agent_kept


@pytest.fixture
def venv_under_tmp() -> Iterator[Path]:
    """A venv of the system interpreter under /tmp, readable by every user, as a clean clone
    there makes one."""
    top = Path(tempfile.mkdtemp(prefix="flashnode-clone-", dir="/tmp"))
    top.chmod(0o755)
    base = "/usr/bin/python3"  # as the package lays it out: an interpreter every user may run
    subprocess.run([base, "-m", "venv", "--without-pip", str(top / ".venv")], check=True)
    agent_kept.cache_clear()
    try:
        yield top / ".venv"
    finally:
        agent_kept.cache_clear()
        shutil.rmtree(top)


@pytest.mark.usefixtures("as_root")
def test_a_helper_runs_the_agents_interpreter_from_a_checkout_under_tmp(
    venv_under_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = str(venv_under_tmp / "bin" / "python")
    monkeypatch.setattr(sys, "prefix", str(venv_under_tmp))
    assert python_imports(python, ["json"]) is None
    kept = agent_kept()
    assert [(d, k) for d, _, k in kept] == [("/tmp", str(venv_under_tmp.parent))]
    # Nothing else of the host's /tmp is in reach: the helper's /tmp holds the kept tree only.
    probe = "import os, sys; sys.exit(sorted(os.listdir('/tmp')) != [sys.argv[1]])"
    user = procs.helper_user()
    proc = popen_as(
        [python, "-I", "-c", probe, venv_under_tmp.parent.name],
        {"PATH": SYSTEM_PATH},
        user,
        Sandbox(1 << 20, keep_agent=True),
    )
    assert proc.wait(60) == 0, "the helper's /tmp holds more than the agent's own install"


def test_the_staging_directory_of_an_install_under_tmp_goes_with_the_agent(tmp_path: Path) -> None:
    """An agent installed under /tmp (a checkout there) makes a staging directory there for its
    helpers' and builds' sandboxes: it is removed when the agent exits, not left run after run."""
    code = (
        "import sys\n"
        f"sys.prefix = {str(tmp_path)!r}\n"
        "from flashnode.sandbox.procs.mounts import agent_kept\n"
        "print(agent_kept()[0][1])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    stage = Path(done.stdout.strip())
    assert stage.parent == Path("/tmp") and stage.name.startswith(".flashnode-stage-"), stage
    assert not stage.exists(), "the staging directory outlived the agent"
