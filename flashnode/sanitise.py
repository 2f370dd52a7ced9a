"""The one sanitiser for every text an owner sees: log and journal lines, ``status``, ``history``,
``envs list``, ``doctor``, ``logs`` and the terminal's status line.

Whatever its source (a task's output, a coordinator's answer, a data origin, a job's lines),
text reaches the owner's terminal or journal only through ``sanitise``: every character that is
not printable (C0 and C1 controls, DEL, the bidi overrides and isolates that reorder what is
shown, line and paragraph separators, lone surrogates) is written as its escape (``\\x1b``,
``\\u202e``), so nothing can move the cursor, recolour, reorder or split a line, or start a
journal record of its own (``\\n<0>``).
"""

from __future__ import annotations


def sanitise(text: str, *, keep: str = "", limit: int | None = None) -> str:
    """``text`` with every unprintable character escaped, but those in ``keep`` (``logs``
    keeps newlines and tabs: it prints a stream, not a record); at most ``limit`` characters."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return text


def _escape(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
