"""Task output on disk with a size cap: the head, a marker, and the tail."""

from __future__ import annotations

from pathlib import Path

from flashnode.sandbox.logcap import CappedFile


def test_a_stream_under_the_cap_is_kept_whole(tmp_path: Path) -> None:
    f = CappedFile(tmp_path / "out.txt", 100)
    f.write(b"hello ")
    f.write(b"world")
    f.close()
    assert (tmp_path / "out.txt").read_bytes() == b"hello world"


def test_a_stream_over_the_cap_keeps_its_head_a_marker_and_its_tail(tmp_path: Path) -> None:
    f = CappedFile(tmp_path / "out.txt", 10)
    for i in range(100):
        f.write(f"line {i:03d}\n".encode())
    f.close()
    text = (tmp_path / "out.txt").read_text()
    assert text.startswith("line 000\nl")
    assert "890 bytes over the 10-byte cap not kept; the last 890 follow" in text
    assert text.endswith("line 099\n")
    assert f.tail.endswith(b"line 099\n")


def test_a_full_disk_stops_the_file_but_not_the_stream() -> None:
    """/dev/full answers every write with ENOSPC, as a full state dir does."""
    import errno

    f = CappedFile(Path("/dev/full"), 1 << 20)
    f.write(b"step 1\n")  # never raises: the thread copying the task's pipe goes on
    f.write(b"step 2\n")
    f.close()
    assert f.error is not None and f.error.errno == errno.ENOSPC
    assert f.tail == b"step 1\nstep 2\n" and f.last_line == "step 2"
