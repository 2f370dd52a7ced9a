"""The docker runner's test image (busybox, imported without a registry) and the helpers the
tests that run tasks in it share.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import shutil
import tarfile
from collections.abc import Callable
from typing import Any

import pytest
from harness import AgentProcess, argv_job

docker = pytest.importorskip("docker")

IMAGE = "flashnode-test/busybox:1"
LABEL = "dev.flashnode.node"
APPLETS = [
    "sh",
    "ls",
    "cat",
    "id",
    "echo",
    "grep",
    "sleep",
    "touch",
    "mkdir",
    "env",
    "true",
    "false",
    "printf",
    "head",
    "wc",
    "tr",
]


FAST = {
    "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
    "FLASHNODE_KILL_GRACE_SECONDS": "1",
    "FLASHNODE_ALLOWED_IMAGES": IMAGE,
}


def engine_client() -> Any:
    try:
        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except Exception as exc:
        pytest.skip(f"no Docker engine answers ({type(exc).__name__}); .ci/run starts one")


def import_image(engine: Any, name: str, extra: dict[str, str] | None = None) -> str:
    """An image imported from a local busybox rootfs (no registry is needed), with ``extra``
    executable files, path -> text."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox (busybox-static) is needed to build the test image")
    try:
        engine.images.get(name)
        return name
    except docker.errors.ImageNotFound:
        pass
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "work", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, "bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for path, text in (extra or {}).items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    repo, tag = name.split(":")
    answer = engine.api.import_image_from_data(buf.getvalue(), repository=repo, tag=tag)
    try:
        engine.images.get(name)
    except docker.errors.ImageNotFound:  # Podman's import takes the name but not the tag
        engine.images.get(_imported_id(answer)).tag(repo, tag)
    return name


def _imported_id(answer: Any) -> str:
    """The image id in an engine's answer to an import (its last JSON line's ``status``)."""
    text = answer if isinstance(answer, str) else json.dumps(answer)
    for line in reversed(text.strip().splitlines()):
        with contextlib.suppress(ValueError, AttributeError):
            status = json.loads(line).get("status", "")
            if status:
                return str(status).removeprefix("sha256:")
    raise RuntimeError(f"the engine's answer to an import names no image: {text[:200]}")


def box_job(command: list[str], image: str = IMAGE, **extra: Any) -> dict[str, Any]:
    spec = argv_job(command, pool=None, allow_fallback=False, **extra)
    repo, _, tag = image.partition(":")
    spec["spec"]["image"] = {"repository": repo, "tag": tag}
    return spec


def unique(name: str) -> str:
    """A node id no earlier run used: leftovers of other runs never match this test's label."""
    return f"{name}-{secrets.token_hex(3)}"


def start(
    start_agent: Callable[..., AgentProcess],
    url: str,
    node: str,
    *args: str,
    env: dict[str, str] | None = None,
    **kw: Any,
) -> AgentProcess:
    return start_agent(
        url, "--runner", "docker", "--node-id", node, *args, env={**FAST, **(env or {})}, **kw
    )


def ours(engine: Any, node: str) -> list[Any]:
    # ignore_removed: a container removed between the listing and its inspection is not ours.
    # Podman answers that inspection 500 "no such container" (not Docker's 404, which the SDK
    # ignores): the listing is asked again.
    for _ in range(20):
        try:
            return list(
                engine.containers.list(
                    all=True, filters={"label": f"{LABEL}={node}"}, ignore_removed=True
                )
            )
        except docker.errors.APIError as exc:
            if "no such container" not in str(exc):
                raise
    raise AssertionError("the engine's listing kept naming containers that were gone")
