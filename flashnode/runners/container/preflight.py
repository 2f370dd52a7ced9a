"""The doctor's checks of the container runner: the engine answers, and the allowed images are
pinned and can run here (present, or pulled when a task needs them). Every problem at once,
each with its fix.
"""

from __future__ import annotations

from collections.abc import Iterator

from flashnode.config.settings import Settings
from flashnode.errors import ExitCode
from flashnode.runners.container import ENGINE_ERRORS, brief, connect, image_present, pin_problem
from flashnode.runners.findings import Finding, Ok, Problem


def engine_and_images(s: Settings) -> Iterator[Finding]:
    """The engine answers, and at least one allowed (pinned) image can run. Every problem at
    once, each with its fix: an owner fixes them in one go, not one per run of doctor."""
    pinned = []
    for image in s.allowed_images:
        why = pin_problem(image)
        if why:
            fix = f"list it as a pinned tag or digest in allowed_images (not {image!r})"
            yield Problem("allowed images", why, fix)
        else:
            pinned.append(image)
    if not s.allowed_images:
        yield Problem(
            "allowed images",
            "allowed_images is empty: this node would refuse every container task",
            "list the images you allow, pinned, under [docker]:"
            ' e.g. allowed_images = ["python:3.11-slim"]',
        )
    try:
        client = connect(s, timeout=10)
        client.ping()
    except ENGINE_ERRORS as exc:
        yield Problem(
            "docker engine",
            f"no container engine answers at {s.docker_host} ({brief(exc)})",
            "start Docker (systemctl start docker), check docker_host under [docker], or run"
            " the trusted runner for pool work (runner = 'trusted')",
            code=ExitCode.UNAVAILABLE,
        )
        return
    try:
        yield Ok("docker engine", s.docker_host)
        present = [i for i in pinned if image_present(client, i)]
        absent = [i for i in pinned if i not in present]
        if absent and not present and not s.pull_images:
            yield Problem(
                "allowed images",
                f"none is present ({', '.join(absent)}) and pull_images is off:"
                " this node could run nothing",
                f"docker pull {absent[0]}, or set pull_images = true under [docker]",
            )
            return
        for image in absent:
            if s.pull_images:
                yield Ok("image", f"{image} (pulled when a task needs it)")
            else:
                yield Problem(
                    "image",
                    f"{image} is not present and pull_images is off: tasks naming it fail",
                    f"docker pull {image}, or set pull_images = true under [docker]",
                    code=None,
                )
        for image in present:
            yield Ok("image", image)
    finally:
        client.close()
