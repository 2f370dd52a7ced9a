"""The ids and keys the coordinator hands out, checked strictly before any of them ends up in a
path or a URL: ``SAFE_ID`` (lease, task, job and input ids) and ``safe_key`` (artifact keys, under
``artifact://``).
"""

from __future__ import annotations

import re

SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ARTIFACT_SCHEME = "artifact://"


def safe_key(key: str) -> bool:
    """A relative artifact key with no empty, '.' or '..' segment and no backslash or NUL."""
    if not key or key.startswith("/") or "\\" in key or "\0" in key:
        return False
    return all(seg not in ("", ".", "..") for seg in key.split("/"))
