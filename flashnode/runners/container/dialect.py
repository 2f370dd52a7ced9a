"""What an engine does differently from Docker behind the same API (``Dialect``), asked of the
engine once: Podman's Docker-compatible socket runs the runner's containers too, given what
Docker never needs, and Docker is given one thing Podman does not need.

* **rlimits.** Docker's containers inherit the engine's own limits; Podman, as root, sets
  ``nofile`` and ``nproc`` to 1048576 in every container unless told otherwise, and the start
  fails ("error setting rlimit") wherever the host withholds ``CAP_SYS_RESOURCE`` (a host that
  is itself a container or a VM sandbox). Under Podman a task is given the engine's own limits
  explicitly, as Docker gives them: those of the process that serves the socket where the agent
  can see it, else the agent's own.
* **the read-only root.** Podman mounts writable tmpfs at ``/run`` and ``/var/tmp`` under a
  read-only root (bounded by nothing but the memory limit, unseen by the disk watch): under
  Podman they are mounted read-only and tiny, so a task writes where it does under Docker.
* **an init under gVisor.** Docker's containerd keeps the shim of a gVisor container whose
  start failed (a program not in the image: runsc fails the start, and the shim's task stays
  "created" through the container's removal), one process a failed start, for good: a job
  could fill the owner's memory with them. Under a runtime with its own kernel, Docker's
  containers run its init (``docker-init``, tini) first: it starts, and a missing program is
  its exit 127. Podman needs no such init (its conmon goes with the container) and may have
  none installed.
* **GPUs.** The runner asks for a task's GPUs as Docker's device requests (``--gpus``), which
  Podman 4's compat API drops without a word (its container gets none): under Podman a GPU
  task is refused rather than run without its GPUs.
* **its name and version**, and whether it runs rootless, for the doctor; rootless Podman on
  cgroup v1 ignores a container's memory, CPU and pids limits and cannot pause it, so the
  runner does not start with it.

Everything else the runner does (pause, logs, stats, labels, removal by name, the watch) Podman
answers as Docker does; where an answer differs (its ``top``), the handle checks the answer,
not the engine's name.
"""

from __future__ import annotations

import resource
import socket
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import docker.types

from flashnode.runners.container import ENGINE_ERRORS

# Shut, not removed: Podman adds these two whenever the root is read-only.
_SHUT = "ro,nosuid,nodev,noexec,size=4k"
_LIMITS = {"nofile": "Max open files", "nproc": "Max processes"}


@dataclass(frozen=True)
class Dialect:
    """``name``: "Docker" or "Podman"; ``version``: as the engine says; ``rootless``: it runs as
    a user, not root; ``ulimits``: set on every container (name -> (soft, hard)); ``tmpfs``:
    mounted in every container besides the task's ``/tmp``; ``passes_gpus``: a device request
    reaches the container; ``init_own_kernel``: a container under a runtime with its own kernel
    runs the engine's init first."""

    name: str = "Docker"
    version: str = ""
    rootless: bool = False
    cgroup_version: str = ""
    ulimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    tmpfs: dict[str, str] = field(default_factory=dict)
    passes_gpus: bool = True
    init_own_kernel: bool = True

    def describe(self) -> str:
        rootless = ", rootless" if self.rootless else ""
        cgroups = f", cgroup v{self.cgroup_version}" if self.cgroup_version else ""
        return f"{self.name} {self.version or '(version unknown)'}{rootless}{cgroups}"

    def apply(self, kwargs: dict[str, Any], own_kernel: bool = False) -> dict[str, Any]:
        """``kwargs`` of a container's create, with what this engine needs added (limits the
        caller set itself, e.g. ``fsize``, are kept); ``own_kernel``: its runtime gives it a
        kernel of its own (``Runtime.own_kernel``)."""
        given = list(kwargs.get("ulimits") or [])
        named = {u["Name"] for u in given}
        given += [
            docker.types.Ulimit(name=name, soft=soft, hard=hard)
            for name, (soft, hard) in self.ulimits.items()
            if name not in named
        ]
        if given:
            kwargs["ulimits"] = given
        if self.tmpfs:
            kwargs["tmpfs"] = {**self.tmpfs, **(kwargs.get("tmpfs") or {})}
        if own_kernel and self.init_own_kernel:
            kwargs["init"] = True
        return kwargs

    def problems(self) -> list[str]:
        """Why this engine cannot hold a task's sandbox here, in the owner's words: the agent
        does not start with it (fail closed), and the doctor says so."""
        if self.rootless and self.cgroup_version == "1":
            return [
                "rootless Podman on cgroup v1 runs a container with no memory, CPU or pids limit"
                " (it ignores them) and cannot pause one; boot with cgroup v2"
                " (systemd.unified_cgroup_hierarchy=1) or run Podman as root"
            ]
        return []


def dialect(client: Any, docker_host: str) -> Dialect:
    """The engine's dialect, asked of it (Docker's where it cannot tell)."""
    try:
        version = client.version()
        info = client.info()
    except (*ENGINE_ERRORS, AttributeError):  # AttributeError: a client that cannot say
        return Dialect()
    names = [str(c.get("Name", "")) for c in version.get("Components") or []]
    options = " ".join(str(o) for o in info.get("SecurityOptions") or [])
    said = Dialect(
        version=str(version.get("Version", "")),
        rootless="rootless" in options,
        cgroup_version=str(info.get("CgroupVersion", "")),
    )
    if not any("podman" in n.lower() for n in names):
        return said
    return replace(
        said,
        name="Podman",
        ulimits=_engine_limits(docker_host),
        tmpfs={"/run": _SHUT, "/var/tmp": _SHUT},
        passes_gpus=False,
        init_own_kernel=False,
    )


def _engine_limits(docker_host: str) -> dict[str, tuple[int, int]]:
    """``nofile`` and ``nproc`` of the process that serves ``docker_host`` (its peer on a unix
    socket, where the agent may read its limits), else the agent's own."""
    own = {
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
    }
    seen = _peer_limits(docker_host)
    return {name: seen.get(name) or own[name] for name in _LIMITS}


def _peer_limits(docker_host: str) -> dict[str, tuple[int, int]]:
    if not docker_host.startswith("unix://"):
        return {}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(docker_host.removeprefix("unix://"))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        lines = Path(f"/proc/{pid}/limits").read_text().splitlines()
    except (OSError, struct.error):
        return {}
    found: dict[str, tuple[int, int]] = {}
    for name, title in _LIMITS.items():
        for line in lines:
            if line.startswith(title):
                soft, hard = line[len(title) :].split()[:2]
                if soft.isdigit() and hard.isdigit():  # "unlimited": leave it to the agent's
                    found[name] = (int(soft), int(hard))
    return found
