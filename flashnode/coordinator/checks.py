"""Checks of declared output formats, before anything is uploaded.

Federated averaging: a ``metrics.json`` that names a ``delta_file`` must carry the six keys the
driver reads, with the right types; the delta must be a safe bare file name in ``out/``, shaped
``{name: {"shape": [int, ...], "data": [number, ...]}}`` with ``len(data) == prod(shape)``, and
every value finite. One broken worker then fails its own attempt here instead of crashing the
driver's whole round (docs/protocol.md §10 item 13). The delta is checked as a stream (ijson), so a
delta of hundreds of MB is never loaded whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

from flashnode.errors import AttemptFailed

DELTA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FEDAVG_KEYS: dict[str, tuple[type, ...]] = {
    "chunks_done": (list,),
    "delta_file": (str,),
    "local_steps": (int,),
    "loss": (int, float),
    "round": (int,),
    "samples": (int,),
}


Opener = Callable[[str], "AbstractContextManager[BinaryIO] | None"]


def check_fedavg(metrics: Any, open_output: Opener) -> None:
    """Check a federated-averaging contribution, if ``metrics`` declares one. ``open_output``
    opens a file of out/ by its relative name (None when out/ has no such regular file)."""
    if not isinstance(metrics, dict) or "delta_file" not in metrics:
        return
    for key, types in FEDAVG_KEYS.items():
        value = metrics.get(key)
        if value is None:
            raise AttemptFailed(f"metrics.json lacks {key!r}, which federated averaging needs")
        if isinstance(value, bool) or not isinstance(value, types):
            raise AttemptFailed(f"metrics.json {key!r} has the wrong type")
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in metrics["chunks_done"]):
        raise AttemptFailed("metrics.json 'chunks_done' is not a list of integers")
    if not math.isfinite(metrics["loss"]):
        raise AttemptFailed("metrics.json 'loss' is not finite")
    # The driver divides by the sum of samples and credits only workers that did some chunks:
    # a credited worker must report a positive count, and no worker a negative one.
    if metrics["samples"] < 0 or (metrics["chunks_done"] and metrics["samples"] == 0):
        raise AttemptFailed("metrics.json 'samples' must be positive for the chunks it did")
    name = metrics["delta_file"]
    if not DELTA_NAME.match(name):
        raise AttemptFailed(f"metrics.json delta_file {name[:64]!r} is not a safe bare file name")
    opened = open_output(name)
    if opened is None:
        raise AttemptFailed(f"delta_file {name!r} is not a file in out/")
    with opened as fh:
        check_delta(fh, name)


def check_delta(fh: BinaryIO, name: str) -> None:
    """Stream through a weight delta, checking its shape and that every value is finite."""
    depth = 0
    param: str | None = None  # the parameter being read
    field: str | None = None  # "shape", "data" or another key of that parameter
    shape: list[int] | None = None
    count = 0
    seen_data = False
    import ijson  # here, not at the top: only a module task's delta is read with it

    try:
        for event, value in ijson.basic_parse(fh, use_float=True, buf_size=1 << 16):
            if event in ("start_map", "start_array"):
                depth += 1
                if depth == 1 and event != "start_map":
                    raise AttemptFailed(f"{name} is not a JSON object of parameters")
                if depth == 2 and event != "start_map":
                    raise AttemptFailed(f"{name}: parameter {param!r} is not {{shape, data}}")
                if depth == 3 and event == "start_array" and field == "shape":
                    shape = []
                elif (
                    depth >= 3
                    and field in ("shape", "data")
                    and (depth > 3 or event != "start_array")
                ):
                    raise AttemptFailed(f"{name}: parameter {param!r} {field} is not a flat list")
                continue
            if event in ("end_map", "end_array"):
                if depth == 2 and event == "end_map":
                    _finish_param(name, param, shape, count, seen_data)
                    param, shape, count, seen_data = None, None, 0, False
                depth -= 1
                continue
            if event == "map_key":
                if depth == 1:
                    param = value
                elif depth == 2:
                    field = value
                    seen_data = seen_data or value == "data"
                continue
            if depth == 3 and field == "shape":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise AttemptFailed(f"{name}: parameter {param!r} has a bad shape")
                assert shape is not None
                shape.append(value)
            elif depth == 3 and field == "data":
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise AttemptFailed(f"{name}: parameter {param!r} holds a non-number")
                if not math.isfinite(value):
                    raise AttemptFailed(f"{name}: parameter {param!r} holds a non-finite value")
                count += 1
            elif depth <= 2:
                where = f"parameter {param!r}" if depth == 2 else "the top level"
                raise AttemptFailed(f"{name}: {where} holds a bare value")
    except ijson.JSONError:
        where = f"in parameter {param!r}" if param else "at its start"
        raise AttemptFailed(
            f"{name} is not valid JSON {where} (NaN and Infinity are not JSON numbers)"
        ) from None
    if depth != 0:
        raise AttemptFailed(f"{name} is truncated")


def _finish_param(
    name: str, param: str | None, shape: list[int] | None, count: int, seen: bool
) -> None:
    if shape is None or not seen:
        raise AttemptFailed(f"{name}: parameter {param!r} lacks shape or data")
    expected = math.prod(shape)
    if count != expected:
        raise AttemptFailed(
            f"{name}: parameter {param!r} has {count} values for shape {shape} ({expected})"
        )
