"""The doctor's checks of the container runner: the engine answers, the allowed images are
pinned and can run here (present, or pulled when a task needs them), and each runtime the
settings name is registered with the engine and runs a probe container (gVisor's shows a kernel
of its own). Every problem at once, each with its fix.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashnode.config.settings import Settings
from flashnode.errors import ExitCode
from flashnode.runners.container import (
    ENGINE_ERRORS,
    brief,
    connect,
    image_present,
    pin_problem,
    runtime_fix,
    runtimes_in,
)
from flashnode.runners.container.dialect import Dialect, dialect
from flashnode.runners.findings import Finding, Ok, Problem

RUNTIME_PROBE_WAIT_S = 60


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
            "start Docker (systemctl start docker) or Podman (systemctl start podman.socket),"
            " check docker_host under [docker], or run"
            " the trusted runner for pool work (runner = 'trusted')",
            code=ExitCode.UNAVAILABLE,
        )
        return
    try:
        spoken = dialect(client, s.docker_host)
        yield Ok("docker engine", f"{spoken.describe()} at {s.docker_host}")
        for problem in spoken.problems():
            fix = "see the owner's manual, Podman as the engine"
            yield Problem("docker engine", problem, fix, code=ExitCode.UNAVAILABLE)
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
        yield from runtimes(s, client, present[0] if present else None, spoken)
    finally:
        client.close()


def runtimes(
    s: Settings, client: Any, image: str | None, spoken: Dialect | None = None
) -> Iterator[Finding]:
    """Each runtime the settings name: registered with the engine, and a probe container runs
    under it (``cat /proc/version`` in ``image``, locked down, removed by name). A missing
    ``container_runtime`` is fatal (``work`` would refuse to start); a runtime only a pool or
    work from no pool uses is fatal too (``work`` would refuse to start: it cannot refuse such
    work before it is placed here); one only a pool uses is a warning (that pool is not
    advertised)."""
    named = s.runtimes()
    if not named:
        return
    try:
        info = client.info()
    except ENGINE_ERRORS as exc:
        yield Problem(
            "runtimes",
            f"cannot read the engine's runtimes ({brief(exc)})",
            "check that `docker info` answers",
            code=ExitCode.UNAVAILABLE,
        )
        return
    registered = runtimes_in(info)
    default = str(info.get("DefaultRuntime") or "")
    default_own = default in registered and registered[default].own_kernel(default)
    host = _host_kernel()
    spoken = spoken or Dialect()
    for runtime in named:
        what = f"runtime {runtime}"
        fatal = runtime in (s.container_runtime, s.public_runtime)
        code = ExitCode.UNAVAILABLE if fatal else None
        users = _users(s, runtime)
        if runtime not in registered:
            yield Problem(
                what,
                f"not registered with the engine (it has {', '.join(sorted(registered))});"
                f" {users} cannot run here",
                runtime_fix(runtime, registered),
                code=code,
            )
            continue
        if image is None:
            yield Problem(
                what,
                "registered, but no allowed image is present to run a probe container in",
                "docker pull one of allowed_images, then run doctor again",
                code=None,
            )
            continue
        found = registered[runtime]
        path, gvisor = found.path, found.own_kernel(runtime)
        kernel, why = _probe(s, client, image, (runtime, gvisor), spoken)
        if why is not None and _probe(s, client, image, (None, default_own), spoken)[1] is not None:
            yield Problem(  # the image's fault, not the runtime's: it cannot tell
                what,
                f"registered, but `cat /proc/version` fails in {image} under the engine's"
                f" default runtime too ({why}): no probe could run",
                "allow an image that has cat (e.g. busybox or a Debian one), then run doctor again",
                code=None,
            )
        elif why is not None:
            init = " --init" if gvisor and spoken.init_own_kernel else ""  # as the probe ran
            yield Problem(
                what,
                f"a probe container in {image} did not run under it ({why})",
                f"run `docker run --rm --runtime {runtime}{init} {image} true` and fix what it says"
                ' (gVisor: runtimeArgs ["--platform=ptrace", "--network=none"] in'
                " /etc/docker/daemon.json; the owner's manual, Isolation)",
                code=code,
            )
        elif gvisor and kernel == host:
            yield Problem(
                what,
                f"a probe container ran under it but saw the host's kernel ({kernel!r}), not"
                " gVisor's",
                f"check that {runtime!r} points at runsc in /etc/docker/daemon.json",
                code=code,
            )
        elif gvisor:
            yield Ok(what, f"{users}; registered ({path}); a probe saw gVisor's kernel, {kernel!r}")
        else:
            yield Ok(what, f"{users}; registered ({path or 'built in'}); a probe ran under it")


def _users(s: Settings, runtime: str) -> str:
    """Who runs under ``runtime``, in the owner's words."""
    who = [f"pool {p}" for p in s.pools if s.runtime_for(p) == runtime]
    if s.runtime_for(None) == runtime:
        who.append("work from no pool")
    if runtime == s.container_runtime:
        who.insert(0, "every container task")
    return ", ".join(dict.fromkeys(who)) or "nothing"


def _host_kernel() -> str:
    try:
        return Path("/proc/version").read_text().strip()
    except OSError:
        return ""


def _probe(
    s: Settings, client: Any, image: str, under: tuple[str | None, bool], spoken: Dialect
) -> tuple[str, str | None]:
    """``cat /proc/version`` in a locked-down container under ``under``'s runtime (None: the
    engine's default) and whether it has its own kernel: (what it printed, None) or ("", why it
    failed). The container is removed by name in every case (a create that timed out may still
    have made it)."""
    runtime, own_kernel = under
    user = s.container_user or ("65534:65534" if os.geteuid() == 0 else f"{os.geteuid()}")
    name = f"flashnode-doctor-{secrets.token_hex(8)}"
    try:
        probe = {
            "image": image,
            "command": ["cat", "/proc/version"],
            "name": name,
            "user": user,
            "network_mode": "none",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges:true"],
            "mem_limit": 256 * 1024 * 1024,
            "pids_limit": 64,
            "runtime": runtime,
        }
        container = client.containers.create(**spoken.apply(probe, own_kernel))
        container.start()
        status = int(container.wait(timeout=RUNTIME_PROBE_WAIT_S).get("StatusCode", 1))
        out = container.logs(stdout=True, stderr=True).decode(errors="replace").strip()
        if status != 0:
            return "", f"exit {status}: {out[-200:]}"
        return out, None
    except ENGINE_ERRORS as exc:
        return "", brief(exc)
    finally:
        with contextlib.suppress(*ENGINE_ERRORS):
            client.containers.get(name).remove(force=True)
