"""This machine's capabilities and opt-ins → NodeRegistration."""

from __future__ import annotations

import grp
import os
import platform
import re
import secrets
import socket
import stat
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


def registration(
    settings: Settings, node: str, gpus: list[GpuInfo] | None = None, module_capable: bool = False
) -> NodeRegistration:
    machine = platform.machine().lower()
    return NodeRegistration(
        node_id=node,
        hostname=socket.gethostname(),
        capabilities=NodeCapabilities(
            cpu_cores=float(os.cpu_count() or 1),
            memory_bytes=psutil.virtual_memory().total,
            gpus=list(gpus or []),
            dataset_cache_bytes=settings.dataset_cache_bytes,
            pools=list(settings.pools),
            os=platform.system().lower(),
            architecture=ARCHITECTURES.get(machine, machine),
        ),
        unsandboxed_argv_capable=settings.unsandboxed_argv_capable,
        argv_capable=settings.runner == "docker",
        sandbox_capable=settings.runner == "docker",
        # The trusted runner builds job environments; a container's image is all it has.
        can_install_dependencies=settings.runner == "trusted",
        module_capable=module_capable,
        # Labels only: paths never leave the node. A trusted agent that is not root cannot mount
        # them into a task (no mount namespace), so it lends nothing.
        local_datasets=sorted(settings.local_data) if _can_lend(settings) else [],
        agent_version=__version__,
    )


def _can_lend(settings: Settings) -> bool:
    return settings.runner == "docker" or os.geteuid() == 0


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
