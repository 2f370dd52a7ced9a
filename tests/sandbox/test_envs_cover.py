"""The cover over the job environments' directory, as a root agent's chain puts it together with
its private mounts from one table (``envs_fstab``): a task sees the directory empty but for what
is kept for it, read-only, and its private /tmp as before."""

from __future__ import annotations

import pwd
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import ended_in_sandbox

from flashnode.sandbox import procs
from flashnode.sandbox.procs.chain import command
from flashnode.sandbox.procs.mounts import EnvsTables, Sandbox, envs_fstab, private_table

PRIVATE = private_table(1 << 20)


@pytest.fixture
def state() -> Iterator[Path]:
    """A state dir outside the private directories a task gets its own of (as an agent's must
    be for its chains to cover the job environments)."""
    root = Path(tempfile.mkdtemp(prefix="flashnode-envs-test-", dir="/var/lib"))
    root.chmod(0o755)  # task users pass through it
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_table_puts_the_cover_together_over_the_private_tmp_after_the_private_mounts(
    tmp_path: Path,
) -> None:
    root = "/state/envs"
    table = Path(envs_fstab(tmp_path, PRIVATE, root, [f"{root}/.python", f"{root}/job env"]))
    text = table.read_text()
    assert text.startswith(PRIVATE)
    lines = [line.split() for line in text[len(PRIVATE) :].splitlines()]
    assert [(line[1], line[2]) for line in lines] == [
        ("/tmp", "tmpfs"),
        ("/tmp/.python", "none"),
        ("/tmp/job\\040env", "none"),  # fstab's escape for a space
        ("/tmp", "tmpfs"),
    ]
    assert lines[1][3].startswith("bind,ro,") and lines[3][3].startswith("remount,ro,")
    assert lines[0][0] == lines[3][0] != "flashnode-envs"  # a source no other mount has
    same = envs_fstab(tmp_path, PRIVATE, root, [f"{root}/job env", f"{root}/.python"])
    assert same == str(table)
    assert envs_fstab(tmp_path, PRIVATE, root, [f"{root}/.python"]) != str(table)


@pytest.mark.parametrize(
    "kept", ["/state/other/x", "/state/envs/a\nb", "/state/envsx/a", "/state/envs/../x"]
)
def test_a_kept_directory_outside_the_environments_or_with_a_newline_is_refused(
    tmp_path: Path, kept: str
) -> None:
    with pytest.raises(ValueError, match="kept environment"):
        envs_fstab(tmp_path, PRIVATE, "/state/envs", [kept])


def test_a_kept_directory_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    (tmp_path / "elsewhere").mkdir()
    envs.mkdir()
    (envs / "job").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="kept environment"):
        envs_fstab(tmp_path, PRIVATE, str(envs), [str(envs / "job")])


def test_no_cover_is_put_together_without_a_private_tmp_under_it(tmp_path: Path) -> None:
    """Moved over the environments, the cover uncovers what lies under it at /tmp: never the
    host's /tmp, only the task's own."""
    without_tmp = "".join(line + "\n" for line in PRIVATE.splitlines() if " /tmp " not in line)
    with pytest.raises(ValueError, match="no /tmp"):
        envs_fstab(tmp_path, without_tmp, "/state/envs", ["/state/envs/.python"])
    private = tmp_path / "sandbox.fstab"
    private.write_text(PRIVATE)
    table = envs_fstab(tmp_path, PRIVATE, "/state/envs", ["/state/envs/.python"])
    for mismatched in (
        Sandbox(1 << 20, envs="/state/envs"),
        Sandbox(1 << 20, fstab=str(private), envs="/state/envs"),
        Sandbox(1 << 20, fstab=table),
    ):
        with pytest.raises(ValueError, match="put together by the sandbox's table"):
            command(None, None, mismatched)


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize("mismatch", ["private table, envs named", "envs table, none named"])
def test_a_chain_whose_table_and_cover_do_not_match_runs_nothing(
    tmp_path: Path, state: Path, mismatch: str
) -> None:
    """Past ``command``'s own check (a caller that built the sandbox wrong): the chain itself
    refuses to move the private /tmp over the environments (the task would see the host's
    /tmp) or to run a task on the cover left on its /tmp (it would see every environment)."""
    envs = state / "envs"
    (envs / ".python").mkdir(parents=True)
    if mismatch.startswith("private"):
        (state / "envs-private.fstab").write_text(PRIVATE)  # named as a cover's, holding none
        sandbox = Sandbox(1 << 20, fstab=str(state / "envs-private.fstab"), envs=str(envs))
    else:
        table = Path(envs_fstab(state, PRIVATE, str(envs), [str(envs / ".python")]))
        named = table.rename(state / "sandbox.fstab")  # a cover's table, named as the private
        sandbox = Sandbox(1 << 20, fstab=str(named))
    ran = state / "ran"
    proc = ended_in_sandbox(["touch", str(ran)], sandbox, state, tmp_path)
    assert not proc.launched and not ran.exists()
    assert proc.setup_failure() in (
        "cannot cover the job environments",
        "the private /tmp is not in place",
    ), proc.setup_failure()


def test_a_table_planted_under_the_name_it_will_have_is_never_used(tmp_path: Path) -> None:
    """Its name is a digest of paths every task's command line shows: a file someone put there
    first (a read-write bind of every environment) is written over by the run that needs it."""
    root, kept = "/state/envs", ["/state/envs/.python"]
    name = Path(envs_fstab(tmp_path / "probe", PRIVATE, root, kept)).name
    planted = tmp_path / name
    planted.write_text(f"{root} /tmp none bind 0 0\n")
    assert EnvsTables(tmp_path, PRIVATE).table(root, kept) == str(planted)
    assert f"{root} /tmp" not in planted.read_text() and "remount,ro" in planted.read_text()


def test_tables_made_by_many_chains_at_once_are_each_written_whole_once(tmp_path: Path) -> None:
    tables, root = EnvsTables(tmp_path, PRIVATE), "/state/envs"
    sets = [[f"{root}/.python"], [f"{root}/.python", f"{root}/k/env"]] * 40
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda kept: tables.table(root, kept), sets))
    assert len(set(paths)) == 2
    assert all(Path(p).read_text().count("remount,ro") == 1 for p in set(paths))
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(Path(p).name for p in set(paths))


@pytest.mark.usefixtures("as_root")
def test_a_task_sees_only_its_own_environment_and_the_interpreters_read_only(
    tmp_path: Path, state: Path
) -> None:
    envs = state / "envs"
    for name in (".python", "key/its env", "another"):
        (envs / name).mkdir(parents=True)
        (envs / name / "file").write_text(name.split("/")[-1])
    kept = [str(envs / ".python"), str(envs / "key/its env")]  # as the cache keeps them
    table = envs_fstab(state, PRIVATE, str(envs), kept)
    sandbox = Sandbox(1 << 20, fstab=table, envs=str(envs))
    script = (
        'id -u; ls -A "$1" 2>/dev/null || echo unlisted; cat "$1/key/its env/file"'
        ' "$1/.python/file"; echo; cat "$1/another/file" 2>/dev/null || echo "no other";'
        ' touch "$1/x" "$1/key/its env/x" 2>/dev/null || echo "read-only";'
        " touch /tmp/mine && ls -A /tmp && stat -c %a /tmp"
    )
    user = pwd.getpwnam("flashnode-task-0")  # what ./scripts/task-users makes
    task_user = procs.TaskUser(user.pw_name, user.pw_uid, user.pw_gid)
    # Not under /tmp: the task's /tmp is its own.
    argv = ["sh", "-c", script, "sh", str(envs)]
    proc = ended_in_sandbox(argv, sandbox, state, tmp_path, task_user)
    assert proc.launched, proc.setup_failure()
    out = (tmp_path / "out").read_text().splitlines()
    # Its own /tmp: empty, writable, sticky, as the private mounts made it.
    expected = [str(user.pw_uid), "unlisted", "its env.python", "no other", "read-only"]
    assert out == [*expected, "mine", "1777"], (tmp_path / "err").read_text()
    assert not (envs / "x").exists() and not (envs / "key/its env/x").exists()
