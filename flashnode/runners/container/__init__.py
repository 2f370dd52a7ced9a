"""The container runner: every task in a locked-down container, through the Docker Engine API
(the Docker SDK; the only package that imports ``docker``; no ``docker`` CLI).

Image policy: only the owner's ``allowed_images`` (exact ``repo:tag`` or ``repo@sha256:…``), never
``latest`` or untagged; a missing image is pulled only when ``pull_images`` is on. A node whose
allowed images can never run (none present and pulling off) refuses to start.

Runtime: each task runs under the engine runtime its pool's policy names
(``Settings.runtime_for``: e.g. gVisor's ``runsc`` for work from no pool), the engine's default
where none is named; a runtime the engine lacks runs nothing (its pool is not advertised, its
leases lapse).

Sandbox: no network, read-only root with a size-capped tmpfs ``/tmp``, all capabilities dropped,
``no-new-privileges``, a non-root user, pids/memory/CPU limits, private IPC, never privileged, no
Docker socket, no host device but the GPUs the attempt was given, and an engine log capped in
size (the agent keeps its own capped copy). The workspace is mounted at ``/work``: ``inputs/``
read-only, ``out/`` and ``tmp/`` (its ``HOME`` and ``TMPDIR``, as on the trusted runner)
writable by the container's user, ``data/`` (dataset slices) read-only, and nothing else of the
workspace; the owner's lent directories read-only at ``/work/inputs/<label>``.
Containers carry labels naming this node and the attempt (or the module probe); at start the
agent removes this node's labelled containers, and nothing else.

Its parts: ``runner`` (``ContainerRunner``: the image policy applied, the sandbox made, leftovers
removed), ``dialect`` (what an engine does differently from Docker behind the same API: Podman's
rlimits and tmpfs), ``engine`` (the engine's health and each container's removal, shared by the
runner and its handles), ``handle`` (a running container as the attempt sees it) and
``preflight`` (the doctor's checks of the engine and the allowed images). This module is what
they stand on: the engine's errors, a client, and the image policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import docker
import docker.errors
import requests

from flashnode.config.settings import Settings

ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def image_problem(image: str, allowed: tuple[str, ...]) -> str | None:
    """Why ``image`` must not run here, or None."""
    if not image:
        return "the task names no image"
    pinned = pin_problem(image)
    if pinned:
        return pinned
    if image not in allowed:
        return f"image {image!r} is not on this node's allowed_images"
    return None


def pin_problem(image: str) -> str | None:
    if "@sha256:" in image:
        return None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return f"image {image!r} has no tag; only pinned tags or digests run here"
    if tag == "latest":
        return f"image {image!r} is tagged latest; only pinned tags or digests run here"
    return None


def connect(settings: Settings, timeout: int = 60) -> Any:
    return docker.DockerClient(base_url=settings.docker_host, timeout=timeout)


def image_present(client: Any, image: str) -> bool:
    try:
        client.images.get(image)
        return True
    except ENGINE_ERRORS:
        return False


class Runtime(NamedTuple):
    """A runtime as the engine registered it: its program and the arguments it is given."""

    path: str
    args: tuple[str, ...] = ()

    def own_kernel(self, name: str) -> bool:
        """Whether it gives its containers a kernel of their own (gVisor's ``runsc``): their
        processes are not the host's, and the engine lists them by the sandbox's own pids."""
        return "runsc" in (Path(self.path).name or name, name)

    def passes_gpus(self, name: str) -> bool:
        """Whether a GPU reaches a task under it: runc's device requests do; gVisor passes
        one only through its GPU proxy (``--nvproxy``, in releases after Debian's of 2022;
        a Go boolean flag: one dash or two, and any of Go's words for true)."""
        return not self.own_kernel(name) or any(_flag_on(a, "nvproxy") for a in self.args)


def _flag_on(arg: str, name: str) -> bool:
    key, given, value = arg.lstrip("-").partition("=")
    return key == name and (not given or value in ("1", "t", "T", "true", "TRUE", "True"))


def runtimes_in(info: Mapping[str, Any]) -> dict[str, Runtime]:
    """The runtimes the engine has registered, read from its answer to ``docker info``
    (Runtimes: runc, and what the owner added, e.g. runsc)."""
    found = info.get("Runtimes") or {}
    return {
        str(name): Runtime(str(given.get("path", "")), tuple(given.get("runtimeArgs") or ()))
        for name, given in found.items()
        if isinstance(given, dict)
    }


# What owners call a runtime that engines know by another name.
RUNTIME_ALIASES = MappingProxyType({"gvisor": "runsc"})


def runtime_fix(runtime: str, registered: Iterable[str]) -> str:
    """What to do about ``runtime``, which the engine lacks: how to register it, or, for a name
    owners use for one the engine knows by another (gVisor's is ``runsc``), that name. Never a
    registered name merely close to it: runc for runsc would be a weaker wall."""
    meant = RUNTIME_ALIASES.get(runtime.lower())
    if meant is None or meant == runtime:
        return register_fix(runtime)
    if meant in registered:
        return f"the engine calls it {meant!r}: name it so"
    return f"the engine calls it {meant!r}: name it so, and {register_fix(meant)}"


def register_fix(runtime: str) -> str:
    """How an owner registers ``runtime`` with dockerd (docs/owner-manual.md, "Isolation")."""
    path = "/usr/bin/runsc" if runtime == "runsc" else f"/path/to/{runtime}"
    install = "apt-get install runsc, then " if runtime == "runsc" else ""
    return (
        f'{install}add "runtimes": {{"{runtime}": {{"path": "{path}"}}}} to'
        " /etc/docker/daemon.json and reload or restart docker (systemctl reload docker)"
    )


def brief(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return f"{type(exc).__name__}: {text}"[:200]
