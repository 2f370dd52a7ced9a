"""The one frozen Settings object, and how it is loaded.

Precedence, per key: command-line flag > ``FLASHNODE_<KEY>`` environment variable > key in the
TOML config file (``--config FILE``, else ``/etc/flashnode/flashnode.toml`` when present) > default.
Secrets (the bearer token, the join code) are never flags: they come from a file named by
``token_file``/``join_code_file`` or from ``FLASHNODE_TOKEN``/``FLASHNODE_JOIN_CODE``.

Why one module of this size: every setting with its validation, its loading and errors worded for
the owner.
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
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from flashnode.config.lent import lent_problem
from flashnode.config.listen import parse_listen
from flashnode.config.schedule import parse_window
from flashnode.errors import ConfigError

DEFAULT_CONFIG_FILE = Path("/etc/flashnode/flashnode.toml")
ENV_PREFIX = "FLASHNODE_"
POOL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MiB = 1024 * 1024
UI_DEFAULT_LISTEN = "127.0.0.1:7469"  # the console's port: ours, registered to nothing common
# systemd's LoadCredential=ID:DIRECTORY names each file of DIRECTORY "ID_<file name>".
CREDENTIAL_ID = "flashnode"

Runner = Literal["trusted", "docker"]

# Sizes: K, M, G, T (and KiB … TiB) count in 1024s, KB, MB, GB, TB in 1000s, B or nothing bytes.
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(I?B?)$", re.IGNORECASE)
_SIZE_HINT = "a size in bytes, or with a unit: 512M, 8G, 1.5GiB"


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like ``8G``, ``512M``, ``1.5GiB``, ``2GB``; ValueError else."""
    if isinstance(value, bool):
        raise ValueError(f"must be {_SIZE_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be {_SIZE_HINT}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    m = _SIZE.match(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"must be {_SIZE_HINT}")
    unit, suffix = m[2].upper(), m[3].upper()
    if not unit and suffix in ("", "B") and "." not in m[1]:
        factor = 1
    elif unit and suffix in ("", "IB"):
        factor = 1024 ** ("KMGTP".index(unit) + 1)
    elif unit and suffix == "B":
        factor = 1000 ** ("KMGTP".index(unit) + 1)
    else:
        raise ValueError(f"must be {_SIZE_HINT}")
    number = float(m[1]) if "." in m[1] else int(m[1])  # exact for whole numbers
    return int(number * factor)


def format_size(size: int) -> str:
    """``4 MiB``, ``1 GiB``, ``17.7 GiB``, ``512 bytes``: for messages, in the largest unit the
    size reaches (exact when it is a whole number of it, else to a tenth)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return (
                f"{size // factor} {unit}" if size % factor == 0 else f"{size / factor:.1f} {unit}"
            )
    return f"{size} bytes"


def normalise_url(value: str) -> str:
    """A coordinator URL with its scheme and port explicit: ``https://host:443[/path]``.

    Raises ValueError, in the owner's words, for anything that is not an http(s) URL.
    """
    text = value.strip()
    if "://" not in text:
        raise ValueError(
            f"{value!r} is not a URL: write it with its scheme, e.g. https://{text or 'host'}"
        )
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r} is not a URL (bad port)") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{value!r} must not carry credentials, a query or a fragment")
    host = parts.hostname.lower().rstrip(".")
    if ":" in host:
        host = f"[{host}]"
    port = port or (443 if scheme == "https" else 80)
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def default_credentials_dir() -> Path:
    """``/etc/flashnode/credentials`` as root, else ``$XDG_CONFIG_HOME/flashnode/credentials``."""
    if os.geteuid() == 0:
        return Path("/etc/flashnode/credentials")
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "flashnode" / "credentials"


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")  # one machine: one coordinator identity


def credentials_name(coordinator: str) -> str:
    """The stem of the files ``flashnode login`` keeps a coordinator's secrets in: host_port."""
    return credentials_names(coordinator)[0]


def credentials_names(coordinator: str) -> list[str]:
    """Every stem under which a coordinator's secrets may be stored, its own first: the
    coordinator is one by identity (scheme's default port made explicit, the host's case and a
    trailing dot dropped), so ``http://localhost:27820`` and ``http://127.0.0.1:27820`` (and
    ``[::1]``) name the same one. Names that resolve elsewhere (DNS) are never taken as one:
    secrets go only where the owner's own words send them."""
    parts = urlsplit(normalise_url(coordinator))
    host, port = parts.hostname or "", parts.port

    def stem(name: str) -> str:
        return f"{re.sub(r'[^A-Za-z0-9.-]', '_', name)}_{port}"

    names = [stem(host)]
    if host in LOOPBACK_NAMES:
        names += [stem(h) for h in LOOPBACK_NAMES if h != host]
    return names


def credentials_file(coordinator: str, directory: Path, kind: str = "token") -> Path:
    """The file ``flashnode login`` keeps a coordinator's token (or ``join-code``) in."""
    return directory / f"{credentials_name(coordinator)}.{kind}"


def stored_credential(
    coordinator: str, kind: str, directory: Path, env: Mapping[str, str]
) -> Path | None:
    """Where a stored token or join code for ``coordinator`` is, or None.

    Under systemd the unit hands the credentials in with ``LoadCredential=`` and the agent reads
    them from ``$CREDENTIALS_DIRECTORY`` first; then from ``directory`` (what login wrote).
    """
    candidates = []
    loaded = env.get("CREDENTIALS_DIRECTORY")
    for stem in credentials_names(coordinator):  # its own name first, then its aliases
        name = f"{stem}.{kind}"
        if loaded:
            candidates += [Path(loaded) / f"{CREDENTIAL_ID}_{name}", Path(loaded) / name]
        candidates.append(directory / name)
    return next((p for p in candidates if _exists(p)), None)


def _exists(path: Path) -> bool:
    """False also where this user may not look (root's credentials, read by another user's
    owner command, which needs no secret)."""
    try:
        return path.exists()
    except PermissionError:
        return False


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$STATE_DIRECTORY`` (systemd's ``StateDirectory=``) when set; else ``/var/lib/flashnode``
    as root, else ``$XDG_STATE_HOME/flashnode`` (~/.local/state)."""
    env = os.environ if env is None else env
    given = env.get("STATE_DIRECTORY", "").split(":")[0]
    if given.startswith("/"):
        return Path(given)
    if os.geteuid() == 0:
        return Path("/var/lib/flashnode")
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "flashnode"


def is_loopback(host: str) -> bool:
    """Whether a URL's host is this machine (plain http is allowed only there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    claim_backoff_max_seconds: float = Field(default=8.0, gt=0)
    claim_alert_seconds: float = Field(default=15.0, ge=0)  # after work, claim about every second
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
    # Everything a task can write (out/, tmp/, its private /tmp, /var/tmp, /dev/shm, /run/lock;
    # a container's /tmp), measured while it runs: past it the task is stopped and fails.
    task_disk_bytes: int = Field(default=16 * 1024 * MiB, ge=MiB)
    # The files and directories (inodes) a task may hold under out/ and tmp/: an empty file
    # costs task_disk_bytes nothing, and a disk out of inodes is as full as one out of bytes.
    task_disk_files: int = Field(default=1_000_000, ge=1000)
    log_max_bytes: int = Field(default=8 * MiB, ge=0)
    keep_logs: int = Field(default=20, ge=0)  # ended attempts whose output stays on the node
    max_output_file_bytes: int = Field(default=256 * MiB, ge=1)
    max_output_total_bytes: int = Field(default=4096 * MiB, ge=1)
    max_output_files: int = Field(default=5000, ge=1)
    max_input_bytes: int = Field(default=4096 * MiB, ge=1)

    token: SecretStr | None = None
    join_code: SecretStr | None = None

    @field_validator("coordinator")
    @classmethod
    def _coordinator_url(cls, value: str) -> str:
        return normalise_url(value)

    @field_validator("slots", mode="before")
    @classmethod
    def _slots(cls, value: Any) -> Any:
        text = value.strip().lower() if isinstance(value, str) else value
        if text == "auto":
            return "auto"
        if isinstance(text, str) and re.fullmatch(r"[+-]?[0-9]+", text):
            text = int(text)
        if isinstance(text, int) and not isinstance(text, bool) and text >= 1:
            return text
        raise ValueError('must be a whole number of at least 1, or "auto"')

    @field_validator("*", mode="before")
    @classmethod
    def _size(cls, value: Any, info: ValidationInfo) -> Any:
        """Every ``*_bytes`` key takes a unit ("64M"), in the file and the environment alike."""
        if value is None or not (info.field_name or "").endswith("_bytes"):
            return value
        return parse_size(value)

    @field_validator("allowed_images")
    @classmethod
    def _pinned_images(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Every image that is not pinned, at once (fixed in one go, not one per start)."""
        unpinned: list[str] = []
        example = ""
        for image in value:
            if "@sha256:" in image:
                continue
            name, _, tag = image.rpartition(":")
            if not name or "/" in tag:
                unpinned.append(f"{image!r} has no tag")
                example = example or image
            elif tag == "latest":
                unpinned.append(f"{image!r} is not pinned")
                example = example or name
        if unpinned:
            raise ValueError(
                f"{', '.join(unpinned)}: pin a tag or a digest for each, e.g. {example}:1.2"
            )
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
        "claim_alert_seconds",
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
        return is_loopback(urlsplit(self.coordinator).hostname or "")

    @property
    def unsandboxed_argv_capable(self) -> bool:
        """The trusted opt-in counts only together with at least one pool (pool-only work)."""
        return self.runner == "trusted" and bool(self.pools)

    # --- job environments (flashnode.caches.envcache) -------------------------------------------
    # Trusted tasks' dependencies, built with uv under <state_dir>/envs/ (a root agent builds as
    # procs.BUILD_USER), evicted least recently used beyond env_cache_bytes, which also bounds
    # what one build may write. Binary wheels only unless allow_source_builds; the job's Python
    # must be on the machine unless allow_python_downloads.
    env_cache_bytes: int = Field(default=4096 * MiB, ge=0)
    allow_python_downloads: bool = False
    allow_source_builds: bool = False
    env_build_timeout_seconds: float = Field(default=900.0, gt=0)
    env_negative_seconds: float = Field(default=600.0, ge=0)  # a failed build is remembered
    # env_allow_private_indexes: package indexes, find-links pages and direct references a job's
    #   lines name at addresses that are not public (datasets.OriginPolicy, as for dataset
    #   origins): true (all but link-local), or the networks allowed; false: public only.
    env_allow_private_indexes: bool | tuple[str, ...] = False

    @field_validator("env_build_timeout_seconds", "env_negative_seconds")
    @classmethod
    def _env_finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    # --- data: dataset slices fetched into a cache; local datasets lent by label ----
    # dataset_cache_bytes: disk the dataset cache (<state_dir>/data) may use, advertised as
    #   capabilities.dataset_cache_bytes. The coordinator places a task with `datasets` only
    #   where the sum of its entries' sizes fits; 0 (the default) advertises "no dataset work".
    # dataset_ca_file: a PEM bundle that replaces the default trust store for dataset origins.
    # dataset_fetch_timeout_seconds: the most one entry's fetch may take, retries included.
    # dataset_allow_private_origins: origins at addresses that are not public (datasets.
    #   OriginPolicy): true (all but link-local), or the networks allowed; false: public only.
    # local_data: the [local_data] table, label = "/absolute/dir"; advertised as local_datasets
    #   (labels only, never paths); env FLASHNODE_LOCAL_DATA="label=/dir,label2=/dir2".
    dataset_cache_bytes: int = Field(default=0, ge=0)
    dataset_ca_file: Path | None = None
    dataset_fetch_timeout_seconds: float = Field(default=3600.0, gt=0)
    dataset_allow_private_origins: bool | tuple[str, ...] = False
    local_data: dict[str, Path] = Field(default_factory=dict)

    @field_validator("dataset_fetch_timeout_seconds")
    @classmethod
    def _finite_fetch(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("dataset_allow_private_origins", "env_allow_private_indexes", mode="before")
    @classmethod
    def _private_origins(cls, value: Any) -> Any:
        if isinstance(value, str):
            word = value.strip().lower()
            if word in ("true", "yes", "on", "1", "false", "no", "off", "0"):
                return word in ("true", "yes", "on", "1")
            return tuple(n.strip() for n in value.split(",") if n.strip())
        return value

    @field_validator("dataset_allow_private_origins", "env_allow_private_indexes")
    @classmethod
    def _networks(cls, value: bool | tuple[str, ...]) -> bool | tuple[str, ...]:
        if isinstance(value, bool):
            return value
        networks = []
        for text in value:
            try:
                networks.append(str(ipaddress.ip_network(text, strict=False)))
            except ValueError:
                raise ValueError(
                    f"{text!r} is not a network: true, false, or networks such as"
                    ' ["192.168.1.0/24", "10.0.0.5"]'
                ) from None
        return tuple(networks)

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

    # --- owner controls and metrics (README "Owner controls") ----------------------------------
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
    # task_cpu_percent: all tasks together use at most this share of the machine's CPUs
    #   (trusted: the quota of the tasks' parent cgroup, live on reload; docker: each container
    #   its slot's share). max_suspend_seconds: a task suspended longer lets its lease lapse
    #   (not the task's fault); None: the lease's own window (lease_seconds).
    task_cpu_percent: float | None = Field(default=None, gt=0, le=100)
    max_suspend_seconds: float | None = Field(default=None, gt=0, le=7 * 86400)
    # The black-hole guard (guard.py): after quarantine_after attempts in a row that ended
    #   through this node's fault (or failed fast with one reason across jobs) the node stops
    #   claiming and runs its own checks every quarantine_check_seconds; 0 turns it off.
    quarantine_after: int = Field(default=5, ge=0)
    quarantine_check_seconds: float = Field(default=300.0, gt=0, le=86400)
    # --- the owner's console (README "The console") ------------------------------------------
    # ui_listen: where the agent serves the console (HOST:PORT); "" or "off": not served.
    # ui_allow_remote: allow ui_listen on an address that is not loopback.
    ui_listen: str | None = UI_DEFAULT_LISTEN
    ui_allow_remote: bool = False

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

    @field_validator("ui_listen", mode="before")
    @classmethod
    def _ui_listen(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "off"):
            return None
        if isinstance(value, str):
            if parse_listen(value.strip()).path is not None:
                raise ValueError("the console is served on HOST:PORT, not on a unix socket")
            return value.strip()
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, value: str | None) -> str | None:
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
        metrics, ui = self.metrics_listen, self.ui_listen
        if metrics is not None and not self.metrics_allow_remote and not _loopback(metrics):
            raise ValueError(
                f"metrics_listen {self.metrics_listen!r} is not a loopback address or a unix"
                " socket: set metrics_allow_remote = true to serve metrics to the network"
            )
        if ui is not None and not self.ui_allow_remote and not _loopback(ui):
            raise ValueError(
                f"ui_listen {self.ui_listen!r} is not a loopback address: set"
                " ui_allow_remote = true to serve the console to the network"
            )
        return self

    @property
    def windows_tzinfo(self) -> tzinfo | None:
        """The time zone of run_windows; None: the system's local time."""
        return _zone(self.run_windows_timezone) if self.run_windows_timezone else None

    # --- checkpoints (README "Checkpoints") ------------------------------------------------------
    # checkpoint_scan_seconds: how often the relay looks in a running task's out/ckpt/ for a new
    #   checkpoint to ship.
    # max_checkpoint_bytes: the most one checkpoint (all its files) may hold: a larger one is not
    #   shipped, and a resume point larger than this is not fetched (the attempt starts afresh).
    checkpoint_scan_seconds: float = Field(default=2.0, gt=0, le=300)
    max_checkpoint_bytes: int = Field(default=4096 * MiB, ge=1)


def _loopback(listen: str) -> bool:
    return parse_listen(listen).loopback


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

    ``flags`` holds only the options given on the command line (by key). ``config_file`` None
    means the default file if it exists. Raises ConfigError with a one-line reason in the owner's
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
        raise ConfigError(f"coordinator ({origin.get('coordinator', '')}): {exc}") from None
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
        raise ConfigError(_explain(exc, merged, origin)) from None
    _check_consistency(settings, origin)
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
_TABLE_LINE = re.compile(r"^\s*\[+\s*([A-Za-z0-9_-]+)")


def key_lines(path: Path) -> dict[str, int]:
    """The line each top-level key of a TOML file is set on (a table's: its header), so that an
    error names the line to correct; best effort (what it cannot tell, it leaves out)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, int] = {}
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        table = _TABLE_LINE.match(line)
        if table:
            in_table = True
            found.setdefault(table[1], number)
            continue
        key = _KEY_LINE.match(line)
        if key and not in_table:
            found.setdefault(next(k for k in key.groups() if k), number)
    return found


def read_config_file(path: Path) -> dict[str, Any]:
    # here, not at the top: an agent without a config file need not load a TOML parser
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(SETTABLE))
    if unknown:
        key = unknown[0]
        import difflib  # here, not at the top: only a misspelt key needs it

        close = difflib.get_close_matches(key, SETTABLE, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else " (see README: Configuration)"
        more = f"; also unknown: {', '.join(unknown[1:])}" if unknown[1:] else ""
        if key in ("token", "join_code"):
            hint = f" (secrets never go in the config file: use {key}_file or flashnode login)"
        raise ConfigError(f"config file {path}: unknown key {key!r}{hint}{more}")
    return data


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


def read_secret_file(path: Path, what: str) -> str:
    """Read a secret from a file only this user can read; refuse one that others can."""
    try:
        st = path.stat()
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
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


def _check_consistency(settings: Settings, origin: Mapping[str, str]) -> None:
    """Settings that are refused together; each is named as it was set, with where (the file
    and line, the variable or the flag), never as a flag it did not come from."""

    def named(key: str) -> str:
        where = f" ({origin[key]})" if key in origin else ""
        return f"{key} = {getattr(settings, key)!r}{where}"

    if settings.runner == "trusted" and not settings.pools:
        raise ConfigError(
            f"{named('runner')} needs at least one pool: set pools (in the config file,"
            " FLASHNODE_POOLS or --pool); arbitrary code on this host is pool-only"
        )
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
    if settings.claim_backoff_min_seconds > settings.claim_backoff_max_seconds:
        raise ConfigError(
            f"{named('claim_backoff_min_seconds')} is larger than"
            f" {named('claim_backoff_max_seconds')}"
        )


# --- errors in the owner's words ---------------------------------------------------------------

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


def _explain(exc: ValidationError, merged: Mapping[str, Any], origin: Mapping[str, str]) -> str:
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
