"""Every owner command, run by a user who is not root against a node whose agent is root's (the
packaged service's layout: a root-owned config, a 0711 state dir with status.json 0640
root:flashnode, root's credentials), ends in one line: what needs root says "run it with sudo"
(or the group to join), and no traceback ever reaches the user."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import shared_dir

ROOT = Path(__file__).resolve().parents[2]
USER = 64_123  # a uid with no account: nothing of it exists on the machine

# Every test runs the flashnode program, as a user who is not root.
pytestmark = pytest.mark.usefixtures("as_root", "flashnode")


@pytest.fixture(scope="module")
def node() -> Iterator[Path]:
    """A node laid out as the package lays it out, in a directory any user can reach."""
    base = shared_dir("flashnode-nonroot-")
    base.chmod(0o755)
    state, creds, etc = base / "state", base / "creds", base / "etc"
    state.mkdir(mode=0o711)
    creds.mkdir(mode=0o700)
    etc.mkdir(mode=0o755)
    config = etc / "flashnode.toml"
    config.write_text(
        f'coordinator = "http://127.0.0.1:9"\nstate_dir = "{state}"\n'
        f'credentials_dir = "{creds}"\nrunner = "trusted"\npools = ["team-a"]\n'
        '[trusted]\ntask_user = "flashnode-task"\n'
    )
    (creds / "127.0.0.1_9.token").write_text("secret\n")
    (creds / "127.0.0.1_9.token").chmod(0o600)
    status = state / "status.json"
    status.write_text('{"pid": 1, "running": []}\n')
    status.chmod(0o640)
    with __import__("contextlib").suppress(KeyError):
        os.chown(status, 0, grp.getgrnam("flashnode").gr_gid)
    ledger = state / "ledger.jsonl"
    ledger.write_text(
        '{"lease_id": "ls-0c1d", "job_id": "j", "task_id": "t", "outcome": "failed"}\n'
    )
    ledger.chmod(0o640)  # as the agent keeps it: root:flashnode, like status.json
    with __import__("contextlib").suppress(KeyError):
        os.chown(ledger, 0, grp.getgrnam("flashnode").gr_gid)
    (state / "pause.json").write_text('{"version": 1, "mode": "drain", "until": null}\n')
    (state / "attempts").mkdir(mode=0o700)
    (state / "envs").mkdir(mode=0o711)
    yield config
    shutil.rmtree(base, ignore_errors=True)


def as_user(*args: str, config: Path | None) -> subprocess.CompletedProcess[str]:
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PYTHONPATH": f"{ROOT}:{site}", "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
    options = []
    if config is not None:
        options = ["--config", str(config)]
        if args[0] in STATE_DIR_COMMANDS:
            options += ["--state-dir", str(config.parent.parent / "state")]
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={USER}",
            f"--regid={USER}",
            "--clear-groups",
            "--",
            "/usr/bin/python3",
            "-m",
            "flashnode",
            *args,
            *options,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


STATE_DIR_COMMANDS = ("status", "history", "logs", "pause", "resume", "ui", "work")
COMMANDS = [
    ("status",),
    ("history",),
    ("logs",),
    ("logs", "ls-1"),
    ("pause",),
    ("resume",),
    ("pools", "join", "team-b"),
    ("pools", "leave", "team-a"),
    ("doctor",),
    ("login",),
    ("logout",),
    ("ui",),
    ("envs", "list"),
    ("envs", "prune"),
    ("work",),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_what_needs_root_says_run_it_with_sudo_in_one_line(
    node: Path, command: tuple[str, ...]
) -> None:
    probe = as_user("--version", config=None)
    if "flashnode" not in probe.stdout:
        pytest.skip(f"/usr/bin/python3 cannot import this checkout: {probe.stderr[-300:]}")
    done = as_user(*command, config=node)
    said = done.stdout + done.stderr
    assert "Traceback" not in said, said
    assert done.returncode != 0, said
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, said
    assert "sudo" in lines[0], said
    # Nothing was changed: the config, the pause.
    assert 'pools = ["team-a"]' in node.read_text()
    assert (node.parent.parent / "state" / "pause.json").exists()


def test_a_member_of_group_flashnode_reads_the_status_and_is_told_what_it_may_not(
    node: Path,
) -> None:
    """The group may read status.json (here of an agent that is gone): status answers; what
    only root may do still says so in one line."""
    gid = grp.getgrnam("flashnode").gr_gid
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PYTHONPATH": f"{ROOT}:{site}", "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
    member = ["setpriv", f"--reuid={USER}", f"--regid={gid}", f"--groups={gid}", "--"]
    state = str(node.parent.parent / "state")
    shown = subprocess.run(
        [*member, "/usr/bin/python3", "-m", "flashnode", "status", "--state-dir", state],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 3 and "no agent is running" in shown.stdout, shown.stderr
    paused = subprocess.run(
        [*member, "/usr/bin/python3", "-m", "flashnode", "pause", "--state-dir", state],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert paused.returncode == 1 and "run it with sudo" in paused.stderr, paused.stderr
    assert "Traceback" not in paused.stderr


def test_a_member_of_group_flashnode_reads_the_history_the_console_shows_her(node: Path) -> None:
    """The console's view-only level shows the ledger; `flashnode history` reads it for the same
    people (the group), and still not for anyone else."""
    gid = grp.getgrnam("flashnode").gr_gid
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PYTHONPATH": f"{ROOT}:{site}", "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
    state = str(node.parent.parent / "state")
    member = ["setpriv", f"--reuid={USER}", f"--regid={gid}", f"--groups={gid}", "--"]
    stranger = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--"]
    history = ["/usr/bin/python3", "-m", "flashnode", "history", "--state-dir", state]
    shown = subprocess.run([*member, *history], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.splitlines()
    assert "lease" in header and row.split()[1:4] == ["ls-0c1d", "j/t", "failed"]
    refused = subprocess.run(
        [*stranger, *history], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "join the group flashnode" in refused.stderr
    assert "Traceback" not in refused.stderr
