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
import ssl
import stat
import sys
from collections.abc import Mapping
from datetime import tzinfo
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from flashnode.errors import ConfigError
from flashnode.localdata import lent_problem

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
    task_user: str | None = None  # slot N runs as "<task_user>-N" (agent as root)
    allow_same_user: bool = False  # a non-root agent may run trusted tasks as itself
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

    # --- data (issue 18): dataset slices fetched into a cache; local datasets lent by label ----
    # dataset_cache_bytes: disk the dataset cache (<state_dir>/data) may use, advertised as
    #   capabilities.dataset_cache_bytes. The coordinator places a task with `datasets` only
    #   where the sum of its entries' sizes fits; 0 (the default) advertises "no dataset work".
    # dataset_ca_file: a PEM bundle that replaces the default trust store for dataset origins.
    # dataset_fetch_timeout_seconds: the most one entry's fetch may take, retries included.
    # local_data: the [local_data] table, label = "/absolute/dir"; advertised as local_datasets
    #   (labels only, never paths); env FLASHNODE_LOCAL_DATA="label=/dir,label2=/dir2".
    dataset_cache_bytes: int = Field(default=0, ge=0)
    dataset_ca_file: Path | None = None
    dataset_fetch_timeout_seconds: float = Field(default=3600.0, gt=0)
    local_data: dict[str, Path] = Field(default_factory=dict)

    @field_validator("dataset_cache_bytes", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a number of bytes")
        return value

    @field_validator("dataset_fetch_timeout_seconds")
    @classmethod
    def _finite_fetch(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("dataset_ca_file")
    @classmethod
    def _ca_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                ssl.create_default_context(cafile=str(value))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"{value} is not a readable PEM CA bundle ({exc})") from None
        return value

    @field_validator("local_data", mode="before")
    @classmethod
    def _split_local_data(cls, value: Any) -> Any:
        if isinstance(value, str):
            pairs = [p.strip() for p in value.split(",") if p.strip()]
            if not all("=" in p for p in pairs):
                raise ValueError("must be label=/path pairs separated by commas")
            return {k.strip(): v.strip() for k, v in (p.split("=", 1) for p in pairs)}
        return value

    @field_validator("local_data")
    @classmethod
    def _lent_dirs(cls, value: dict[str, Path]) -> dict[str, Path]:
        for label, path in value.items():
            problem = lent_problem(label, path)
            if problem:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _lends_no_secrets(self) -> Settings:
        """A lent directory must not hold the agent's state or credentials."""
        private = [self.state_dir, self.credentials_dir, self.token_file, self.join_code_file]
        for label, path in self.local_data.items():
            lent = path.resolve()
            for p in private:
                if p is not None and p.resolve().is_relative_to(lent):
                    raise ValueError(f"local_data {label} ({path}) would lend {p}")
        return self

    # --- owner controls and metrics (issue 19; README "Owner controls") ------------------------
    # Rules that hold claiming (and, named in suspend_when, suspend running tasks): see
    # controls.py. Metrics: an opt-in Prometheus endpoint, loopback only unless allowed.
    run_windows: tuple[str, ...] = ()
    run_windows_timezone: str | None = None
    hold_on_battery: bool = False
    hold_when_active: bool = False
    active_idle_seconds: float = Field(default=300.0, gt=0, le=86400)
    hold_above_load_percent: float | None = Field(default=None, gt=0, lt=100)
    hold_clear_seconds: float = Field(default=60.0, ge=0, le=3600)
    suspend_when: tuple[Literal["window", "battery", "active", "load"], ...] = ()
    metrics_listen: str | None = None
    metrics_allow_remote: bool = False

    @field_validator("run_windows", mode="before")
    @classmethod
    def _split_windows(cls, value: Any) -> Any:
        # A day list has commas ("Mon,Wed 09:00-17:00"), so the environment separates with ";".
        if isinstance(value, str):
            return tuple(w.strip() for w in value.split(";") if w.strip())
        return value

    @field_validator("run_windows")
    @classmethod
    def _windows(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from flashnode.controls import parse_window

        for window in value:
            parse_window(window)
        return value

    @field_validator("run_windows_timezone")
    @classmethod
    def _timezone(cls, value: str | None) -> str | None:
        if value is not None:
            _zone(value)
        return value

    @field_validator("suspend_when", mode="before")
    @classmethod
    def _split_suspend(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("suspend_when")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(value))

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, value: str | None) -> str | None:
        from flashnode.metrics import parse_listen

        if value is not None:
            parse_listen(value)
        return value

    @model_validator(mode="after")
    def _owner_controls(self) -> Settings:
        enabled = {
            "window": bool(self.run_windows),
            "battery": self.hold_on_battery,
            "active": self.hold_when_active,
            "load": self.hold_above_load_percent is not None,
        }
        key = {
            "window": "run_windows",
            "battery": "hold_on_battery",
            "active": "hold_when_active",
            "load": "hold_above_load_percent",
        }
        for rule in self.suspend_when:
            if not enabled[rule]:
                raise ValueError(f"suspend_when names {rule!r} but {key[rule]} is not set")
        if self.metrics_listen is not None and not self.metrics_allow_remote:
            from flashnode.metrics import parse_listen

            if not parse_listen(self.metrics_listen).loopback:
                raise ValueError(
                    f"metrics_listen {self.metrics_listen!r} is not a loopback address or a unix"
                    " socket: set metrics_allow_remote = true to serve metrics to the network"
                )
        return self

    @property
    def windows_tzinfo(self) -> tzinfo | None:
        """The time zone of run_windows; None: the system's local time."""
        return _zone(self.run_windows_timezone) if self.run_windows_timezone else None

def _zone(name: str) -> tzinfo:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"{name!r} is not a known time zone (e.g. Europe/Berlin, UTC)") from None


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
