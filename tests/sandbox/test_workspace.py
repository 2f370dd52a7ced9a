"""Input archives and the output walk: nothing escapes, nothing odd is uploaded."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import socket
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashnode.errors import AttemptFailed, OutOfDescriptors, ShortOfRoom
from flashnode.sandbox import archives, dirwalk
from flashnode.sandbox.dirwalk import MAX_OPEN_DIRS
from flashnode.sandbox.outputs import list_outputs, usage
from flashnode.sandbox.removal import remove_tree
from flashnode.sandbox.workspace import Workspace


def unpack(ws: Workspace, archive: Path, name: str, max_bytes: int) -> None:
    archives.unpack(archive, ws.inputs / name, name, max_bytes)


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace.create(tmp_path / "attempts", "ls-1")


def tar_with(path: Path, *members: tuple[tarfile.TarInfo, bytes | None], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def test_a_good_tar_and_zip_unpack_into_inputs(ws: Workspace, tmp_path: Path) -> None:
    t = tar_with(tmp_path / "a.tar.gz", (member("code/train.py"), b"print(1)"), mode="w:gz")
    unpack(ws, t, "code", 1 << 20)
    assert (ws.inputs / "code" / "code" / "train.py").read_bytes() == b"print(1)"
    z = tmp_path / "b.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("d/x.txt", "hello")
    unpack(ws, z, "data", 1 << 20)
    assert (ws.inputs / "data" / "d" / "x.txt").read_text() == "hello"


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        (member("../evil.txt"), "escapes with '..'"),
        (member("a/../../evil.txt"), "escapes with '..'"),
        (member("/tmp/evil.txt"), "absolute path"),
        (member("link", tarfile.SYMTYPE, "/etc/passwd"), "is a symlink"),
        (member("hard", tarfile.LNKTYPE, "/etc/passwd"), "is a hardlink"),
        (member("dev", tarfile.CHRTYPE), "device or FIFO"),
        (member("fifo", tarfile.FIFOTYPE), "device or FIFO"),
    ],
)
def test_hostile_tar_members_are_refused(
    ws: Workspace, tmp_path: Path, info: tarfile.TarInfo, reason: str
) -> None:
    data = b"x" if info.type == tarfile.REGTYPE else None
    archive = tar_with(tmp_path / "bad.tar", (info, data))
    with pytest.raises(AttemptFailed, match=reason):
        unpack(ws, archive, "code", 1 << 20)
    assert not (tmp_path / "evil.txt").exists() and not (ws.inputs / "code").exists()


def test_symlink_then_write_through_it_is_refused(ws: Workspace, tmp_path: Path) -> None:
    archive = tar_with(
        tmp_path / "bad.tar",
        (member("d", tarfile.SYMTYPE, str(tmp_path)), None),
        (member("d/evil"), b"x"),
    )
    with pytest.raises(AttemptFailed):
        unpack(ws, archive, "code", 1 << 20)
    assert not (tmp_path / "evil").exists()


def test_hostile_zip_members_are_refused(ws: Workspace, tmp_path: Path) -> None:
    for name, reason in [
        ("../evil.txt", "escapes"),
        ("/abs.txt", "absolute"),
        ("..\\evil.txt", "escapes"),
    ]:
        z = tmp_path / "bad.zip"
        with zipfile.ZipFile(z, "w") as zf:
            zf.writestr(name, "x")
        with pytest.raises(AttemptFailed, match=reason):
            unpack(ws, z, "data", 1 << 20)
    z = tmp_path / "link.zip"
    with zipfile.ZipFile(z, "w") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(AttemptFailed, match="not a regular file"):
        unpack(ws, z, "data", 1 << 20)


def test_decompression_bomb_stops_at_the_cap(ws: Workspace, tmp_path: Path) -> None:
    z = tmp_path / "bomb.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("zeros", b"\0" * (64 << 20))
    assert z.stat().st_size < 1 << 20
    with pytest.raises(AttemptFailed, match="unpacks to more than"):
        unpack(ws, z, "data", 8 << 20)
    assert not (ws.inputs / "data").exists()


def deep_files(path: Path, members: int, depth: int) -> Path:
    """A gzipped tar of ``members`` one-byte files, each at the end of its own chain of
    ``depth`` directories that only the members' paths name: a few KiB, many inodes."""
    with tarfile.open(path, "w:gz") as tar:
        for m in range(members):
            info = tarfile.TarInfo(f"m{m}/" + "/".join(["a"] * depth) + "/f")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return path


def test_an_archive_stops_at_the_tasks_own_file_cap(ws: Workspace, tmp_path: Path) -> None:
    """30 members, each 100 directories deep: 3,030 files and directories (those its members'
    paths need count too), past a task_disk_files of 1,000."""
    archive = deep_files(tmp_path / "deep.tar.gz", 30, 100)
    with pytest.raises(AttemptFailed, match="more than 1000 files and directories"):
        archives.unpack(archive, ws.inputs / "data", "data", 1 << 20, max_entries=1000)
    archives.unpack(archive, ws.inputs / "ok", "ok", 1 << 20, max_entries=30 * 102)


def test_every_member_and_chunk_of_an_archive_is_handed_to_its_room_before_it_is_written(
    ws: Workspace, tmp_path: Path
) -> None:
    """Each file and directory (one inode) and each chunk of bytes goes to ``room`` before it is
    made or written: a room that refuses stops the archive there, leaving nothing behind."""
    archive = deep_files(tmp_path / "few.tar.gz", 3, 2)
    asked: list[tuple[int, int]] = []
    archives.unpack(
        archive, ws.inputs / "ok", "ok", 1 << 20, room=lambda b, i: asked.append((b, i))
    )
    made = sum(1 for _ in (ws.inputs / "ok").rglob("*"))
    assert sum(i for _, i in asked) == made
    assert sum(b for b, _ in asked) == sum(
        p.stat().st_size for p in (ws.inputs / "ok").rglob("*") if p.is_file()
    )

    def refuse(nbytes: int, inodes: int) -> None:
        if len(asked) > 3:
            raise ShortOfRoom("low disk: input 'data' does not fit")
        asked.append((nbytes, inodes))

    asked.clear()
    with pytest.raises(ShortOfRoom, match="does not fit"):
        archives.unpack(archive, ws.inputs / "data", "data", 1 << 20, room=refuse)
    assert not (ws.inputs / "data").exists()


def test_not_an_archive(ws: Workspace, tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"just text")
    with pytest.raises(AttemptFailed, match="not a tar or zip"):
        unpack(ws, tmp_path / "plain", "x", 1 << 20)


def test_outputs_lists_regular_files_with_metrics_last(ws: Workspace) -> None:
    (ws.out / "metrics.json").write_text("{}")
    (ws.out / "a").mkdir()
    (ws.out / "a" / "b.txt").write_text("b")
    (ws.out / "z.txt").write_text("z")
    assert [f.rel for f in list_outputs(ws, 100, 1000)] == ["a/b.txt", "z.txt", "metrics.json"]


def test_outputs_past_max_output_files_are_refused_before_upload(ws: Workspace) -> None:
    (ws.out / "metrics.json").write_text("{}")
    for i in range(5):
        (ws.out / f"f{i}").touch()
    assert len(list_outputs(ws, 100, 1000, max_files=6)) == 6
    with pytest.raises(AttemptFailed, match="outputs hold more than 5 files .max_output_files."):
        list_outputs(ws, 100, 1000, max_files=5)


def test_usage_counts_what_out_and_tmp_hold_on_disk(ws: Workspace) -> None:
    """Outputs by their size and number (checkpoints are not outputs); the disk by the blocks
    of everything under out/ and tmp/: a sparse file by what it holds, a file with two names
    once, checkpoints and directories too."""
    assert "ckpt" in ws.not_outputs and (ws.out / "ckpt").is_dir()  # every workspace has one
    (ws.out / "ckpt" / "step-1.bin").write_bytes(os.urandom(300_000))
    (ws.out / "a.bin").write_bytes(os.urandom(100_000))
    with open(ws.tmp / "sparse", "wb") as f:
        f.truncate(1 << 40)  # a terabyte of nothing
    (ws.tmp / "deep" / "er").mkdir(parents=True)
    (ws.tmp / "deep" / "er" / "b.bin").write_bytes(os.urandom(200_000))
    os.link(ws.tmp / "deep" / "er" / "b.bin", ws.tmp / "again.bin")
    use = usage(ws)
    assert (use.output_bytes, use.output_files) == (100_000, 1)
    held = sum(
        os.lstat(p).st_blocks * 512
        for p in [ws.out / "ckpt" / "step-1.bin", ws.out / "a.bin", ws.tmp / "again.bin"]
    )
    dirs = sum(
        os.lstat(d).st_blocks * 512
        for d in [ws.out / "ckpt", ws.tmp / "deep", ws.tmp / "deep" / "er"]
    )
    assert use.disk_bytes == held + dirs + os.lstat(ws.tmp / "sparse").st_blocks * 512
    assert 600_000 <= use.disk_bytes < 1 << 30


def test_usage_counts_the_files_and_directories_once_each(ws: Workspace) -> None:
    (ws.tmp / "d" / "e").mkdir(parents=True)
    for i in range(5):
        (ws.tmp / "d" / f"f{i}").touch()  # empty: no block, an inode each
    os.link(ws.tmp / "d" / "f0", ws.tmp / "d" / "e" / "again")
    os.symlink("nowhere", ws.out / "link")
    # out/ckpt, tmp/d, tmp/d/e, five files (one with two names), the link
    assert usage(ws).disk_files == 9


@contextlib.contextmanager
def descriptors(more: int) -> Iterator[None]:
    """This process may open at most ``more`` descriptors meanwhile (0: not one): the limit
    is set where exactly ``more`` numbers below it are free (earlier tests of the process may
    have left holes among the numbers in use; a new descriptor takes the lowest free one)."""
    used = {int(n) for n in os.listdir("/proc/self/fd")}
    limit, free = 0, 0
    while free < more or limit in used:
        free += limit not in used
        limit += 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_wide_tree_is_walked_whole_with_few_descriptors(ws: Workspace) -> None:
    """2,000 directories side by side, each holding a file: a walk that opened every one of a
    directory's subdirectories before reading them would need 2,000 descriptors at once."""
    for i in range(2000):
        (ws.tmp / "w" / f"{i:04d}").mkdir(parents=True)
        (ws.tmp / "w" / f"{i:04d}" / "blob").write_bytes(b"x" * 4096)
    with descriptors(MAX_OPEN_DIRS + 2):
        use = usage(ws)
    assert use.disk_files == 1 + 2000 * 2 + 1  # out/ckpt, w, each directory and its blob
    assert use.disk_bytes >= 2000 * 4096


def test_a_deep_tree_is_walked_whole_with_few_descriptors(ws: Workspace) -> None:
    """A chain of 300 directories, a file at the bottom and one at every level: the walk keeps
    MAX_OPEN_DIRS of them open, and finds its way back up through the ones it closed."""
    here = os.open(ws.tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(300):
            os.mkdir("d", dir_fd=here)
            fd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=here)
            os.write(fd, b"x" * 100)
            os.close(fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = nxt
        fd = os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=here)
        os.close(fd)
    finally:
        os.close(here)
    with descriptors(MAX_OPEN_DIRS + 2):
        found = [rel for rel, _ in dirwalk.walk(ws.root, ["tmp"])]
    assert len(found) == 300 * 2 + 1
    assert found.count("/".join(["d"] * 300) + "/bottom") == 1
    assert usage(ws).disk_files == 1 + 300 * 2 + 1


@pytest.mark.parametrize("replace", [False, True])
def test_a_branch_moved_away_under_a_deep_walk_is_not_mistaken_for_another(
    ws: Workspace, replace: bool
) -> None:
    """The walk goes back up through directories it closed: by ``..``, which leads elsewhere
    once the task moved the branch, so it is checked to be the directory it left, else opened
    by name from the root and checked the same way. A directory found by neither way (moved,
    and another put in its place) fails a strict walk; a tolerant one goes on with the rest."""
    top = MAX_OPEN_DIRS + 4
    (ws.out / "/".join(["d"] * top)).mkdir(parents=True)
    (ws.out / "d" / "x").mkdir()
    (ws.out / "metrics.json").write_text("{}")
    (ws.tmp / "only-in-tmp").touch()

    def walk(tolerant: bool) -> list[str]:
        seen = []
        it = dirwalk.walk(ws.root, ["out"], tolerant=tolerant)
        for rel, _ in it:
            seen.append(rel)
            if rel.count("/") == top - 1:  # at the bottom: the task moves the branch away
                os.rename(ws.out / "d" / "d", ws.tmp / "moved")
                if replace:
                    os.rename(ws.out / "d", ws.tmp / "old")
                    (ws.out / "d").mkdir()
        return seen

    if not replace:
        seen = walk(tolerant=False)
        assert "d/x" in seen and "metrics.json" in seen
        assert not any("only-in-tmp" in rel or "moved" in rel for rel in seen)
        return
    with pytest.raises(AttemptFailed, match="out/d changed while it was read"):
        walk(tolerant=False)
    for name in ("moved", "old"):
        remove_tree(ws.tmp / name)
    os.rmdir(ws.out / "d")
    (ws.out / "/".join(["d"] * top)).mkdir(parents=True)
    (ws.out / "d" / "x").mkdir()
    seen = walk(tolerant=True)
    assert "metrics.json" in seen and not any("only-in-tmp" in rel for rel in seen)


def test_running_out_of_descriptors_is_the_nodes_fault_never_a_gap(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No entry is left out because the agent had no descriptor to open it: the walk ends the
    attempt as the node's fault (OutOfDescriptors), whether it runs out at a subdirectory or
    at the top."""
    (ws.tmp / "a" / "b").mkdir(parents=True)
    (ws.tmp / "a" / "b" / "big").write_bytes(b"x" * 100_000)
    real_open = os.open

    def starved(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if path == "b":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dirwalk.os, "open", starved)
    with pytest.raises(OutOfDescriptors, match="tmp/a/b"):
        usage(ws)
    monkeypatch.setattr(dirwalk.os, "open", real_open)
    (ws.out / "metrics.json").write_text("{}")
    with descriptors(0), pytest.raises(OutOfDescriptors):
        list_outputs(ws, 1000, 1000)


def test_outputs_refuse_links_fifos_sockets_and_oversize(ws: Workspace, tmp_path: Path) -> None:
    (ws.out / "metrics.json").write_text("{}")
    (ws.out / "sub").mkdir()
    os.symlink("/etc/passwd", ws.out / "sub" / "leak")
    with pytest.raises(AttemptFailed, match="out/sub/leak is a symlink"):
        list_outputs(ws, 100, 1000)
    os.unlink(ws.out / "sub" / "leak")
    os.mkfifo(ws.out / "fifo")
    with pytest.raises(AttemptFailed, match="FIFO"):
        list_outputs(ws, 100, 1000)
    os.unlink(ws.out / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws.out / "sock"))
    with pytest.raises(AttemptFailed, match="socket"):
        list_outputs(ws, 100, 1000)
    sock.close()
    os.unlink(ws.out / "sock")
    (ws.out / "big").write_bytes(b"x" * 101)
    with pytest.raises(AttemptFailed, match="larger than 100 bytes"):
        list_outputs(ws, 100, 1000)
    with pytest.raises(AttemptFailed, match="in all"):
        list_outputs(ws, 1000, 102)
    os.unlink(ws.out / "metrics.json")
    with pytest.raises(AttemptFailed, match="no out/metrics.json"):
        list_outputs(ws, 1000, 1000)
