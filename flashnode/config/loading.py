"""Loading the Settings (``load``): the flags, the environment and the configuration file merged
by precedence, each value's origin kept (``gather``), the secrets read, and the settings that
are refused together; a refusal is one line in the owner's words (flashnode.config.explain).

Precedence, per key: command-line flag > ``FLASHNODE_<KEY>`` environment variable > key in the
TOML config file (``--config FILE``, else ``/etc/flashnode/flashnode.toml`` when present) > default.
Secrets (the bearer token, the join code) are never flags: they come from a file named by
``token_file``/``join_code_file`` or from ``FLASHNODE_TOKEN``/``FLASHNODE_JOIN_CODE``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import SecretStr, ValidationError

from flashnode.config.credentials import (
    default_credentials_dir,
    read_secret_file,
    stored_credential,
)
from flashnode.config.explain import explain, refused_setting
from flashnode.config.settings import (
    DEFAULT_CONFIG_FILE,
    ENV_PREFIX,
    RUNNER_TABLES,
    Settings,
    default_state_dir,
)
from flashnode.config.urls import normalise_url
from flashnode.errors import ConfigError

# Keys that are settable; secrets are loaded separately and never from flags or the config file.
# What a layer above asks of loaded settings: given them and how to name a setting with where it
# was set ("runner = 'trusted' (from --runner)"); raises ConfigError.
Check = Callable[[Settings, Callable[[str], str]], None]

SETTABLE = tuple(k for k in Settings.model_fields if k not in ("token", "join_code"))


def load(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
    check: Check | None = None,
) -> Settings:
    """Build Settings from explicit flags, the environment and the config file.

    ``flags`` holds only the options given on the command line (by key). ``config_file`` None
    means the default file if it exists. ``check``: what the layers above ask of the settings
    (the chosen runner's, ``runners.registry.load_settings``), given them and how to name a
    setting with where it was set. Raises ConfigError with a one-line reason in the owner's
    words: which setting, where it came from, what it was, and what is allowed.
    """
    merged, origin = gather(flags, env, config_file)
    if "coordinator" not in merged:
        raise ConfigError(
            "no coordinator: set --coordinator, FLASHNODE_COORDINATOR or 'coordinator'"
        )
    try:
        coordinator = normalise_url(str(merged["coordinator"]))
    except ValueError as exc:
        raise ConfigError(
            f"coordinator ({origin.get('coordinator', '')}): {exc}",
            "coordinator",
            origin.get("coordinator"),
        ) from None
    directory = Path(merged.get("credentials_dir") or default_credentials_dir())

    merged["token"] = _secret(
        merged.get("token_file"),
        env.get(ENV_PREFIX + "TOKEN"),
        "token",
        coordinator,
        directory,
        env,
    )
    merged["join_code"] = _secret(
        merged.get("join_code_file"),
        env.get(ENV_PREFIX + "JOIN_CODE"),
        "join code",
        coordinator,
        directory,
        env,
    )
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        key = refused_setting(exc)
        raise ConfigError(explain(exc, merged, origin), key, origin.get(key)) from None
    _check_consistency(settings, origin, check)
    return settings


def gather(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """Every setting as given, before any check (flag over environment over file, the state
    dir's default filled in), and where each came from. ConfigError for a file that cannot be
    read or a misspelt variable."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    path = config_file
    if path is None and DEFAULT_CONFIG_FILE.exists():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        lines = key_lines(path)
        for key, value in read_config_file(path).items():
            where = f"in {path}, line {lines[key]}" if key in lines else f"in {path}"
            merged[key], origin[key] = value, where
    _misspelt_env(env)
    for key in SETTABLE:
        raw = env.get(ENV_PREFIX + key.upper())
        if raw is not None and raw != "":
            merged[key], origin[key] = raw, f"from {ENV_PREFIX}{key.upper()}"
    for key, value in flags.items():
        if value is not None:
            merged[key], origin[key] = value, f"from --{key.replace('_', '-')}"
    if "state_dir" not in merged:
        merged["state_dir"] = default_state_dir(env)
    return merged, origin


def _misspelt_env(env: Mapping[str, str]) -> None:
    """A FLASHNODE_* variable that is no setting but nearly one is a typo the owner would
    otherwise never hear of: refuse it with the name it resembles."""
    names = [ENV_PREFIX + k.upper() for k in (*SETTABLE, "token", "join_code")]
    for name in env:
        if name.startswith(ENV_PREFIX) and name not in names:
            import difflib  # here, not at the top: only a misspelt name needs it

            close = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
            if close:
                raise ConfigError(f"{name} is not a setting (did you mean {close[0]}?)")


_KEY_LINE = re.compile(r"""^\s*(?:([A-Za-z0-9_-]+)|"([^"]+)"|'([^']+)')\s*=""")
_TABLE_LINE = re.compile(r"^\s*\[+\s*([A-Za-z0-9_-]+)(?:\s*\.\s*([A-Za-z0-9_-]+))?")


def key_lines(path: Path) -> dict[str, int]:
    """The line each setting of a TOML file is set on (at the top level or in a runner's table;
    another table's: its header), so that an error names the line to correct; best effort (what
    it cannot tell, it leaves out)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, int] = {}
    in_table = False  # a table whose keys are not settings of their own (``[local_data]``)
    for number, line in enumerate(text.splitlines(), 1):
        table = _TABLE_LINE.match(line)
        if table and table[2] and table[1] in RUNNER_TABLES:  # a runner's option as a table
            in_table = True  # ([docker.pool_runtimes]): its keys are not settings
            found.setdefault(table[2], number)
            continue
        if table:
            in_table = table[1] not in RUNNER_TABLES
            found.setdefault(table[1], number)
            continue
        key = _KEY_LINE.match(line)
        if key and not in_table:
            found.setdefault(next(k for k in key.groups() if k), number)
    return found


def _read_toml(path: Path) -> dict[str, Any]:
    # here, not at the top: an agent without a config file need not load a TOML parser
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's settings by name (a runner's table read into the settings it holds);
    ConfigError for a file that cannot be read, or a key that is no setting."""
    data = _runner_tables(_read_toml(path), path)
    unknown = sorted(set(data) - set(SETTABLE))
    if unknown:
        key = unknown[0]
        import difflib  # here, not at the top: only a misspelt key needs it

        close = difflib.get_close_matches(key, SETTABLE, n=1, cutoff=0.6)
        hint = (
            f" (did you mean {close[0]!r}?)"
            if close
            else " (every setting: the reference, docs/reference.md)"
        )
        more = f"; also unknown: {', '.join(unknown[1:])}" if unknown[1:] else ""
        if key in ("token", "join_code"):
            hint = f" (secrets never go in the config file: use {key}_file or flashnode login)"
        raise ConfigError(f"config file {path}: unknown key {key!r}{hint}{more}")
    return data


def _runner_tables(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The runners' tables (``[docker]``, ``[trusted]``: ``RUNNER_TABLES``) read into the
    settings they hold; such a setting at the top level still reads (the agent's start and the
    doctor warn of it: ``top_level_runner_keys``)."""
    flat = {k: v for k, v in data.items() if k not in RUNNER_TABLES}
    for table, keys in RUNNER_TABLES.items():
        given = data.get(table)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise ConfigError(f"config file {path}: {table} must be a table ([{table}])")
        for key, value in given.items():
            if key not in keys:
                raise ConfigError(f"config file {path}: {_not_in_table(key, table)}")
            if key in data:
                raise ConfigError(
                    f"config file {path}: {key} is set both in [{table}] and at the top level:"
                    " keep the one in the table"
                )
            flat[key] = value
    return flat


def _not_in_table(key: str, table: str) -> str:
    """Why ``key`` is refused in ``[table]``, and where it goes."""
    keys = RUNNER_TABLES[table]
    home = next((t for t, k in RUNNER_TABLES.items() if key in k), None)
    if home is not None:
        return f"{key} belongs in [{home}], not in [{table}]"
    if key in SETTABLE:
        return (
            f"{key} is not a [{table}] option: a setting of the whole agent goes above the first"
            " table (every key after a table's header belongs to it)"
        )
    import difflib  # here, not at the top: only a misspelt key needs it

    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"its keys: {', '.join(keys)}"
    return f"unknown key {key!r} in [{table}] ({hint})"


def top_level_runner_keys(path: Path) -> list[tuple[str, str]]:
    """A runner's options the file sets at the top level, with the table each belongs in: read
    for this release only (the doctor warns of each)."""
    try:
        data = _read_toml(path)
    except ConfigError:
        return []
    return [(k, t) for t, keys in RUNNER_TABLES.items() for k in keys if k in data]


def _secret(
    file: Any,
    env_value: str | None,
    what: str,
    coordinator: str,
    directory: Path,
    env: Mapping[str, str],
) -> SecretStr | None:
    """A secret from its file, else the environment, else what `flashnode login` stored."""
    if file is not None:
        return SecretStr(read_secret_file(Path(file), what))
    if env_value:
        return SecretStr(env_value.strip())
    kind = "token" if what == "token" else "join-code"
    stored = stored_credential(coordinator, kind, directory, env)
    if stored is not None:
        return SecretStr(read_secret_file(stored, f"stored {what}"))
    return None


def _check_consistency(
    settings: Settings, origin: Mapping[str, str], check: Check | None = None
) -> None:
    """Settings that are refused together; each is named as it was set, with where (the file
    and line, the variable or the flag), never as a flag it did not come from."""

    keys: list[str] = []  # the settings a refusal names, the first its ConfigError's

    def named(key: str) -> str:
        keys.append(key)
        where = f" ({origin[key]})" if key in origin else ""
        value = getattr(settings, key)
        if isinstance(value, Mapping):  # a table: as the owner wrote it, not a mappingproxy
            value = dict(value)
        return f"{key} = {value!r}{where}"

    try:
        _refuse_together(settings, named, check)
    except ConfigError as exc:
        if exc.setting is None and keys:
            exc.setting, exc.where = keys[0], origin.get(keys[0])
        raise


def _refuse_together(
    settings: Settings, named: Callable[[str], str], check: Check | None = None
) -> None:

    if (
        urlsplit(settings.coordinator).scheme == "http"
        and not settings.coordinator_is_loopback
        and not settings.allow_insecure_http
    ):
        raise ConfigError(
            f"{named('coordinator')}: refusing plain http to a host that is not this one:"
            " use https, or set allow_insecure_http = true"
        )
    if settings.container_user is not None and not re.match(
        r"^[1-9][0-9]*:[0-9]+$", settings.container_user
    ):
        raise ConfigError(
            f"{named('container_user')}: must be uid:gid of a non-root user, e.g. 65534:65534"
        )
    strays = [p for p in settings.pool_runtimes if p not in settings.pools]
    if strays:
        raise ConfigError(
            f"{named('pool_runtimes')}: {', '.join(strays)} {'is' if len(strays) == 1 else 'are'}"
            f" not among {named('pools')}: name only pools this node joins"
        )
    if settings.claim_backoff_min_seconds > settings.claim_backoff_max_seconds:
        raise ConfigError(
            f"{named('claim_backoff_min_seconds')} is larger than"
            f" {named('claim_backoff_max_seconds')}"
        )
    if check is not None:
        check(settings, named)
