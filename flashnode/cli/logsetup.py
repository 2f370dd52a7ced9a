"""The agent's log: every record one sanitised line (a traceback's lines led like it), the
journal's priority prefix under systemd, JSON lines when asked, the terminal's status line kept
below; and a thread that dies says so in it. A record of an attempt carries its ``lease_id``,
``job_id`` and ``task_id`` (``flashnode.logcontext``): once at the head of a human line, as fields
of a JSON one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any

from flashnode import logcontext
from flashnode.owner.status import TerminalLine
from flashnode.sanitise import sanitise

log = logging.getLogger("flashnode")


# journald reads a "<N>" prefix as the line's priority (sd-daemon(3)).
PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class LogFormatter(logging.Formatter):
    """Every record is one line, sanitised, whatever its source (a task, the coordinator, a data
    origin, a job): a newline in a message cannot start a line (or a journal record) of its own.
    A traceback's lines follow, each sanitised and led like its record (``lead``), indented.
    The message is headed by the attempt the record belongs to, if any (``logcontext.head``)."""

    def lead(self, record: logging.LogRecord) -> str:
        return ""

    def format(self, record: logging.LogRecord) -> str:
        record.message = sanitise(logcontext.head(record) + record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lead = self.lead(record)
        more: list[str] = []
        if record.exc_info:
            more += self.formatException(record.exc_info).splitlines()
        if record.stack_info:
            more += self.formatStack(record.stack_info).splitlines()
        lines = [lead + self.formatMessage(record), *(f"{lead}  {sanitise(x)}" for x in more)]
        return "\n".join(lines)


class JournalFormatter(LogFormatter):
    """No timestamp (journald stamps each line), and the priority as a prefix of every line."""

    def lead(self, record: logging.LogRecord) -> str:
        return f"<{PRIORITY.get(record.levelno, 6)}>"


class LineClearingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Clears the terminal status line before a log line, and redraws it after."""

    def __init__(self, line: TerminalLine) -> None:
        super().__init__(line.stream)
        self.line = line

    def emit(self, record: logging.LogRecord) -> None:
        self.line.clear()
        super().emit(record)
        if self.line.text:
            self.line.status(self.line.text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": sanitise(record.getMessage()),
        }
        for name, value in logcontext.of(record).items():  # only those known: an attempt's
            entry[name] = sanitise(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(log_json: bool, line: TerminalLine | None = None) -> None:
    handler: logging.Handler = (
        LineClearingHandler(line) if line else logging.StreamHandler(sys.stderr)
    )
    if log_json:
        handler.setFormatter(JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(LogFormatter("%(asctime)s %(levelname)-7s %(message)s"))
    handler.addFilter(logcontext.AttemptFields())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def log_thread_death(args: threading.ExceptHookArgs) -> None:
    """Any other thread of the agent's that dies says so in the agent's log (journald)."""
    if args.exc_type is SystemExit:
        return
    exc = (args.exc_type, args.exc_value, args.exc_traceback)
    name = args.thread.name if args.thread is not None else "?"
    log.error("thread %s ended with an error", name, exc_info=exc)  # type: ignore[arg-type]
