"""A scripted container engine for the container runner's tests that need no real one: it
answers, has the runtimes it is given, and (unless told) no image."""

from __future__ import annotations

from typing import Any

import docker.errors


class Containers:
    def list(self, **_: Any) -> list[Any]:
        return []


class Image:
    id = "sha256:" + "0" * 64


class Images:
    def __init__(self, present: bool = False) -> None:
        self.present = present

    def get(self, name: str) -> Any:
        if self.present:
            return Image()
        raise docker.errors.ImageNotFound(name)


class Engine:
    """An engine that answers and has ``runtimes`` (each given ``args``); ``default``: its
    default runtime (``docker info``'s DefaultRuntime, which an owner's daemon.json may set to
    ``runsc``; None: the answer names none)."""

    def __init__(
        self, *runtimes: str, args: tuple[str, ...] = (), default: str | None = None
    ) -> None:
        self.runtimes, self.args, self.default = runtimes, list(args), default
        self.containers = Containers()
        self.images = Images()

    def ping(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        runtimes = {r: {"path": f"/usr/bin/{r}", "runtimeArgs": self.args} for r in self.runtimes}
        return {"Runtimes": runtimes} | ({"DefaultRuntime": self.default} if self.default else {})
