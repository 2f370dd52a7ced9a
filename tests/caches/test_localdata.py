"""Lent local datasets and the data settings: the [local_data] table, what the node advertises
(labels, never paths), which mounts a task gets, and the doctor's readability check."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from flashnode.caches.localdata import LentMount, mounts, requested_labels
from flashnode.cli.doctor import Report, _check_data
from flashnode.config.loading import load
from flashnode.errors import AttemptFailed, ConfigError
from flashnode.evidence import inventory
from flashnode.runners.registry import capabilities
from flashnode.sandbox.lentcheck import unreadable

URL = "http://127.0.0.1:8100"


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flashnode.toml"
    path.write_text(f'coordinator = "{URL}"\nstate_dir = "{tmp_path / "state"}"\n{text}')
    return path


@pytest.fixture
def lent(tmp_path: Path) -> dict[str, Path]:
    dirs = {"scans": tmp_path / "owner" / "scans", "notes.v2": tmp_path / "owner" / "notes"}
    for d in dirs.values():
        d.mkdir(parents=True)
    return dirs


def test_the_local_data_table_is_read_and_only_labels_are_advertised(
    tmp_path: Path, lent: dict[str, Path]
) -> None:
    table = "".join(f'"{k}" = "{v}"\n' for k, v in lent.items())
    s = load({}, {}, config(tmp_path, f"dataset_cache_bytes = 5000\n[local_data]\n{table}"))
    assert s.local_data == lent and s.dataset_cache_bytes == 5000
    reg = inventory.registration(s, "node-1", capabilities(s).offer(s, module_capable=False))
    assert reg.local_datasets == ["notes.v2", "scans"]  # the default runner lends them
    assert reg.capabilities.dataset_cache_bytes == 5000
    wire = reg.model_dump_json()
    assert str(tmp_path) not in wire and "owner" not in wire

    from_env = load(
        {},
        {"FLASHNODE_LOCAL_DATA": f"scans={lent['scans']}, notes.v2={lent['notes.v2']}"},
        config(tmp_path, ""),
    )
    assert from_env.local_data == lent
    plain = load({}, {}, config(tmp_path, ""))
    assert (plain.local_data, plain.dataset_cache_bytes, plain.dataset_ca_file) == ({}, 0, None)
    reg = inventory.registration(plain, "node-1")
    assert (reg.local_datasets, reg.capabilities.dataset_cache_bytes) == ([], 0)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('[local_data]\n"a b" = "/tmp"\n', "is not 1-64 of letters"),
        ('[local_data]\n".x" = "/tmp"\n', "is not 1-64 of letters"),
        (f'[local_data]\n"{"x" * 65}" = "/tmp"\n', "is not 1-64 of letters"),
        ('[local_data]\nscans = "relative/dir"\n', "is not an absolute path"),
        ('[local_data]\nscans = "/nonexistent/flashnode-scans"\n', "is not an existing directory"),
        ('[local_data]\nscans = "/etc/hostname"\n', "is not an existing directory"),
        ('local_data = "scans"\n', "label=/path pairs"),
        ("[local_data]\nscans = 3\n", "local_data = {.scans.: 3}"),
        ("dataset_cache_bytes = -1\n", "dataset_cache_bytes"),
        ("dataset_cache_bytes = true\n", "must be a size in bytes"),
        ("dataset_fetch_timeout_seconds = 0\n", "dataset_fetch_timeout_seconds"),
        ("dataset_fetch_timeout_seconds = inf\n", "must be a finite number"),
        ('dataset_ca_file = "/nonexistent/ca.pem"\n', "is not a readable PEM CA bundle"),
        ('dataset_ca_file = "/etc/hostname"\n', "is not a readable PEM CA bundle"),
    ],
)
def test_bad_data_settings_are_refused_with_a_reason(
    tmp_path: Path, text: str, reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason):
        load({}, {}, config(tmp_path, text))


def test_a_lent_directory_may_not_hold_the_agents_state_or_credentials(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    with pytest.raises(ConfigError, match=r"local_data everything .* would lend .*state"):
        load({}, {}, config(tmp_path, f'[local_data]\neverything = "{tmp_path}"\n'))
    creds = tmp_path / "creds"
    creds.mkdir()
    with pytest.raises(ConfigError, match="would lend .*creds"):
        load(
            {},
            {},
            config(tmp_path, f'credentials_dir = "{creds}/x"\n[local_data]\nc = "{creds}"\n'),
        )


def test_a_task_gets_exactly_the_labels_it_asks_for(lent: dict[str, Path]) -> None:
    assert mounts(["scans", "scans"], lent, "/work") == (
        LentMount("scans", lent["scans"], PurePosixPath("/work/inputs/scans")),
    )
    trusted = mounts(["notes.v2"], lent, PurePosixPath("/var/lib/flashnode/attempts/ls-1"))
    assert [m.target for m in trusted] == [
        PurePosixPath("/var/lib/flashnode/attempts/ls-1/inputs/notes.v2")
    ]
    assert mounts(None, lent, "/work") == () == mounts([], lent, "/work")
    assert requested_labels(["notes.v2", "scans"], lent) == ("notes.v2", "scans")


@pytest.mark.parametrize(
    ("local_inputs", "reason"),
    [
        ("scans", "local_inputs is not a list of labels"),
        ({"scans": 1}, "local_inputs is not a list of labels"),
        (["scans", 3], "local_inputs is not a list of labels"),
        (["scans", "hospital"], "local input 'hospital' is not a dataset this node lends"),
        (["../../etc"], "local input '../../etc' is not a dataset this node lends"),
    ],
)
def test_unknown_labels_and_bad_values_fail_the_attempt(
    lent: dict[str, Path], local_inputs: object, reason: str
) -> None:
    with pytest.raises(AttemptFailed, match=reason):
        mounts(local_inputs, lent, "/work")


def test_a_label_may_not_shadow_a_staged_input(lent: dict[str, Path]) -> None:
    with pytest.raises(AttemptFailed, match="'scans' collides with a staged input"):
        mounts(["scans"], lent, "/work", staged={"scans", "code"})


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """Outside pytest's private tmp dirs, so that another user can reach it."""
    path = Path(tempfile.mkdtemp(prefix="flashnode-lent-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.usefixtures("as_root")
def test_the_doctor_says_which_lent_directory_the_task_user_cannot_read_once_mounted(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nobody = (65534, 65534)
    fine, closed, secret_inside, hidden = (shared_dir / n for n in ("a", "b", "c", "d"))
    for d in (fine, closed, secret_inside, hidden):
        d.mkdir(mode=0o755)
        (d / "scan.dcm").write_bytes(b"x")
        (d / "scan.dcm").chmod(0o644)
    closed.chmod(0o700)
    (secret_inside / "private.key").write_bytes(b"k")
    (secret_inside / "private.key").chmod(0o600)
    inner = hidden / "inner"
    inner.mkdir(mode=0o755)
    (inner / "scan.dcm").write_bytes(b"x")
    (inner / "scan.dcm").chmod(0o644)
    hidden.chmod(0o700)  # no search for others: inner is out of reach by its path

    assert unreadable(fine, *nobody) is None
    assert unreadable(closed, *nobody) == "cannot list or enter it"
    assert unreadable(secret_inside, *nobody) == "cannot read private.key in it"
    # Tasks get it mounted by the agent (root): the directories above it may stay closed.
    assert unreadable(inner, *nobody) is None
    assert unreadable(shared_dir / "missing", *nobody) == "it is not an existing directory"
    assert unreadable(closed, os.geteuid(), os.getegid()) is None

    table = f'ok = "{fine}"\nclosed = "{closed}"\n'
    s = load(
        {},
        {},
        config(
            tmp_path, f'runner = "docker"\ndataset_cache_bytes = 1048576\n[local_data]\n{table}'
        ),
    )
    report = Report()
    _check_data(report, s)
    out = capsys.readouterr().out
    assert report.failures == 1
    assert f"FAIL  local data closed: {closed}: cannot list or enter it" in out
    assert "(uid 65534, gid 65534)" in out
    assert f"ok    local data ok: {fine}, readable by uid 65534" in out
    assert "ok    dataset cache: " in out and "0 shard(s), 0 bytes of 1 MiB" in out
