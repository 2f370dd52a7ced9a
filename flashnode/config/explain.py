"""A setting refused, in the owner's words: which setting, where it came from (the file and
line, the variable or the flag), what it was, and what is allowed (``explain``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from flashnode.config.settings import ENV_PREFIX, RUNNER_TABLES, Settings
from flashnode.config.sizes import format_size
from flashnode.errors import ConfigError

SETTABLE_KEYS = frozenset(k for k in Settings.model_fields if k not in ("token", "join_code"))

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


def refused_setting(exc: ValidationError) -> str:
    """The setting ``explain`` names first."""
    errors = exc.errors()
    return str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else "settings"


def where_to_correct(exc: ConfigError, config_file: Path | None) -> str:
    """Where the owner corrects a refused setting: the config file (and, for a runner's option,
    its table), the variable or the flag the refusal names; ``config_file``: the file the
    settings were read from (None: none was)."""
    key, where = exc.setting, exc.where or ""
    table = next((t for t, keys in RUNNER_TABLES.items() if key in keys), None)
    file = config_file.absolute() if config_file is not None else None
    place = f"the [{table}] table of {file}" if table else str(file)
    if where.startswith("in ") and file is not None:
        return f"correct the setting named above in {place}"
    if where.startswith("from --"):
        return f"correct the flag {where.removeprefix('from ')}"
    if where.startswith("from "):
        return (
            f"correct {where.removeprefix('from ')} where it is set (this shell, or the"
            " service's Environment=: sudo systemctl edit flashnode)"
        )
    tables = " or ".join(f"[{t}]" for t in RUNNER_TABLES)
    if key is not None and key in SETTABLE_KEYS:  # not set anywhere: its default is refused
        if file is None:
            variable = f"{ENV_PREFIX}{key.upper()}"
            return f"set {key} in the config file (--config), with its flag or {variable}"
        return f"set {key} in {place}"
    if file is not None:
        return f"correct {file} as said above (a runner's option goes in its table, {tables})"
    return f"correct the setting named above (a flag or a {ENV_PREFIX}* variable)"


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
