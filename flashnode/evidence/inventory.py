"""This machine's capabilities and opt-ins → NodeRegistration."""

from __future__ import annotations

import grp
import os
import platform
import re
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import psutil

from flashnode import __version__, statefile
from flashnode.config.settings import Settings
from flashnode.coordinator.messages import GpuInfo, NodeCapabilities, NodeRegistration

ARCHITECTURES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def node_id(settings: Settings) -> str:
    """The configured node id, else the one generated on first start and kept in the state dir."""
    if settings.node_id:
        return settings.node_id
    path = settings.state_dir / "node-id"
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40].strip("-") or "node"
    new = f"{host}-{secrets.token_hex(4)}"
    statefile.write(path, (new + "\n").encode(), 0o600)
    return new


@dataclass(frozen=True)
class Offer:
    """What the node offers to run, from its runner's abilities (``runners.capabilities``)."""

    argv_capable: bool = False
    sandbox_capable: bool = False
    unsandboxed_argv_capable: bool = False
    can_install_dependencies: bool = False
    module_capable: bool = False
    lends_data: bool = False  # the owner's local datasets, by label
    # The pools advertised: those of the settings the runner can run now (None: all of them).
    pools: tuple[str, ...] | None = None


def registration(
    settings: Settings, node: str, offer: Offer | None = None, gpus: list[GpuInfo] | None = None
) -> NodeRegistration:
    """This machine as the coordinator hears of it; ``offer``: what it runs (none: nothing)."""
    offer = offer or Offer()
    machine = platform.machine().lower()
    return NodeRegistration(
        node_id=node,
        hostname=socket.gethostname(),
        capabilities=NodeCapabilities(
            cpu_cores=float(os.cpu_count() or 1),
            memory_bytes=psutil.virtual_memory().total,
            gpus=list(gpus or []),
            dataset_cache_bytes=settings.dataset_cache_bytes,
            pools=list(settings.pools if offer.pools is None else offer.pools),
            os=platform.system().lower(),
            architecture=ARCHITECTURES.get(machine, machine),
        ),
        unsandboxed_argv_capable=offer.unsandboxed_argv_capable,
        argv_capable=offer.argv_capable,
        sandbox_capable=offer.sandbox_capable,
        can_install_dependencies=offer.can_install_dependencies,
        module_capable=offer.module_capable,
        # Labels only: paths never leave the node.
        local_datasets=sorted(settings.local_data) if offer.lends_data else [],
        agent_version=__version__,
    )


def ensure_state_dir(path: Path) -> None:
    """The state dir, private to the agent's user; members of the ``flashnode`` group may pass
    through it to read status.json (and nothing else: every other file in it is 0600)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        gid = grp.getgrnam(statefile.STATUS_GROUP).gr_gid
        os.chown(path, -1, gid)
    except (KeyError, PermissionError):
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o077)
        return
    path.chmod((stat.S_IMODE(path.stat().st_mode) & ~0o077) | 0o010)
