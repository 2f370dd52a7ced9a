"""``./packaging/build`` says what it needs: each missing prerequisite (a checkout, python3's
venv module, a pip that can reach PyPI) stops it with one line that says what to do. The whole
build, and the package under a real systemd, are tests/owner/test_systemd.py's; the first line
it puts above the installed README is tests/test_docs.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # real bash, python3 and pip

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "packaging" / "build"


def _build(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


def test_the_build_outside_a_checkout_says_to_run_it_in_one(tmp_path: Path) -> None:
    (tmp_path / "packaging").mkdir()
    script = Path(shutil.copy(BUILD, tmp_path / "packaging" / "build"))
    done = _build(script, {})
    assert done.returncode == 1, done.stdout + done.stderr
    assert _last_line(done).startswith("packaging/build: run it in a checkout"), done.stderr
    assert not (tmp_path / "dist").exists()


def test_the_build_with_a_python_without_venv_names_the_package_to_install(
    tmp_path: Path,
) -> None:
    # Debian's python3 without python3-venv: no ensurepip, so no virtualenv with pip.
    python = tmp_path / "python3"
    python.write_text(
        "#!/bin/sh\n"
        'case "$*" in *ensurepip*|*venv*) echo "No module named ensurepip" >&2; exit 1 ;; esac\n'
        'exec /usr/bin/python3 "$@"\n'
    )
    python.chmod(0o755)
    done = _build(BUILD, {"FLASHNODE_PYTHON": str(python)})
    assert done.returncode == 1, done.stdout + done.stderr
    last = _last_line(done)
    assert last.startswith("packaging/build: ") and "apt install python3-venv" in last, last


def test_a_pip_that_cannot_reach_an_index_stops_the_build_saying_so(tmp_path: Path) -> None:
    cut_off = {
        "PIP_CONFIG_FILE": os.devnull,  # none of this host's local indexes
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": "",
        "PIP_INDEX_URL": "",
        "PIP_EXTRA_INDEX_URL": "",
        "FLASHNODE_FETCH_RETRY_SECONDS": "0",  # each fetch is tried three times
    }
    done = _build(BUILD, cut_off)
    assert done.returncode == 1, done.stdout + done.stderr
    last = _last_line(done)
    assert last.startswith("packaging/build: pip installing flashnode and its dependencies failed")
    assert "PyPI" in last, last
    assert "ERROR" in done.stderr  # pip's own words, above the line

