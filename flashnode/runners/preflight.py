"""What must hold before ``flashnode work`` starts: one list, for ``work`` and ``doctor``.

``work`` runs :func:`problems` after loading its settings and stops at the first fatal one with its
exit code and one line; ``doctor`` prints every finding of :func:`check`. So the two agree on
every point by construction. The checks are local (no coordinator): the state dir, the stored
credentials, and the runner's prerequisites (the task user, its sandbox and ``task_python`` for
the trusted runner; the engine and the allowed images for the docker runner).

Nothing here changes the host: a state dir that does not exist yet is checked for whether it
can be made, not made. The Docker SDK is imported only to check a docker runner.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import psutil

from flashnode.config.credentials import credentials_names
from flashnode.config.settings import Settings
from flashnode.config.sizes import format_size
from flashnode.owner import unitview
from flashnode.owner.unitview import UnitView
from flashnode.runners.findings import Finding, Ok, Problem
from flashnode.runners.registry import runner_class
from flashnode.sandbox import diskuse


def problems(
    settings: Settings, slots: int | None = None, service: UnitView | None = None
) -> list[Problem]:
    """Every problem :func:`check` finds, fatal ones first."""
    found = [f for f in check(settings, slots, service) if isinstance(f, Problem)]
    return sorted(found, key=lambda p: not p.fatal)


def check(
    settings: Settings, slots: int | None = None, service: UnitView | None = None
) -> list[Finding]:
    """Every check, in order: the paths as ``service`` (the systemd unit the agent runs under,
    or will) lets it see them, state dir, credentials, the runner's prerequisites (for
    ``slots`` slots; by default what ``slots`` says, one for "auto")."""

    if slots is None:
        slots = settings.slots if isinstance(settings.slots, int) else 1
    findings = _service_view(settings, service)
    if not any(f.what == "state_dir" for f in findings):  # else its fix is the unit's
        findings += _state_dir(settings)
    findings += [*_credentials(settings), *_machine(settings)]
    return findings + runner_class(settings.runner).preflight(settings, slots)


# --- what the service can reach ---------------------------------------------------------------


def _service_view(s: Settings, view: UnitView | None) -> list[Finding]:
    """Paths the unit the agent runs under (or, for ``doctor``, the installed unit) would not
    let it use as it must: what passes here, the service can use; what fails names the unit
    setting to change (``unitview``)."""
    if view is None:
        return []
    found: list[Finding] = [
        Problem(f.need.key, f.why, f.fix) for f in unitview.check(view, s.model_dump())
    ]
    handed = view.credentials.values()
    verdict = view.verdict(s.credentials_dir)
    if s.credentials_dir not in handed and verdict.access in ("hidden", "private"):
        found.append(
            Problem(
                "credentials_dir",
                f"{s.credentials_dir} does not exist for the service ({verdict.setting} in"
                f" {view.name}), and its LoadCredential= hands in another directory",
                "keep credentials_dir unset (flashnode login stores them where the unit hands"
                " them in)",
            )
        )
    return found


def _machine(s: Settings) -> Iterator[Finding]:
    """Per-task limits that this machine cannot give (they are allowed: a warning)."""
    memory, cores = psutil.virtual_memory().total, os.cpu_count() or 1
    if s.task_memory_bytes is not None and s.task_memory_bytes > memory:
        yield Problem(
            "task memory",
            f"task_memory_bytes ({format_size(s.task_memory_bytes)}) is more than this machine"
            f" has ({memory / 2**30:.1f} GiB)",
            "lower task_memory_bytes, or leave it unset (a share of the machine per slot)",
            code=None,
        )
    if s.task_cpus is not None and s.task_cpus > cores:
        yield Problem(
            "task cpus",
            f"task_cpus ({s.task_cpus:g}) is more than this machine's {cores} core(s)",
            "lower task_cpus, or leave it unset (a share of the machine per slot)",
            code=None,
        )


# --- the state dir ----------------------------------------------------------------------------

ROOTS = "run it with sudo: it is root's (the agent that uses it runs as root)"


def _state_dir(s: Settings) -> Iterator[Finding]:
    path = s.state_dir
    if not path.is_absolute():
        yield Problem("state dir", f"{path} is not an absolute path", "set state_dir to one")
        return
    try:
        st = path.lstat()
    except FileNotFoundError:
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            yield Problem(
                "state dir",
                f"{path} does not exist and this user cannot make it in {parent}",
                f"install -d -m 0700 {path} (as the user the agent runs as), or set state_dir",
            )
        else:
            yield Ok("state dir", f"{path} (made at the first start)")
        return
    except OSError as exc:
        yield Problem("state dir", f"{path}: {exc.strerror}", "set state_dir to a usable directory")
        return
    if not stat.S_ISDIR(st.st_mode):
        yield Problem("state dir", f"{path} is not a directory", "set state_dir to a directory")
        return
    if st.st_uid != os.geteuid():
        yield Problem(
            "state dir",
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})",
            ROOTS if st.st_uid == 0 else f"chown -R {os.geteuid()} {path}, or set state_dir",
        )
        return
    if not os.access(path, os.W_OK | os.X_OK):
        yield Problem("state dir", f"{path} is not writable", f"chmod u+rwx {path}")
        return
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # Another user could put files in it that the agent reads as its own (its records,
        # its launch chains' mount tables).
        yield Problem(
            "state dir",
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod go-w {path}",
        )
        return
    space = diskuse.space(path)
    if space is None:
        yield Problem(
            "state dir", f"cannot read how much {path} has free", "check its file system", code=None
        )
        return
    short = space.short(s.min_free_bytes)
    if short:
        yield Problem(
            "state dir",
            f"{path} has {short}: the agent will not claim work",
            "free space (or remove files), or lower min_free_bytes",
            code=None,
        )
    else:
        yield Ok("state dir", f"{path}, {format_size(space.free_bytes)} free")


# --- stored credentials -----------------------------------------------------------------------


def _credentials(s: Settings) -> Iterator[Finding]:
    """Where ``flashnode login`` stores secrets must be this user's alone: a directory others can
    write into lets them plant a token, and the agent would work for whoever owns it."""
    directory = s.credentials_dir
    try:
        st = directory.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        yield Problem("credentials", f"{directory}: {exc.strerror}", f"check {directory}")
        return
    if not stat.S_ISDIR(st.st_mode):
        yield Problem("credentials", f"{directory} is not a directory", f"remove {directory}")
    elif st.st_uid != os.geteuid():
        yield Problem(
            "credentials",
            f"{directory} belongs to uid {st.st_uid}, not to this user",
            ROOTS if st.st_uid == 0 else f"chown {os.geteuid()} {directory}",
        )
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        yield Problem(
            "credentials",
            f"{directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod 700 {directory}",
        )
    else:
        kinds = [k for k, v in (("token", s.token), ("join code", s.join_code)) if v is not None]
        if kinds:
            yield Ok("credentials", ", ".join(kinds))
            return
        others = _stored_elsewhere(s)
        if not others:
            yield Ok("credentials", f"none stored in {directory} (an open coordinator needs none)")
            return
        looked = " or ".join(f"{n}.token" for n in credentials_names(s.coordinator))
        yield Problem(
            "credentials",
            f"none for {s.coordinator} in {directory} (looked for {looked}); stored there: "
            + "; ".join(others),
            f"flashnode login --coordinator {s.coordinator}, or set coordinator to the one they"
            " are for",
            code=None,
        )


def _stored_elsewhere(s: Settings) -> list[str]:
    """What ``flashnode login`` stored in the credentials directory, for which coordinator
    each is (none of them is this one's: the caller found none)."""
    try:
        names = sorted(os.listdir(s.credentials_dir))
    except OSError:
        return []
    found = []
    for name in names:
        stem, _, kind = name.rpartition(".")
        host, _, port = stem.rpartition("_")
        if kind in ("token", "join-code") and host and port.isdigit():
            found.append(
                f"{name} (for {host.replace('__', '::')} port {port}: another coordinator)"
            )
    return found
