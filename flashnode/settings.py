"""The one frozen Settings object, and how it is loaded.

Precedence, per key: command-line flag > ``FLASHNODE_<KEY>`` environment variable > key in the
TOML config file (``--config FILE``, else ``/etc/flashnode/flashnode.toml`` when present) > default.
Secrets (the bearer token, the join code) are never flags: they come from a file named by
``token_file``/``join_code_file`` or from ``FLASHNODE_TOKEN``/``FLASHNODE_JOIN_CODE``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from flashnode.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEFAULT_CONFIG_FILE = Path("/etc/flashnode/flashnode.toml")
ENV_PREFIX = "FLASHNODE_"
POOL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MiB = 1024 * 1024

Runner = Literal["trusted", "docker"]


def default_credentials_dir() -> Path:
    """``/etc/flashnode/credentials`` as root, else ``$XDG_CONFIG_HOME/flashnode/credentials``."""
    if os.geteuid() == 0:
        return Path("/etc/flashnode/credentials")
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "flashnode" / "credentials"


def credentials_file(coordinator: str, directory: Path) -> Path:
    """The file ``flashnode login`` keeps a coordinator's token in."""
    parts = urlsplit(coordinator.rstrip("/"))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = re.sub(r"[^A-Za-z0-9.-]", "_", parts.hostname or "coordinator")
    return directory / f"{host}_{port}.token"


def default_state_dir() -> Path:
    """``/var/lib/flashnode`` as root, else ``$XDG_STATE_HOME/flashnode`` (~/.local/state)."""
    if os.geteuid() == 0:
        return Path("/var/lib/flashnode")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "flashnode"


class Settings(BaseModel):
    """Everything the agent is configured with. Frozen: a reload builds a new one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: str
    runner: Runner = "docker"
    pools: tuple[str, ...] = ()
    state_dir: Path = Field(default_factory=default_state_dir)
    node_id: str | None = None
    token_file: Path | None = None
    credentials_dir: Path = Field(default_factory=default_credentials_dir)
    join_code_file: Path | None = None
    max_tasks: int | None = Field(default=None, ge=1)
    log_json: bool = False
    allow_insecure_http: bool = False

    heartbeat_seconds: float = Field(default=5.0, gt=0, le=60)
    claim_backoff_min_seconds: float = Field(default=0.5, gt=0)
    claim_backoff_max_seconds: float = Field(default=7.0, gt=0)
    error_backoff_max_seconds: float = Field(default=60.0, gt=0)
    max_task_seconds: float = Field(default=24 * 3600.0, gt=0)
    kill_grace_seconds: float = Field(default=10.0, ge=0)
    drain_seconds: float = Field(default=300.0, ge=0)
    allowed_images: tuple[str, ...] = ()
    pull_images: bool = False
    container_user: str | None = None
    docker_host: str = "unix:///var/run/docker.sock"
    container_tmp_bytes: int = Field(default=256 * MiB, ge=MiB)
    slots: int | Literal["auto"] = 1
    sample_seconds: float = Field(default=1.0, ge=0.05)
    nvml_library: str | None = None
    min_free_bytes: int = Field(default=1024 * MiB, ge=0)
    task_user: str | None = None
    task_python: str | None = None
    task_memory_bytes: int | None = Field(default=None, ge=4 * MiB)
    task_cpus: float | None = Field(default=None, gt=0)
    task_pids: int | None = Field(default=4096, ge=8)
    log_max_bytes: int = Field(default=8 * MiB, ge=0)
    max_output_file_bytes: int = Field(default=256 * MiB, ge=1)
    max_output_total_bytes: int = Field(default=4096 * MiB, ge=1)
    max_input_bytes: int = Field(default=4096 * MiB, ge=1)

    token: SecretStr | None = None
    join_code: SecretStr | None = None

    @field_validator("coordinator")
    @classmethod
    def _coordinator_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError("must not carry credentials, a query or a fragment")
        return value.rstrip("/")

    @field_validator("slots", mode="before")
    @classmethod
    def _slots(cls, value: Any) -> Any:
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("must be at least 1, or auto")
        return value

    @field_validator("pools", "allowed_images", mode="before")
    @classmethod
    def _split_pools(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("pools")
    @classmethod
    def _pool_ids(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pool in value:
            if not POOL_ID.match(pool):
                raise ValueError(f"{pool!r} is not a valid pool id")
        return tuple(dict.fromkeys(value))

    @field_validator(
        "heartbeat_seconds",
        "claim_backoff_min_seconds",
        "claim_backoff_max_seconds",
        "error_backoff_max_seconds",
        "max_task_seconds",
        "kill_grace_seconds",
        "drain_seconds",
    )
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @property
    def coordinator_is_loopback(self) -> bool:
        host = urlsplit(self.coordinator).hostname or ""
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    @property
    def unsandboxed_argv_capable(self) -> bool:
        """The trusted opt-in counts only together with at least one pool (pool-only work)."""
        return self.runner == "trusted" and bool(self.pools)

    # --- job environments (issue 17, flashnode.envcache) -----------------------------------------
    # Trusted tasks' dependencies, built with uv under <state_dir>/envs/, evicted least recently
    # used beyond env_cache_bytes. Binary wheels only unless allow_source_builds (then the build
    # runs as task_user); the job's Python must be on the machine unless allow_python_downloads.
    env_cache_bytes: int = Field(default=4096 * MiB, ge=0)
    allow_python_downloads: bool = False
    allow_source_builds: bool = False
    env_build_timeout_seconds: float = Field(default=900.0, gt=0)
    env_negative_seconds: float = Field(default=600.0, ge=0)  # a failed build is remembered

    @field_validator("env_build_timeout_seconds", "env_negative_seconds")
    @classmethod
    def _env_finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


# Keys that are settable; secrets are loaded separately and never from flags or the config file.
SETTABLE = tuple(k for k in Settings.model_fields if k not in ("token", "join_code"))


def load(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
) -> Settings:
    """Build Settings from explicit flags, the environment and the config file.

    ``flags`` holds only the options given on the command line. ``config_file`` None means the
    default file if it exists. Raises ConfigError with a one-line reason.
    """
    merged: dict[str, Any] = {}
    path = config_file
    if path is None and DEFAULT_CONFIG_FILE.exists():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        merged.update(read_config_file(path))
    for key in SETTABLE:
        raw = env.get(ENV_PREFIX + key.upper())
        if raw is not None and raw != "":
            merged[key] = raw
    merged.update({k: v for k, v in flags.items() if v is not None})

    merged["token"] = _secret(merged.get("token_file"), env.get(ENV_PREFIX + "TOKEN"), "token")
    if merged["token"] is None and "coordinator" in merged:
        # What `flashnode login` stored for this coordinator, if anything.
        directory = Path(merged.get("credentials_dir") or default_credentials_dir())
        try:
            stored = credentials_file(str(merged["coordinator"]), directory)
        except ValueError:
            stored = None
        if stored is not None and stored.exists():
            merged["token"] = SecretStr(read_secret_file(stored, "credentials"))
    merged["join_code"] = _secret(
        merged.get("join_code_file"), env.get(ENV_PREFIX + "JOIN_CODE"), "join code"
    )
    if "coordinator" not in merged:
        raise ConfigError(
            "no coordinator: set --coordinator, FLASHNODE_COORDINATOR or 'coordinator'"
        )
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    _check_consistency(settings)
    return settings


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(SETTABLE))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}")
    return data


def _secret(file: Any, env_value: str | None, what: str) -> SecretStr | None:
    if file is not None:
        return SecretStr(read_secret_file(Path(file), what))
    if env_value:
        return SecretStr(env_value.strip())
    return None


def read_secret_file(path: Path, what: str) -> str:
    """Read a secret from a file only this user can read; refuse one that others can."""
    try:
        st = path.stat()
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} file {path} is not UTF-8 text") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{what} file {path} is accessible to other users"
            f" (mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
        )
    if not value:
        raise ConfigError(f"{what} file {path} is empty")
    return value


def _check_consistency(settings: Settings) -> None:
    if settings.runner == "trusted" and not settings.pools:
        raise ConfigError(
            "--runner trusted needs at least one --pool: arbitrary code on this host is pool-only"
        )
    if (
        urlsplit(settings.coordinator).scheme == "http"
        and not settings.coordinator_is_loopback
        and not settings.allow_insecure_http
    ):
        raise ConfigError(
            f"refusing plain http to {settings.coordinator}: use https, or set allow_insecure_http"
        )
    if settings.container_user is not None and not re.match(
        r"^[1-9][0-9]*:[0-9]+$", settings.container_user
    ):
        raise ConfigError("container_user must be uid:gid of a non-root user, e.g. 65534:65534")
    if settings.claim_backoff_min_seconds > settings.claim_backoff_max_seconds:
        raise ConfigError("claim_backoff_min_seconds is larger than claim_backoff_max_seconds")


def _one_line(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "settings"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"invalid setting {where}: {first['msg']}{more}"
