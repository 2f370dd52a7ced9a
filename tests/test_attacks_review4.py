"""Attacks on 39d0f17..261c9af (the review of the output split: status.read reads again when a
publish falls between its two reads, status-owner.json padded and written in place on a full
disk). Each test is one attack and FAILS while the hole it shows is open.

The common thread: status.json does not say whether a task printed anything, so ``status.read``
cannot tell "no output" from "the owner's part is missing, torn or of another snapshot". Each way
the owner's part goes missing ends the same: the owner (root) is shown ``last output  -``, as if
the task printed nothing, and a failure's reason reads "(the task's last lines: owner only)" to
the owner."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, QuietSink, node_view

from flashnode import statefile
from flashnode.node.publisher import Publisher
from flashnode.owner import status

TASK = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "phase": "execute"}
LINE = "epoch 7 loss 0.12"


def _running(line: str) -> tuple[dict[str, Any], ...]:
    return ({**TASK, "last_output": line},)


def _shown(state_dir: Path) -> str:
    read = status.read(state_dir)
    assert read is not None
    return status.render(read, None, read.get("updated_at"))


# --- 1. a full disk before the owner file exists ------------------------------------------------


def test_a_full_disk_before_any_task_printed_shows_the_owner_no_output_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status-owner.json is made only once a task printed something; status.json at the agent's
    start. The in-place fallback (``statefile.overwrite``) needs a file to write over: on a disk
    that filled before the first line (a task filling it is the usual way), the owner file is
    never created, the error is swallowed, status.json moves on in place without the line, and
    the owner's `flashnode status` says `last output  -` for as long as the disk stays full."""
    clock = FakeClock()
    publisher = Publisher(clock, QuietSink())
    publisher.publish(node_view(tmp_path, counters={}))  # the agent's start: idle
    assert (tmp_path / status.STATUS_FILE).exists()

    def full(path: Path, data: bytes, *args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(statefile, "write", full)
    clock.sleep(60)
    publisher.publish(node_view(tmp_path, counters={}, running=_running(LINE), beats=4))
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())
    read = status.read(tmp_path)
    assert read is not None and read["updated_at"] == 1.7e9 + clock.now  # written in place
    shown = status.render(read, None, read["updated_at"])
    assert "last output  -" not in shown, shown  # told it printed nothing


# --- 2. the re-read gives up while the publish is still half way -------------------------------


def test_the_reread_gives_up_while_status_json_is_still_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write`` writes status-owner.json, then status.json (a group lookup, fchown, write,
    rename between them). ``read``'s three tries follow each other with no wait: a reader that
    sees the new owner part while status.json is still the old one spends them in microseconds
    and returns the old snapshot without its line, and without saying so."""
    clock = FakeClock()
    publisher = Publisher(clock, QuietSink())
    publisher.publish(node_view(tmp_path, counters={}, running=_running("a")))
    owner = tmp_path / status.OWNER_FILE
    before = owner.read_bytes()
    real = statefile.write

    def slow_status(path: Path, data: bytes, *args: Any, **kw: Any) -> None:
        if path.name == status.STATUS_FILE:
            time.sleep(0.5)  # e.g. getgrnam over NSS (sssd, LDAP) for the group flashnode
        real(path, data, *args, **kw)

    monkeypatch.setattr(statefile, "write", slow_status)
    writer: list[threading.Thread] = []

    def alive(pid: int) -> bool:  # called between the reads of status.json and the owner file
        if not writer:
            clock.sleep(60)
            view = node_view(tmp_path, counters={}, running=_running("b"), beats=4)
            writer.append(threading.Thread(target=publisher.publish, args=(view,)))
            writer[0].start()
            deadline = time.monotonic() + 5
            while owner.read_bytes() == before and time.monotonic() < deadline:
                time.sleep(0.005)  # the owner part is written; status.json not yet
        return pid == os.getpid()

    monkeypatch.setattr(status, "agent_alive", alive)
    try:
        shown = _shown(tmp_path)
    finally:
        for t in writer:
            t.join()
    assert writer
    assert "last output  -" not in shown, shown


# --- 3. a torn owner file (written in place) is not read again ---------------------------------


def test_a_torn_owner_file_is_not_read_again_as_a_torn_status_json_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk both files are written in place, not atomically ("a reader may see a mix
    of old and new": ``statefile.overwrite``). ``_load`` reads a torn status.json again; a torn
    status-owner.json is taken as "no owner part" (ValueError: nothing merged, nothing said),
    and the owner is shown no line."""
    clock = FakeClock()
    publisher = Publisher(clock, QuietSink())
    publisher.publish(node_view(tmp_path, counters={}, running=_running(LINE)))
    owner = tmp_path / status.OWNER_FILE
    whole = owner.read_text()
    cut = whole.index(LINE) + 3
    torn = whole[:cut] + " " * (len(whole) - cut)  # the overwrite seen half done
    real_read = Path.read_text
    seen: list[bool] = []

    def read_text(self: Path, *args: Any, **kw: Any) -> str:
        if self.name == status.OWNER_FILE and not seen:
            seen.append(True)
            return torn
        return real_read(self, *args, **kw)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())
    shown = _shown(tmp_path)
    assert seen
    assert "last output  -" not in shown, shown


# --- 4. any error on the owner file is swallowed, unlogged --------------------------------------


def test_an_owner_file_that_cannot_be_written_is_logged_and_shown_as_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """c09a9a0 let only a full disk pass; 39d0f17 wraps the owner write in
    ``contextlib.suppress(OSError)``: EIO, EROFS, EACCES... are dropped without a word (the
    publisher logs a status.json it cannot write; this one it never hears of), and every
    `flashnode status` from then on shows the owner no line."""
    clock = FakeClock()
    real = statefile.write

    def broken(path: Path, data: bytes, *args: Any, **kw: Any) -> None:
        if path.name == status.OWNER_FILE:
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path, data, *args, **kw)

    monkeypatch.setattr(statefile, "write", broken)
    caplog.set_level(logging.INFO)
    Publisher(clock, QuietSink()).publish(node_view(tmp_path, counters={}, running=_running(LINE)))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said, "the owner's lines are lost with nothing in the log"
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())
    assert "last output  not available" in _shown(tmp_path)


# --- sanity: the fakes write what the tests above assume ----------------------------------------


def test_sanity_an_ordinary_publish_gives_the_owner_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    Publisher(clock, QuietSink()).publish(node_view(tmp_path, counters={}, running=_running(LINE)))
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())
    assert f"last output  {LINE}" in _shown(tmp_path)
    hidden = json.loads((tmp_path / status.OWNER_FILE).read_text())
    assert hidden["last_output"] == {"ls-1": LINE}
