"""The one frozen Settings object: every setting, its default and its validation. How it is
loaded is flashnode.config.loading.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import ssl
from collections.abc import Mapping
from datetime import tzinfo
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from flashnode.config.credentials import default_credentials_dir
from flashnode.config.lent import lent_problem
from flashnode.config.listen import parse_listen
from flashnode.config.schedule import parse_window
from flashnode.config.sizes import MiB, parse_size
from flashnode.config.urls import is_loopback, normalise_url

DEFAULT_CONFIG_FILE = Path("/etc/flashnode/flashnode.toml")
ENV_PREFIX = "FLASHNODE_"
POOL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
UI_DEFAULT_LISTEN = "127.0.0.1:7469"  # the console's port: ours, registered to nothing common

# A runner's name: which it is, and what it can do, is flashnode.runners.registry's to say.
RUNNER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A container engine's runtime name (docker's ``--runtime``: runc, runsc, nvidia, kata...).
RUNTIME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")
# Each runner's own options, in the config file's table named for it (``[docker]``); read at the
# top level too for one release, with a warning that names the table (config.loading).
RUNNER_TABLES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "docker": (
            "allowed_images",
            "pull_images",
            "container_user",
            "docker_host",
            "container_tmp_bytes",
            "container_runtime",
            "public_runtime",
            "pool_runtimes",
        ),
        "trusted": ("task_user", "allow_same_user", "task_python"),
    }
)


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


MIN_LIMIT_C = 50  # a temperature limit below this would hold every GPU or CPU at rest

# What a desktop runs on its GPU by itself (display servers, compositors, shells): not the
# owner's use of it (gpu_yield_ignore's default).
DESKTOP_GPU_PROGRAMS = (
    "Xorg",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
    "kwin_x11",
    "plasmashell",
    "mutter",
    "sway",
    "weston",
    "cinnamon",
    "compiz",
    "Hyprland",
    "mutter-x11-frames",
    "xfwm4",
    "picom",
    "marco",
    "budgie-wm",
    "wayfire",
    "labwc",
    "niri",
    "cosmic-comp",
    "gamescope",
    "sddm-greeter",
    "sddm-greeter-qt6",
    "lightdm-gtk-greeter",
)


class Settings(BaseModel):
    """Everything the agent is configured with. Frozen: a reload builds a new one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: str
    runner: str = "docker"
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
    # How long a running task waits for the agent to come back after it went (a restart, a
    # crash) before its supervisor ends it: well inside the leases the coordinator gives (60 s
    # and more), so that a returning agent still renews them.
    reattach_seconds: float = Field(default=30.0, ge=0, le=3600)
    allowed_images: tuple[str, ...] = ()
    pull_images: bool = False
    container_user: str | None = None
    docker_host: str = "unix:///var/run/docker.sock"
    container_tmp_bytes: int = Field(default=256 * MiB, ge=MiB)
    # The engine runtime a container task runs under (``runtime_for``): container_runtime for
    #   every task (None: the engine's default), public_runtime for work from no pool (None:
    #   container_runtime), pool_runtimes a pool's own (the [docker.pool_runtimes] table, pool =
    #   "runtime"; env FLASHNODE_POOL_RUNTIMES="pool=runtime,pool2=runtime").
    container_runtime: str | None = None
    public_runtime: str | None = None
    pool_runtimes: Mapping[str, str] = Field(default_factory=dict)
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

    @field_validator("runner")
    @classmethod
    def _runner_name(cls, value: str) -> str:
        if not RUNNER_NAME.match(value):
            raise ValueError("is not a runner's name")
        return value

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

    @field_validator("container_runtime", "public_runtime")
    @classmethod
    def _runtime_name(cls, value: str | None) -> str | None:
        if value is not None and not RUNTIME_NAME.match(value):
            raise ValueError(f"{value!r} is not a runtime's name (e.g. runc, runsc)")
        return value

    @field_validator("pool_runtimes", mode="before")
    @classmethod
    def _split_pool_runtimes(cls, value: Any) -> Any:
        if isinstance(value, str):
            pairs = [p.strip() for p in value.split(",") if p.strip()]
            if not all("=" in p for p in pairs):
                raise ValueError("must be pool=runtime pairs separated by commas")
            return {k.strip(): v.strip() for k, v in (p.split("=", 1) for p in pairs)}
        return value

    @field_validator("pool_runtimes")
    @classmethod
    def _pool_runtimes(cls, value: Mapping[str, str]) -> Mapping[str, str]:
        for pool, runtime in value.items():
            if not POOL_ID.match(pool):
                raise ValueError(f"{pool!r} is not a valid pool id")
            if not isinstance(runtime, str) or not RUNTIME_NAME.match(runtime):
                raise ValueError(f"{pool}: {runtime!r} is not a runtime's name (e.g. runc, runsc)")
        return MappingProxyType(dict(value))

    @field_serializer("pool_runtimes")
    def _pool_runtimes_out(self, value: Mapping[str, str]) -> dict[str, str]:
        return dict(value)

    def runtime_for(self, pool: str | None) -> str | None:
        """The engine runtime a container task of ``pool`` (None: work from no pool, the public
        queue) runs under: its pool's in ``pool_runtimes``, else ``public_runtime`` for work from
        no pool, else ``container_runtime``; None: the engine's default."""
        if pool is None:
            return self.public_runtime or self.container_runtime
        return self.pool_runtimes.get(pool, self.container_runtime)

    def runtimes(self) -> tuple[str, ...]:
        """Every runtime the settings name, once each, ``container_runtime`` first."""
        named = (self.container_runtime, self.public_runtime, *self.pool_runtimes.values())
        return tuple(dict.fromkeys(r for r in named if r is not None))

    @field_validator("pools", "allowed_images", "gpu_yield_ignore", mode="before")
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
        "reattach_seconds",
    )
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @property
    def coordinator_is_loopback(self) -> bool:
        return is_loopback(urlsplit(self.coordinator).hostname or "")

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
    # Read-only once validated, as everything else here: an attempt's snapshot cannot change.
    local_data: Mapping[str, Path] = Field(default_factory=dict)

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
    def _lent_dirs(cls, value: Mapping[str, Path]) -> Mapping[str, Path]:
        for label, path in value.items():
            problem = lent_problem(label, path)
            if problem:
                raise ValueError(problem)
        return MappingProxyType(dict(value))

    @field_serializer("local_data")
    def _lent_dirs_out(self, value: Mapping[str, Path]) -> dict[str, Path]:
        return dict(value)

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
    # node/rules.py. Metrics: an opt-in Prometheus endpoint, loopback only unless allowed.
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
    # The owner's courtesy (node/courtesy/; README "The owner's courtesy"): a GPU the owner uses
    #   is given back (its tasks paused; stopped past gpu_yield_stop_seconds; run again after
    #   gpu_yield_resume_seconds free); programs named in gpu_yield_ignore are not the owner's
    #   use. At or above a temperature limit (°C; 0: off) tasks pause until 10 °C below it.
    #   gpu_power_limit_percent: of each GPU's default power limit, while tasks run on it.
    gpu_yield: bool = True
    gpu_yield_stop_seconds: float = Field(default=300.0, ge=0, le=86400)
    gpu_yield_resume_seconds: float = Field(default=30.0, ge=0, le=86400)
    gpu_yield_ignore: tuple[str, ...] = DESKTOP_GPU_PROGRAMS
    gpu_temperature_limit_c: float = Field(default=85.0, ge=0, le=120)
    cpu_temperature_limit_c: float = Field(default=100.0, ge=0, le=120)
    gpu_power_limit_percent: float | None = Field(default=None, ge=10, le=100)
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

    @field_validator("gpu_temperature_limit_c", "cpu_temperature_limit_c", mode="before")
    @classmethod
    def _celsius(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a temperature in °C (0: off), not true or false")
        return value

    @field_validator("gpu_temperature_limit_c", "cpu_temperature_limit_c")
    @classmethod
    def _celsius_floor(cls, value: float) -> float:
        if 0 < value < MIN_LIMIT_C:
            raise ValueError(f"must be 0 (off) or at least {MIN_LIMIT_C} °C")
        return value

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

    @field_validator("metrics_listen", mode="before")
    @classmethod
    def _metrics_listen(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "off"):
            return None  # as ui_listen: an empty FLASHNODE_METRICS_LISTEN= turns them off
        if isinstance(value, str):
            parse_listen(value.strip())
            return value.strip()
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
