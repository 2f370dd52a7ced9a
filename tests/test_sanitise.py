"""One sanitiser for every text an owner sees: whatever its source (a task,
the coordinator, a data origin, a job's lines), nothing reaches the owner's terminal or journal
that moves the cursor, recolours, reorders text or starts a record of its own."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from badcoord import BadCoordinator, answer, lease_answer
from harness import TASK_USER, AgentProcess

from flashnode.cli.logsetup import JournalFormatter, JsonFormatter, LogFormatter
from flashnode.owner import status
from flashnode.sanitise import sanitise

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
# What a hostile source sends: OSC 0 (the window title), OSC 52 (the owner's clipboard), CSI
# (clear the screen), a C1 CSI, a bidi override and isolate, and a newline that starts a journal
# record of priority 0 (emergency) of its own.
HOSTILE = (
    "\x1b]0;owned\x07\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2J\x9b31m"
    " \u202etxt.exe\u2066 \n<0>flashnode: EMERGENCY forged\r\n<3>and another\u2028<1>one"
)
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u2066", "\u2028", "\n", "\r")


def clean(text: str) -> bool:
    return not any(c in text for c in RAW)


@pytest.fixture
def bad() -> Iterator[BadCoordinator]:
    server = BadCoordinator()
    yield server
    server.close()


def test_every_unprintable_character_is_escaped_and_text_kept() -> None:
    assert sanitise("step 3 of 10: 42% €, naïve, 数据") == "step 3 of 10: 42% €, naïve, 数据"
    assert sanitise("a\x1b[2Jb\x9bc\u202ed\u2069e\tf\ng\udcff") == (
        "a\\x1b[2Jb\\x9bc\\u202ed\\u2069e\\x09f\\x0ag\\udcff"
    )
    assert sanitise("line\tone\nline two\r", keep="\t\n") == "line\tone\nline two\\x0d"
    assert sanitise("x" * 10, limit=5) == "xxxx…"


def _record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError(HOSTILE)
        except RuntimeError:
            info = sys.exc_info()
    return logging.LogRecord("flashnode", logging.WARNING, __file__, 1, message, args, info)


def test_each_log_record_is_one_line_and_a_traceback_cannot_forge_a_journal_record() -> None:
    journal = JournalFormatter("%(message)s")
    line = journal.format(_record("lease %s: commit not accepted (final): %s", "ls-1", HOSTILE))
    assert "\n" not in line and clean(line) and line.startswith("<4>lease ls-1: commit not")
    assert "\\x0a<0>flashnode: EMERGENCY forged" in line

    lines = journal.format(_record("crashed: %s", HOSTILE, exc=True)).split("\n")
    assert len(lines) > 2 and all(ln.startswith("<4>") for ln in lines), lines
    assert all(clean(ln) for ln in lines)

    human = LogFormatter("%(asctime)s %(levelname)-7s %(message)s").format(_record(HOSTILE))
    assert "\n" not in human and clean(human) and "WARNING" in human
    entry = json.loads(JsonFormatter().format(_record(HOSTILE)))
    assert clean(entry["msg"])


def test_a_coordinators_detail_cannot_forge_a_journal_line_or_drive_the_terminal(
    flashnode: Callable[..., Any], bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    """The attack: `complete` answers accepted:false with a detail holding escapes and
    "\\n<0>...". The agent logs it (under journald: a priority prefix per line) and keeps it as
    the attempt's reason, which `flashnode history` prints."""
    bad.claims = [lease_answer(1)]
    bad.overrides["/v1alpha1/attempts/ls-000000000001/complete"] = answer(
        200, {"accepted": False, "detail": HOSTILE}
    )
    agent = start_agent(
        bad.url, *TRUSTED, "--max-tasks", "1", env={**FAST, "JOURNAL_STREAM": "8:12345"}
    )
    assert agent.wait(60) == 0, agent.log
    log = agent.log
    assert "EMERGENCY forged" in log, log
    for line in log.splitlines():
        assert re.match(r"<[1-7]>", line), line  # every line is a record of the agent's
    assert clean(log.replace("\n", "")), log
    [record] = agent.ledger()
    assert record["outcome"] == "rejected"
    history = flashnode("history", "--state-dir", str(agent.state_dir))
    assert history.returncode == 0, history.stderr
    _header, shown = history.stdout.splitlines()
    assert "EMERGENCY forged" in shown and clean(shown), shown


def test_envs_list_shows_a_jobs_bidi_and_c1_controls_escaped(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    """A job's dependency lines pass uv's checks with C1 and bidi controls in them (a marker's
    string, a URL's fragment) and are kept as the environment's description."""
    entry = tmp_path / "state" / "envs" / ("ab" * 32)
    entry.mkdir(parents=True)
    meta = {
        "python": "3.11",
        "bytes": 1 << 20,
        "last_used": time.time(),
        "created": time.time(),
        "lines": ['numpy==2.0; platform_machine != "\u202e46_68x\u2066"', "evil\x9b2J\x1b]0;t\x07"],
    }
    (entry / "meta.json").write_text(json.dumps(meta))
    (entry / "env" / "bin").mkdir(parents=True)
    (entry / "env" / "bin" / "python").symlink_to(sys.executable)  # a finished environment
    listed = flashnode("envs", "list", "--state-dir", str(tmp_path / "state"))
    assert listed.returncode == 0, listed.stderr
    assert "numpy==2.0" in listed.stdout and "\\u202e46_68x" in listed.stdout, listed.stdout
    assert clean(listed.stdout.replace("\n", "")), listed.stdout


def test_the_doctor_shows_a_coordinators_hostile_refusal_escaped(
    flashnode: Callable[..., Any], bad: BadCoordinator, tmp_path: Path
) -> None:
    bad.overrides["/healthz"] = answer(200, {"status": "ok"})
    bad.overrides["/v1alpha1/nodes/register"] = answer(401, {"detail": HOSTILE})
    env = {
        "FLASHNODE_RUNNER": "trusted",
        "FLASHNODE_POOLS": "team-a",
        "FLASHNODE_STATE_DIR": str(tmp_path / "state"),
        "FLASHNODE_ALLOW_SAME_USER": "true",
    }
    if os.geteuid() == 0:
        env["FLASHNODE_TASK_USER"] = TASK_USER
    doctor = flashnode("doctor", "--coordinator", bad.url, env=env)
    assert doctor.returncode == 1
    assert "EMERGENCY forged" in doctor.stdout, doctor.stdout
    assert clean(doctor.stdout.replace("\n", "")) and clean(doctor.stderr.replace("\n", ""))


def test_status_and_the_terminal_line_show_hostile_text_escaped() -> None:
    now = time.time()
    attempt = {
        "lease_id": "ls-1",
        "job_id": "job",
        "task_id": "task",
        "phase": "execute",
        "started_at": now - 5,
        "suspend_reason": HOSTILE,
        "suspended_since": now - 1,
        "last_output": HOSTILE,  # an agent of another version may not have escaped it
    }
    snapshot = {
        "node_id": "n",
        "state": "running",
        "controls": {"held_by": [{"rule": "load", "reason": HOSTILE}]},
        "running": [{**attempt, **status.ages(attempt, now)}],
    }
    rendered = status.render(snapshot)
    assert "EMERGENCY forged" in rendered
    assert all(clean(line) for line in rendered.split("\n"))
    assert clean(status.attempt_line(attempt, now))
