"""The package's removal scripts, run as dpkg runs them for `apt purge` (preremove "remove", then
postremove "purge"), in a mount namespace of their own: the host's /etc, /var/lib and /opt are
not touched (an overlay, a tmpfs, this checkout's virtual environment as /opt/flashnode), and
systemctl, userdel and groupdel are stubs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SANDBOX = r"""
set -e
T=$1
mount --make-rprivate /
mount -t overlay overlay -o lowerdir=/etc,upperdir=$T/etc-up,workdir=$T/etc-work /etc
mount -t tmpfs tmpfs /var/lib
mount -t tmpfs tmpfs /opt
mkdir /opt/flashnode /var/lib/flashnode
mount --bind "$VENV" /opt/flashnode
if [ -d /run/systemd ]; then mount -t tmpfs tmpfs /run/systemd; fi
mkdir -p /etc/flashnode/credentials
cp "$T/flashnode.toml" /etc/flashnode/flashnode.toml
echo node-1 >/var/lib/flashnode/node-id
export PATH="$T/stubs:/usr/sbin:/usr/bin:/sbin:/bin"
sh "$PACKAGING/preremove.sh" remove
sh "$PACKAGING/postremove.sh" purge
[ ! -e /var/lib/flashnode ] && echo "service state dir: gone"
"""


def purge(tmp_path: Path, config: str) -> str:
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    venv = Path(sys.prefix)
    if not (venv / "pyvenv.cfg").exists():
        pytest.skip("the tests do not run in a virtual environment")
    for d in ("etc-up", "etc-work", "stubs"):
        (tmp_path / d).mkdir()
    for stub, code in (("systemctl", 0), ("userdel", 1), ("groupdel", 1)):
        (tmp_path / "stubs" / stub).write_text(f"#!/bin/sh\nexit {code}\n")
        (tmp_path / "stubs" / stub).chmod(0o755)
    (tmp_path / "flashnode.toml").write_text(config)
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", SANDBOX, "sh", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"VENV": str(venv), "PACKAGING": str(ROOT / "packaging"), "PATH": "/usr/bin:/bin"},
    )
    if done.returncode != 0 and "mount" in done.stderr and "service state dir" not in done.stdout:
        pytest.skip(f"no private mounts here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.usefixtures("as_root")
def test_a_purge_names_the_state_dir_the_owner_chose_and_how_to_remove_it(tmp_path: Path) -> None:
    chosen = tmp_path / "srv" / "flashnode"
    chosen.mkdir(parents=True)
    (chosen / "ledger.jsonl").write_text("{}\n")
    said = purge(tmp_path, f'coordinator = "http://127.0.0.1:9"\nstate_dir = "{chosen}"\n')
    assert "service state dir: gone" in said
    assert f"the agent's state dir {chosen} (state_dir in /etc/flashnode/flashnode.toml)" in said
    assert f"sudo rm -rf '{chosen}'" in said, said
    assert (chosen / "ledger.jsonl").exists()  # the owner's: left as it is


@pytest.mark.usefixtures("as_root")
def test_a_purge_of_a_node_on_the_services_state_dir_names_no_other(tmp_path: Path) -> None:
    said = purge(tmp_path, 'coordinator = "http://127.0.0.1:9"\n')
    assert "service state dir: gone" in said
    assert "the agent's state dir" not in said and "rm -rf" not in said, said


@pytest.mark.usefixtures("as_root")
def test_a_purge_suggests_removing_only_what_is_plainly_a_state_dir(tmp_path: Path) -> None:
    """A state_dir set to /srv (or a home) must not be answered with `rm -rf` of it."""
    chosen = tmp_path / "srv"
    chosen.mkdir()
    (chosen / "www").mkdir()
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    said = purge(first, f'coordinator = "http://127.0.0.1:9"\nstate_dir = "{chosen}"\n')
    assert f"the agent's state dir {chosen}" in said and "rm -rf" not in said, said
    quoted = tmp_path / "it's"
    quoted.mkdir()
    (quoted / "ledger.jsonl").write_text("{}\n")
    said = purge(second, f'coordinator = "http://127.0.0.1:9"\nstate_dir = "{quoted}"\n')
    assert "rm -rf" not in said, said
