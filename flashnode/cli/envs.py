"""The owner's view of the job environment cache: ``flashnode envs list|prune``, and the lines
``flashnode doctor`` shows for it. Nothing here builds an environment."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Protocol

import click

from flashnode.caches.envbox import DiskRoom, size
from flashnode.caches.envbuild import EnvSpec
from flashnode.caches.envcache import ENVS_DIR, EnvCache
from flashnode.caches.envrecords import EnvInfo, describe, summary
from flashnode.cli.common import config_option, needs_root, state_dir_of, state_dir_option
from flashnode.config.settings import Settings
from flashnode.errors import ConfigError, EnvUnavailable
from flashnode.runners.registry import capabilities, load_settings
from flashnode.sanitise import sanitise


class NoBuilder:
    """The owner's commands look and prune; they never build."""

    def build(
        self, spec: EnvSpec, work: Path, *, stop: threading.Event, deadline: float, room: DiskRoom
    ) -> Path:
        raise EnvUnavailable("the owner's commands do not build environments")


def open_cache(settings: Settings) -> EnvCache:
    """The agent's cache as the settings name it, for looking and pruning only."""
    return EnvCache(
        settings.state_dir / ENVS_DIR,
        settings.env_cache_bytes,
        allow_source_builds=settings.allow_source_builds,
        negative_ttl_s=settings.env_negative_seconds,
        builder=NoBuilder(),
    )


class Report(Protocol):
    """What ``flashnode doctor`` reports through (owner.Report)."""

    def ok(self, what: str, detail: str = "") -> None: ...

    def warn(self, what: str, detail: str) -> None: ...

    def fail(self, what: str, problem: str, fix: str) -> None: ...


def doctor(r: Report, s: Settings) -> None:
    """The doctor's checks for job environments (trusted runner only): uv is there, source
    builds have a user to run as, and the cache's entries, bytes and budget."""
    if not capabilities(s).environments:
        return
    try:
        import uv

        r.ok("uv", uv.find_uv_bin())
    except (ImportError, FileNotFoundError):
        r.fail(
            "uv",
            "uv is missing: tasks with dependencies cannot get an environment",
            "install flashnode with its dependencies (pip install uv)",
        )
    root = s.state_dir / ENVS_DIR
    if not root.exists():
        r.ok("job environments", f"none yet, budget {size(s.env_cache_bytes)} ({root})")
        return
    try:
        cache = open_cache(s)
        infos = cache.entries()
    except (OSError, EnvUnavailable) as exc:
        r.fail("job environments", f"cannot read {root} ({exc})", f"check the owner of {root}")
        return
    line = summary(infos, cache.budget)
    modes = "binary wheels only" if not s.allow_source_builds else "source builds allowed"
    downloads = "Python downloads allowed" if s.allow_python_downloads else "no Python downloads"
    if sum(i.bytes for i in infos) > cache.budget:
        r.warn("job environments", f"{line}: over budget while in use")
    else:
        r.ok("job environments", f"{line}; {modes}; {downloads} ({root})")


# --- commands ----------------------------------------------------------------------------------


def _settings(config_file: Path | None, state_dir: Path | None) -> Settings:
    try:
        s = load_settings({}, os.environ, config_file)
    except ConfigError:
        # No coordinator configured is no reason not to look at the cache: defaults apply.
        s = Settings(coordinator="http://127.0.0.1")
    return s.model_copy(update={"state_dir": state_dir_of(config_file, state_dir)})


def _open(config_file: Path | None, state_dir: Path | None) -> EnvCache | None:
    """The cache, or None (after saying so) when there is none yet: looking creates nothing."""
    s = _settings(config_file, state_dir)
    root = s.state_dir / ENVS_DIR
    if not root.is_dir():
        click.echo(f"no environment cache in {s.state_dir}")
        click.echo(summary([], s.env_cache_bytes))
        return None
    if root.stat().st_uid != os.geteuid():
        needs_root(f"the environment cache {root} is the agent's", denied=False)
    try:
        return open_cache(s)
    except (OSError, EnvUnavailable, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None


def _as_dict(info: EnvInfo) -> dict[str, object]:
    return {
        "key": info.key,
        "python": info.python,
        "bytes": info.bytes,
        "last_used": info.last_used,
        "created": info.created,
        "build_seconds": info.build_seconds,
        "in_use": info.in_use,
        "path": str(info.path),
        "lines": list(info.lines),
    }


@click.group()
def envs() -> None:
    """List or prune the cached job environments (trusted runner)."""


@envs.command("list")
@config_option
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
def envs_list(config_file: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """Each environment: key, Python, size, whether a task uses it, what it holds."""
    cache = _open(config_file, state_dir)
    if cache is None:
        return
    infos = cache.entries()
    if as_json:
        for info in infos:
            click.echo(json.dumps(_as_dict(info), sort_keys=True))
        return
    for line in describe(infos, cache.budget):
        click.echo(sanitise(line))  # a job's lines: C1 and bidi controls pass uv's check


@envs.command("prune")
@config_option
@state_dir_option
@click.option("--all", "everything", is_flag=True, help="Every environment no task uses.")
def envs_prune(config_file: Path | None, state_dir: Path | None, everything: bool) -> None:
    """Evict environments no task uses, least recently used first, down to the budget."""
    cache = _open(config_file, state_dir)
    if cache is None:
        return
    evicted = cache.prune(everything=everything)
    for info in evicted:
        click.echo(sanitise(f"removed {info.key[:12]}  py{info.python}  {size(info.bytes)}"))
    click.echo(summary(cache.entries(), cache.budget))


def register(main: click.Group) -> None:
    main.add_command(envs)
