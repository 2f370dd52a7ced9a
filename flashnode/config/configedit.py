"""Changes to the owner's config file, made the one way both ``flashnode pools`` and the console
make them: parsed with tomlkit (comments and layout kept), written whole to a temporary file with
the old file's mode and owner, checked with the loader ``work`` uses, and renamed into place only
when ``work`` would accept the result. A refused change raises ``Refused`` with the reason and
leaves the file as it was.

tomlkit is imported only here, when a change is made: a running agent that is never asked for one
never loads it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashnode.config.settings import POOL_ID
from flashnode.errors import ConfigError

if TYPE_CHECKING:
    import tomlkit

Validate = Callable[[Path], object]  # raises ConfigError for a file `work` would refuse


class Refused(Exception):
    """A change that was not made; ``str`` is the reason, in the owner's words."""


def parse(path: Path) -> tomlkit.TOMLDocument:
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise Refused(f"cannot read {path}: {exc}") from None
    import tomlkit
    import tomlkit.exceptions

    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise Refused(f"{path} is not valid TOML ({exc}): fix it first") from None


def file_pools(doc: tomlkit.TOMLDocument, path: Path) -> list[str]:
    """The pools the config file names (the file alone: flags and environment aside)."""
    value = doc.get("pools")
    if value is None:
        return []
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return [str(p) for p in value]
    raise Refused(f"{path}: pools is not a list of pool ids; fix it by hand")


def set_pools(doc: tomlkit.TOMLDocument, new: list[str]) -> None:
    """Change ``pools`` in place: an array keeps its layout and comments, a comma-separated
    string stays one, a missing key is added at the top level."""
    value = doc.get("pools")
    if isinstance(value, list):
        for pool in [p for p in value if p not in new]:
            value.remove(pool)
        for pool in new:
            if pool not in value:
                value.append(pool)
    elif isinstance(value, str):
        doc["pools"] = ", ".join(new)
    else:
        doc["pools"] = new


def set_key(doc: tomlkit.TOMLDocument, key: str, value: Any) -> None:
    """Set a top-level key (a comment on its line stays), or remove it when ``value`` is None."""
    if value is None:
        if key in doc:
            del doc[key]
        return
    doc[key] = value


def check_pool(pool: str) -> None:
    if not POOL_ID.match(pool):
        raise Refused(f"{pool!r} is not a valid pool id (letters, digits, . _ : -; up to 128)")


def change_pools(
    path: Path, change: Callable[[list[str]], list[str]], validate: Validate
) -> tuple[bool, list[str]]:
    """Apply ``change`` to the file's pools; (whether the file changed, the pools now)."""
    doc = parse(path)
    current = file_pools(doc, path)
    new = change(current)
    if new == current:
        return False, current
    set_pools(doc, new)
    write(path, doc, validate)
    return True, new


def write(path: Path, doc: tomlkit.TOMLDocument, validate: Validate) -> None:
    import tomlkit

    replace(path, tomlkit.dumps(doc), validate)


def replace(path: Path, text: str, validate: Validate) -> None:
    """Write ``text`` over ``path`` atomically, keeping its mode and owner, only if ``validate``
    (the loader ``work`` uses) accepts the new file, checked before the rename."""
    target = path.resolve() if path.exists() else path
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise Refused(f"{path} not changed: cannot write in {target.parent}: {_why(exc)}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if old is not None:
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
            if os.geteuid() == 0:
                os.chown(tmp, old.st_uid, old.st_gid)
        else:
            os.chmod(tmp, 0o644)
        try:
            validate(tmp)
        except ConfigError as exc:
            reason = str(exc).replace(str(tmp), str(path))
            raise Refused(
                f"{path} not changed: flashnode work would refuse the result ({reason})"
            ) from None
        os.replace(tmp, target)
    except OSError as exc:
        raise Refused(f"{path} not changed: {_why(exc)}") from None
    finally:
        with contextlib.suppress(OSError):  # never made (a directory this user cannot write)
            tmp.unlink()


def _why(exc: OSError) -> str:
    if isinstance(exc, PermissionError) and os.geteuid() != 0:
        return "permission denied; run it with sudo"
    return exc.strerror or str(exc)
