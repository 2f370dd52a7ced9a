"""The ``[local_data]`` table's rule: which labels and directories an owner may lend (what
``caches/localdata.py`` mounts into the tasks that ask).
"""

from __future__ import annotations

import re
from pathlib import Path

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def lent_problem(label: str, path: Path) -> str | None:
    """Why ``label = path`` cannot be lent (a bad label, a relative or missing directory);
    None if it can. For the settings."""
    if not LABEL.match(label):
        return f"label {label[:64]!r} is not 1-64 of letters, digits, '.', '_', '-'"
    if not path.is_absolute():
        return f"{label}: {path} is not an absolute path"
    if "\n" in str(path):
        return f"{label}: {str(path)!r} holds a newline"
    if not path.is_dir():
        return f"{label}: {path} is not an existing directory"
    return None
