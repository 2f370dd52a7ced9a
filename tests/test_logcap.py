"""Task output on disk with a size cap: the head, a marker, and the tail."""

from __future__ import annotations

from pathlib import Path

from flashnode.logcap import CappedFile


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
