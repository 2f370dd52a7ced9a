"""A setting refused, in the owner's words: which setting, where it came from (the file and
line, the variable or the flag), what it was, and what is allowed (``explain``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from flashnode.config.sizes import format_size

_EXPECTED = {
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "int_type": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be text",
    "path_type": "must be a path",
    "tuple_type": "must be a list (or one comma-separated string)",
    "list_type": "must be a list (or one comma-separated string)",
}


def _allowed(error: ErrorDetails, key: str) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}

    def bound(value: Any) -> str:
        return format_size(int(value)) if key.endswith("_bytes") else str(value)

    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind == "greater_than":
        return f"must be greater than {bound(ctx['gt'])}"
    if kind == "greater_than_equal":
        return f"must be at least {bound(ctx['ge'])}"
    if kind == "less_than":
        return f"must be less than {bound(ctx['lt'])}"
    if kind == "less_than_equal":
        return f"must be at most {bound(ctx['le'])}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected', 'one of the documented values')}"
    return _EXPECTED.get(kind, str(error["msg"]).removeprefix("Value error, "))


def explain(exc: ValidationError, merged: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    """``slots = '-1' (from --slots): must be a whole number of at least 1, or "auto"``."""
    keys: list[str] = []
    first: ErrorDetails | None = None
    for error in exc.errors():
        key = str(error["loc"][0]) if error["loc"] else "settings"
        if key not in keys:
            keys.append(key)
            first = first or error
    assert first is not None
    key = keys[0]
    where = f" ({origin[key]})" if key in origin else ""
    value = merged.get(key)
    shown = f" = {value!r}" if value is not None and key not in ("token", "join_code") else ""
    more = f"; also check {', '.join(keys[1:])}" if keys[1:] else ""
    return f"{key}{shown}{where}: {_allowed(first, key)}{more}"
