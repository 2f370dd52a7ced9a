"""A job's declared output validators (the payload's ``validators``), checked on the node the way
flashruntime 0.6.1's coordinator checks them at commit (``service/modea.py`` ``_semantic_problem``
and ``validators.py``), so that a result the coordinator would refuse fails the attempt with the
coordinator's own reason before any output is uploaded.

Only for a task that carries ``workload_type`` or ``validators`` (as on the coordinator):
``metrics.json`` must be readable JSON; a ``command`` task's must be an object; ``keys`` names
top-level keys that must be present and not null; ``json_schema`` is a JSON Schema it must
conform to. The schema is checked where ``jsonschema`` can be imported, in a helper process of
its own (``procs.helpers.json_schema_problem``): a schema is the job's, and a pattern that
backtracks without end must not hold the agent (Python's regular expressions keep the interpreter's
lock). Where the coordinator would fail without a reason, the node fails the attempt with one: a
schema that is not a valid JSON Schema or cannot be applied (a ``$ref`` within it that leads
nowhere: the coordinator answers 500), a check that does not end in ``procs.helpers.SCHEMA_CHECK_S``
(it would hold the coordinator as long). The node never fetches what a schema refers to: a schema
with a ``$ref`` outside itself is left to the coordinator, as is every schema where ``jsonschema``
cannot be imported.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_KEYS = 1000
MAX_KEY_CHARS = 1024
# What the helper process runs: one JSON object on the descriptor named by argv[1] ({"schema",
# "metrics"}); one line of JSON on stdout: {"problem": reason or null} or {"unchecked": why}.
# Its reason for a result that does not conform is the coordinator's, word for word; its other
# reasons are its own and name the check that failed, never quoting an exception's text (which
# may quote a whole document). Its registry retrieves nothing: a ``$ref`` is resolved within the
# schema itself (and the published meta-schemas jsonschema carries), never fetched from a URL or
# read from a file; a schema that refers to anything else is left to the coordinator. Started as
# the agent's user (its interpreter may lie where only that user can read); a root agent's helper
# becomes argv[2] ("uid:gid", the helper user) once jsonschema is imported and has run once (what
# it imports on first use), before it reads anything of the job's.
SCHEMA_HELPER = r"""
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.exit(0)
try:
    import jsonschema
    from jsonschema import SchemaError, ValidationError
    from referencing import Registry
    from referencing.exceptions import Unresolvable
except ImportError:
    say(unchecked="jsonschema 4.18 or later is not installed for the agent")
NOWHERE = Registry()
warm = {"type": "object", "required": ["a"], "properties": {"a": {"type": "array", "items": {
    "type": ["integer", "string"], "pattern": "^x", "minimum": 0, "format": "date"}}}}
jsonschema.validate({"a": [1, "x"]}, warm, registry=NOWHERE)
try:
    jsonschema.validate({"a": [-1]}, warm, registry=NOWHERE)
except ValidationError as exc:
    "/".join(str(p) for p in exc.absolute_path) + exc.message
if sys.argv[2]:
    uid, gid = (int(n) for n in sys.argv[2].split(":"))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
with os.fdopen(int(sys.argv[1]), "rb") as fh:
    given = json.loads(fh.read())
try:
    jsonschema.validate(given["metrics"], given["schema"], registry=NOWHERE)
except ValidationError as exc:
    where = "/".join(str(p) for p in exc.absolute_path) or "<root>"
    say(problem=f"metrics.json does not conform to the declared schema at {where}: {exc.message}")
except SchemaError as exc:
    where = ("/".join(str(p) for p in exc.absolute_path) or "<root>")[:200]
    say(problem=(
        f"the declared json_schema is not a valid JSON Schema (at {where}: the meta-schema's"
        f" {str(exc.validator)[:40]!r} check fails)"
    ))
except Unresolvable as exc:
    if type(getattr(exc, "_wrapped", exc)) is Unresolvable:
        say(unchecked=(
            "the declared json_schema refers to a resource outside itself ($ref), which this"
            " node never fetches"
        ))
    say(problem="the declared json_schema cannot be applied (a $ref within it leads nowhere)")
except Exception as exc:  # what the coordinator would answer with a 500
    say(problem=f"the declared json_schema cannot be applied ({type(exc).__name__})")
say(problem=None)
"""


class Unchecked(Exception):
    """The schema could not be checked on this node; the message says why."""


# A schema check: (schema, parsed metrics) -> the coordinator's reason, or None; Unchecked when
# it cannot tell.
SchemaCheck = Callable[[dict[str, Any], Any], "str | None"]


@dataclass(frozen=True)
class Validators:
    keys: tuple[str, ...] = ()
    json_schema: dict[str, Any] = field(default_factory=dict)


def parse_validators(value: Any) -> Validators | None:
    """The payload's ``validators``, or ValueError with the reason (the coordinator refuses a
    malformed declaration at submission, so a payload carrying one is malformed). Names the
    coordinator does not check are left alone, as it leaves them."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ValueError("payload validators is not an object")
    keys = value.get("keys") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError("payload validators.keys is not a list of key names")
    if len(keys) > MAX_KEYS or any(len(k) > MAX_KEY_CHARS for k in keys):
        raise ValueError(f"payload validators.keys names more than {MAX_KEYS} keys or too long")
    schema = value.get("json_schema") or {}
    if not isinstance(schema, dict):
        raise ValueError("payload validators.json_schema is not an object")
    return Validators(tuple(keys), schema)


def problem(
    data: bytes,
    workload_type: str | None,
    declared: Validators | None,
    schema_check: SchemaCheck | None,
) -> str | None:
    """Why the coordinator would refuse this ``metrics.json`` (``data``), in its words; None
    when it would not (or this node cannot tell). Raises Unchecked when only the schema is left
    and it could not be checked here."""
    if not workload_type and declared is None:
        return None
    try:
        # As the coordinator reads it: Path.read_text (UTF-8, universal newlines), json.loads.
        metrics = json.loads(io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read())
    except (ValueError, RecursionError) as exc:
        return f"metrics.json is not readable JSON ({exc})"
    if workload_type == "command" and not isinstance(metrics, dict):
        return "metrics.json must contain a JSON object"
    if declared is None or not isinstance(metrics, dict):
        return None  # the coordinator itself cannot check what is not an object
    if declared.keys:
        missing = [k for k in declared.keys if metrics.get(k) is None]
        if missing:
            return (
                f"metrics.json is missing required key(s) {sorted(missing)} "
                f"(declared by the job's 'keys' validator)"
            )
    if declared.json_schema:
        if schema_check is None:
            raise Unchecked("this node has no schema check")
        return schema_check(declared.json_schema, metrics)
    return None
