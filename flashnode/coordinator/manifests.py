"""flashruntime's local checkpoint manifests (its ``checkpoint/local.py``): what a task using
``flashruntime.torch.checkpoint`` or the Hugging Face callback writes, parts first and
``manifest.json`` last, into a ``step-*`` or ``checkpoint-*`` directory of its checkpoint
directory.

A manifest is the task's file, so everything in it is checked before the agent acts on it: its
size, that it is JSON of the expected shape, every part a plain file name of that directory
(never a path, never the manifest itself, each once) with a sha256 and a size, a step and a
world size in range, a printable framework name. ``storage_prefix`` is never used as a path by
the agent: parts are read from the directory that holds the manifest, and a restored copy gets
the prefix of the place it was restored to (``retarget``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_PARTS = 1000
MAX_STEP = 10**15 - 1
MAX_WORLD_SIZE = 1 << 20
MAX_FRAMEWORK = 200
MAX_PART_NAME = 255
# The directories flashruntime's pickers look at: ``step-*`` (flashruntime.torch) and
# ``checkpoint-*`` (the Hugging Face Trainer), with names that are safe in an artifact key.
DIRECTORY = re.compile(r"^(?:step|checkpoint)-[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


NOT_JSON = "it is not JSON"  # also what a manifest being written reads as


class Invalid(ValueError):
    """A manifest that cannot be used; the message says why."""


@dataclass(frozen=True)
class Part:
    name: str  # a file directly in the manifest's directory
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    step: int
    parts: tuple[Part, ...]
    world_size: int
    framework: str


def parse(data: bytes) -> Manifest:
    """The checked manifest in ``data`` (a ``manifest.json``), or Invalid with the reason."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise Invalid(f"it is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Invalid(NOT_JSON) from None
    if not isinstance(body, dict):
        raise Invalid("it is not a JSON object")
    step = _integer(body.get("step"), "step", 0, MAX_STEP)
    world_size = _integer(body.get("world_size", 1), "world_size", 1, MAX_WORLD_SIZE)
    framework = body.get("framework", "")
    if (
        not isinstance(framework, str)
        or len(framework) > MAX_FRAMEWORK
        or not framework.isprintable()
    ):
        raise Invalid(f"its framework is not a printable name of at most {MAX_FRAMEWORK}")
    if not isinstance(body.get("storage_prefix"), str):
        raise Invalid("its storage_prefix is not a string")
    parts = body.get("parts")
    if not isinstance(parts, list) or not parts:
        raise Invalid("it lists no parts")
    if len(parts) > MAX_PARTS:
        raise Invalid(f"it lists more than {MAX_PARTS} parts")
    checked = tuple(_part(p) for p in parts)
    if len({p.name for p in checked}) != len(checked):
        raise Invalid("it lists a part twice")
    return Manifest(step, checked, world_size, framework)


def retarget(data: bytes, storage_prefix: str) -> bytes:
    """``data`` (a manifest ``parse`` accepted) with ``storage_prefix`` naming where it lies now,
    written the way flashruntime writes it; unchanged when it already does."""
    body = json.loads(data.decode("utf-8"))
    if body.get("storage_prefix") == storage_prefix:
        return data
    body["storage_prefix"] = storage_prefix
    return json.dumps(body, indent=2).encode("utf-8")


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Invalid(f"its {name} is not a whole number from {low} to {high}")
    return value


def _part(value: Any) -> Part:
    if not isinstance(value, dict):
        raise Invalid("a part is not an object")
    name = value.get("key")
    if not isinstance(name, str) or not plain_name(name):
        shown = name[:100] if isinstance(name, str) else name
        raise Invalid(f"part {shown!r} is not the name of a file beside the manifest")
    sha256 = value.get("sha256")
    if not isinstance(sha256, str) or not SHA256.match(sha256):
        raise Invalid(f"part {name!r} has no valid sha256")
    size = value.get("size_bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise Invalid(f"part {name!r} has no valid size")
    return Part(name, sha256, size)


def plain_name(name: str) -> bool:
    """A file name directly in the manifest's directory: no path, printable, not the manifest."""
    if name in ("", ".", "..", MANIFEST_NAME) or "/" in name or "\\" in name:
        return False
    if not name.isprintable():
        return False
    try:
        return len(name.encode("utf-8")) <= MAX_PART_NAME
    except UnicodeEncodeError:
        return False
