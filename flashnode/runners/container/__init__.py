"""The container runner: every task in a locked-down container, through the Docker Engine API
(the Docker SDK; the only package that imports ``docker``; no ``docker`` CLI).

Image policy: only the owner's ``allowed_images`` (exact ``repo:tag`` or ``repo@sha256:…``), never
``latest`` or untagged; a missing image is pulled only when ``pull_images`` is on. A node whose
allowed images can never run (none present and pulling off) refuses to start.

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
removed), ``engine`` (the engine's health and each container's removal, shared by the runner and
its handles), ``handle`` (a running container as the attempt sees it) and ``preflight`` (the
doctor's checks of the engine and the allowed images). This module is what they stand on: the
engine's errors, a client, and the image policy.
"""

from __future__ import annotations

from typing import Any

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


def brief(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return f"{type(exc).__name__}: {text}"[:200]
