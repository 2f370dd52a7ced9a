"""The runners this agent knows, by the name ``runner`` chooses, and what each can do.

An entry states its runner's ``Capabilities`` without importing the runner (the Docker SDK
costs an agent that never uses it memory; ``flashnode status`` should not load it); the runner
itself is imported only when it is built or checked (``runner_class``). A new runner is one
module and one entry here: nothing outside ``flashnode/runners/`` compares a runner's name.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashnode.config.loading import load
from flashnode.config.settings import Settings
from flashnode.errors import ConfigError
from flashnode.runners.capabilities import Capabilities

if TYPE_CHECKING:
    from flashnode.runners.base import Runner


@dataclass(frozen=True)
class Registered:
    """One runner: where its class is ("module:Class"), what it can do under a configuration."""

    runner: str
    capabilities: Callable[[Settings], Capabilities]


def _trusted(settings: Settings) -> Capabilities:
    root = os.geteuid() == 0
    return Capabilities(
        sandbox=False,
        on_host=True,
        environments=True,
        # Only a root agent can mount lent directories into a task (a mount namespace).
        lends_data=root,
        # A root agent's slots each have their task user; else tasks run as the agent.
        task_identity=None if root else (os.geteuid(), os.getegid()),
        network_isolation=False,
        gpu_addressing="host",
        pause=True,
        reattach=True,
        modules=True,
    )


def _docker(settings: Settings) -> Capabilities:
    if settings.container_user:
        uid, _, gid = settings.container_user.partition(":")
        identity = (int(uid), int(gid or uid))
    else:  # nobody for a root agent (a rootful engine); the agent's own user otherwise
        identity = (65534, 65534) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    return Capabilities(
        sandbox=True,
        on_host=False,
        environments=False,
        lends_data=True,
        task_identity=identity,
        network_isolation=True,
        gpu_addressing="renumbered",
        pause=True,
        reattach=True,
        modules=True,
    )


RUNNERS: dict[str, Registered] = {
    "docker": Registered("flashnode.runners.container.runner:ContainerRunner", _docker),
    "trusted": Registered("flashnode.runners.trusted:TrustedRunner", _trusted),
}


def names() -> list[str]:
    """The runners' names, the default first."""
    return list(RUNNERS)


def capabilities(settings: Settings) -> Capabilities:
    """What the configured runner can do under ``settings`` (checked by ``load_settings``)."""
    return RUNNERS[settings.runner].capabilities(settings)


def runner_class(name: str) -> type[Runner]:
    module, _, attr = RUNNERS[name].runner.partition(":")
    cls: type[Runner] = getattr(importlib.import_module(module), attr)
    return cls


def check(settings: Settings, named: Callable[[str], str]) -> None:
    """What the runners ask of loaded settings: a runner this agent knows, and pools for one
    that runs tasks on the host (arbitrary code on this host is pool work only)."""
    if settings.runner not in RUNNERS:
        raise ConfigError(f"{named('runner')}: no such runner (known: {', '.join(names())})")
    if capabilities(settings).on_host and not settings.pools:
        raise ConfigError(
            f"{named('runner')} needs at least one pool: set pools (in the config file,"
            " FLASHNODE_POOLS or --pool); arbitrary code on this host is pool-only"
        )


def load_settings(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None = None
) -> Settings:
    """``config.loading.load`` with the runners' ``check``: how every command loads them."""
    return load(flags, env, config_file, check)
