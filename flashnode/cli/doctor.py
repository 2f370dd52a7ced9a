"""``flashnode doctor``: what ``work`` will see, the same checks (``runners.preflight``) and
then the coordinator, the caches, cgroups and GPUs; every failure names its fix.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from pathlib import Path

import click
import psutil

from flashnode.caches import datacache
from flashnode.cli.common import config_option, needs_root, roots_config
from flashnode.cli.login import probe_node_id, register_dry_run
from flashnode.config.explain import where_to_correct
from flashnode.config.loading import top_level_runner_keys
from flashnode.config.settings import DEFAULT_CONFIG_FILE, Settings
from flashnode.config.sizes import format_size
from flashnode.coordinator.client import Coordinator
from flashnode.coordinator.messages import NodeHeartbeat
from flashnode.errors import (
    ConfigError,
    CoordinatorError,
    CoordinatorUnavailable,
    CredentialsError,
    Unregistered,
)
from flashnode.evidence.gpu import Nvml
from flashnode.owner import status, unitview
from flashnode.runners import preflight
from flashnode.runners.findings import Ok
from flashnode.runners.registry import capabilities, load_settings
from flashnode.runners.spec import task_limits
from flashnode.sandbox import cgroups, lentcheck
from flashnode.sanitise import sanitise


class Report:
    def __init__(self) -> None:
        self.failures = 0

    """Each finding on its line, sanitised (a coordinator's answer is in some)."""

    def ok(self, what: str, detail: str = "") -> None:
        click.echo(sanitise(f"ok    {what}" + (f": {detail}" if detail else "")))

    def warn(self, what: str, detail: str) -> None:
        click.echo(sanitise(f"warn  {what}: {detail}"))

    def fail(self, what: str, problem: str, fix: str) -> None:
        self.failures += 1
        click.echo(sanitise(f"FAIL  {what}: {problem}"))
        click.echo(sanitise(f"      fix: {fix}"))


@click.command()
@config_option
@click.option("--coordinator", help="Check against this coordinator URL instead of the config's.")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, readable=False),
    help="Check this state dir instead of the config's.",
)
def doctor(config_file: Path | None, coordinator: str | None, state_dir: Path | None) -> None:
    """Check this node's setup as `flashnode work` will see it; every failure names its fix.

    The same checks `work` runs before it starts, then the coordinator: it answers, and it
    accepts a registration of this node with the stored credentials (a dry run: registering
    again is harmless). Exit 1 on any FAIL.
    """
    r = Report()
    service = roots_config(config_file)
    if service is not None:
        needs_root(
            f"doctor checks what the agent of {service} sees, and that agent runs as root (its"
            " credentials and state are root's)",
            denied=False,
        )
    try:
        flags = {"coordinator": coordinator, "state_dir": state_dir}
        s = load_settings(flags, os.environ, config_file)
    except ConfigError as exc:
        path = config_file or (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
        r.fail(
            "configuration",
            str(exc),
            f"{where_to_correct(exc, path)}; every setting and its values: the reference,"
            " docs/reference.md (installed: /usr/share/doc/flashnode/docs/reference.md)",
        )
        sys.exit(1)
    slots = s.slots if isinstance(s.slots, int) else 1
    limits = task_limits(s, slots, psutil.virtual_memory().total, os.cpu_count() or 1)
    r.ok(
        "configuration",
        f"{s.runner} runner, pools {','.join(s.pools) or '-'}, {s.slots} slot(s); per task"
        f" {format_size(limits.memory_bytes or 0)} memory, {limits.cpus:g} CPU(s),"
        f" {limits.pids} pids, {format_size(s.task_disk_bytes)} disk",
    )
    r.ok(f"{s.runner} runner", capabilities(s).describe())
    path = config_file or (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
    for key, table in top_level_runner_keys(path) if path is not None else []:
        r.warn(
            "configuration",
            f"{key} at the top level of {path} is read for this release only"
            f" (fix: move it into the [{table}] table, at the end of the file)",
        )
    for finding in preflight.check(s, service=_service(r, config_file)):
        if isinstance(finding, Ok):
            r.ok(finding.what, finding.detail)
        elif finding.fatal:
            r.fail(finding.what, finding.why, finding.fix)
        else:
            r.warn(finding.what, f"{finding.why} (fix: {finding.fix})")
    _check_coordinator(r, s)
    from flashnode.cli import envs as envs_cli  # it builds on this module's options

    envs_cli.doctor(r, s)
    _check_data(r, s)
    hierarchy, why = cgroups.detect()
    if hierarchy is not None:
        r.ok("cgroups", hierarchy.describe())
    elif capabilities(s).on_host:
        r.warn("cgroups", f"{why}: tasks on the host get no memory/CPU/pids limits")
    nvml = Nvml.open(s.nvml_library)
    if nvml is None:
        r.ok("GPUs", "none (no NVML)")
    else:
        r.ok("GPUs", ", ".join(f"{d.info.index}: {d.info.name}" for d in nvml.devices) or "none")
        nvml.close()
    sys.exit(1 if r.failures else 0)


def _service(r: Report, config_file: Path | None) -> unitview.UnitView | None:
    """The installed unit, when the config checked is the one it runs with: its paths are then
    judged as the service will see them (what passes here, the service can use)."""
    view = unitview.load() if os.geteuid() == 0 else None
    if view is None:
        return None
    theirs = view.config_file or DEFAULT_CONFIG_FILE
    ours = config_file or DEFAULT_CONFIG_FILE
    if theirs.resolve() != ours.resolve():
        r.ok("service", f"{view.name} reads {theirs}, not {ours}: checked as run by hand")
        return None
    r.ok("service", f"paths checked as {view.describe()} confines them")
    return view


def _check_coordinator(r: Report, s: Settings) -> None:
    login = "flashnode login (token and join code)"
    client = Coordinator(
        s.coordinator,
        token=s.token.get_secret_value() if s.token else None,
        timeout=10,
        answer_deadline=15,
    )
    try:
        client.health()
        r.ok("coordinator", f"{s.coordinator} answers")
        snapshot = status.read(s.state_dir)
        if snapshot is not None and snapshot.get("registered"):
            # A dry run would replace the running agent's registration: check the token with a
            # heartbeat as that node instead.
            client.node_heartbeat(NodeHeartbeat(node_id=str(snapshot.get("node_id"))))
            r.ok(
                "registration",
                f"the running agent (pid {snapshot['pid']}) is registered as"
                f" {snapshot.get('node_id')}; the token is accepted",
            )
            return
        node = probe_node_id(s, persist=s.state_dir.is_dir())
        registered = register_dry_run(s, node)
        r.ok("registration", f"dry run accepted, as node {registered}")
    except CredentialsError as exc:
        r.fail("registration", f"refused: {exc}", f"run: {login}")
    except Unregistered:
        r.ok("registration", "the token is accepted (the node registers when the agent starts)")
    except CoordinatorUnavailable as exc:
        r.fail(
            "coordinator",
            f"{s.coordinator} does not answer ({exc})",
            "check the URL and the network, or start the coordinator",
        )
    except CoordinatorError as exc:
        r.fail(
            "coordinator",
            f"{s.coordinator} does not answer as a flashruntime coordinator ({exc})",
            "check the URL (scheme, host, port, path)",
        )
    finally:
        client.close()


def _check_data(r: Report, s: Settings) -> None:
    """The dataset cache's use of its budget, and whether the task user can read each lent
    local dataset."""
    if s.dataset_cache_bytes:
        root = s.state_dir / "data"
        count, used = datacache.cache_usage(root)
        r.ok(
            "dataset cache",
            f"{root}: {count} shard(s), {format_size(used)} of"
            f" {format_size(s.dataset_cache_bytes)}",
        )
        try:
            free = shutil.disk_usage(s.state_dir).free
        except OSError:
            free = None  # the state dir check above says why
        if free is not None and free < s.dataset_cache_bytes - used:
            r.warn(
                "dataset cache",
                f"the disk has {format_size(free)} free, less than the rest of the budget",
            )
    else:
        r.ok("dataset cache", "off (dataset_cache_bytes = 0: no dataset work)")
    if not s.local_data:
        return
    identity = _task_identity(s)
    for label, path in sorted(s.local_data.items()):
        if identity is None:
            r.warn(f"local data {label}", f"{path}: no task user to check it for")
            continue
        uid, gid = identity
        why = lentcheck.unreadable(path, uid, gid)
        if why:
            r.fail(
                f"local data {label}",
                f"{path}: {why}, as the task user (uid {uid}, gid {gid})",
                f"let that user read what is in it (the directories above it may stay closed:"
                f" tasks get it mounted), e.g. setfacl -R -m u:{uid}:rX {path}"
                f" or chmod -R o+rX {path}",
            )
        else:
            r.ok(f"local data {label}", f"{path}, readable by uid {uid}")


def _task_identity(s: Settings) -> tuple[int, int] | None:
    """The uid and gid tasks run as under this configuration; None when it cannot be known."""
    identity = capabilities(s).task_identity
    if identity is not None:
        return identity
    try:
        pw = pwd.getpwnam(f"{s.task_user}-0")  # slot 0's user: every slot's is alike
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid
