"""Who may read the ledger: the agent's user and group ``flashnode`` (as ``status.json``), so that
``flashnode history`` agrees with the console's view-only level, which shows the ledger too."""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest

from flashnode.owner.ledger import Ledger


@pytest.fixture
def group_gid() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root: the agent's ledger is handed to group flashnode")
    try:
        return grp.getgrnam("flashnode").gr_gid
    except KeyError:
        pytest.skip("no group flashnode on this machine")


def test_the_agents_ledger_is_made_readable_by_group_flashnode(
    tmp_path: Path, group_gid: int
) -> None:
    ledger = Ledger.shared(tmp_path / "ledger.jsonl")
    ledger.append({"lease_id": "ls-1", "outcome": "committed"})
    st = ledger.path.stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o640, group_gid)


def test_a_private_ledger_an_older_agent_made_is_opened_up_when_the_agent_opens_it(
    tmp_path: Path, group_gid: int
) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"lease_id": "ls-0"}\n')
    path.chmod(0o600)
    Ledger.shared(path)  # the agent's start: before any new attempt ends
    st = path.stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o640, group_gid)
    assert [r["lease_id"] for r in Ledger(path).records()] == ["ls-0"]


def test_a_reader_never_changes_the_ledgers_mode(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"lease_id": "ls-0"}\n')
    path.chmod(0o600)
    Ledger(path).records()
    Ledger(path).append({"lease_id": "ls-1"})  # not the agent's: no group asked for
    assert path.stat().st_mode & 0o777 == 0o600


def test_without_group_flashnode_the_agents_ledger_stays_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No such group (or an agent not in it): 0600, not 0640 with whatever group the agent's
    user has."""
    monkeypatch.setattr("flashnode.statefile.STATUS_GROUP", "flashnode-no-such-group")
    ledger = Ledger.shared(tmp_path / "ledger.jsonl")
    ledger.append({"lease_id": "ls-1"})
    assert ledger.path.stat().st_mode & 0o777 == 0o600
