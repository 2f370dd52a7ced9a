"""The wiring of the agent's parts: the edges (the coordinator client, the runner, NVML, the
caches, metrics, the console, the outbox, the ledger) built from the Settings and handed to the
node loop, which imports none of them; the only module that builds edges.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import psutil

from flashnode import __version__, logcontext
from flashnode.attempt import AttemptContext
from flashnode.attempt.outbox import Outbox
from flashnode.caches.datacache import DataCache, OriginPolicy
from flashnode.caches.envcache import ENVS_DIR, EnvCache
from flashnode.caches.fetcher import Fetcher
from flashnode.cli.ending import AgentExit, lock_state_dir
from flashnode.clock import SystemClock
from flashnode.config.credentials import StoredCredentials
from flashnode.config.loading import top_level_runner_keys
from flashnode.config.schedule import Pause, PauseMode
from flashnode.config.settings import DEFAULT_CONFIG_FILE, Settings
from flashnode.coordinator.client import Coordinator
from flashnode.coordinator.messages import NodeRegistration
from flashnode.errors import ConfigError, EnvUnavailable, PrerequisiteError
from flashnode.evidence import inventory, sensors
from flashnode.evidence.gpu import Nvml
from flashnode.evidence.gpupool import GpuPool
from flashnode.node.agent import Agent, effective_slots
from flashnode.node.controls import Controls
from flashnode.node.courtesy.power import PowerCap
from flashnode.node.courtesy.rules import CourtesyRules
from flashnode.node.courtesy.watch import CourtesyWatch
from flashnode.node.courtesy.watch import Readers as CourtesyReaders
from flashnode.node.rules import Readers, Rules
from flashnode.owner import ledgerview, metrics, pausefile, statelock
from flashnode.owner.ledger import Ledger
from flashnode.owner.ledgerview import LedgerView
from flashnode.owner.status import Sinks, TerminalLine
from flashnode.owner.systemd import Notifier, machine_stopping
from flashnode.runners import preflight
from flashnode.runners.background import Background
from flashnode.runners.base import Runner, RunnerEnv
from flashnode.runners.registry import capabilities, load_settings, runner_class
from flashnode.runners.spec import task_limits
from flashnode.sandbox import cgroups, diskuse
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.helpers import json_schema_problem
from flashnode.sandbox.procs.keyrings import private_session_keyring

# What the owner's commands send a running agent (listed in status.json, so that a command never
# signals an agent that does not handle it): the pause file's, and `flashnode drain`'s.
SIGNALS = {**pausefile.SIGNALS, "drain": signal.SIGRTMIN + 2}

log = logging.getLogger("flashnode")

if TYPE_CHECKING:  # the console is imported only when it is served
    from flashnode.console import Console
    from flashnode.console.usage import UsageRing


def make_runner(settings: Settings, env: RunnerEnv) -> Runner:
    """The configured runner (its preflight already passed in ``work``); ConfigError or
    PrerequisiteError when it cannot run here after all (e.g. a task user for a slot that
    ``slots = "auto"`` added)."""
    return runner_class(settings.runner).create(settings, env)


def _thread(fn: Callable[[], None], name: str) -> None:
    """``start_thread``: ``fn`` on a thread of its own, in its starter's context (what it logs
    carries the fields of the attempt that started it, ``logcontext.carried``)."""

    def run() -> None:
        try:
            fn()
        except Exception:  # never silently: the log says which thread and why
            log.exception("thread %s ended with an error", name)

    threading.Thread(target=logcontext.carried(run), name=name, daemon=True).start()


def env_cache(settings: Settings, limits: Limits) -> EnvCache | None:
    """The agent's one cache of job environments: the trusted runner's only. A root agent builds
    as its build user (``procs.BUILD_USER``), in a cgroup of its own with the per-task
    ``limits`` where the host has cgroups (flashnode.caches.envbuild)."""
    if not capabilities(settings).environments:
        return None
    hierarchy = cgroups.detect()[0] if os.geteuid() == 0 else None
    try:
        return EnvCache(
            settings.state_dir / ENVS_DIR,
            settings.env_cache_bytes,
            allow_python_downloads=settings.allow_python_downloads,
            allow_source_builds=settings.allow_source_builds,
            negative_ttl_s=settings.env_negative_seconds,
            min_free_bytes=settings.min_free_bytes,
            hierarchy=hierarchy,
            build_limits=limits,
            index_policy=OriginPolicy.of(settings.env_allow_private_indexes),
        )
    except EnvUnavailable as exc:
        raise PrerequisiteError(str(exc)) from None


def data_cache(settings: Settings) -> DataCache:
    """The agent's one dataset cache (``<state dir>/data``) and its fetcher."""
    fetcher = Fetcher(
        ca_file=settings.dataset_ca_file,
        policy=OriginPolicy.of(settings.dataset_allow_private_origins),
        timeout_seconds=settings.dataset_fetch_timeout_seconds,
    )
    try:
        return DataCache(settings.state_dir / "data", settings.dataset_cache_bytes, fetcher)
    except OSError as exc:
        fetcher.close()
        raise PrerequisiteError(f"cannot set up the dataset cache: {exc}") from None


@dataclass(frozen=True)
class Source:
    """Where the running configuration came from: the flags given and the config file."""

    flags: dict[str, Any] = field(default_factory=dict)
    config_file: Path | None = None

    @property
    def file(self) -> Path | None:
        """The file a change is written to (the default one when it exists)."""
        if self.config_file is not None:
            return self.config_file
        return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None

    def overridden(self, key: str) -> str | None:
        """Who sets ``key`` over the config file: a flag or the environment; None: the file."""
        if self.flags.get(key) not in (None, ()):
            return f"set by --{'pool' if key == 'pools' else key.replace('_', '-')}"
        if os.environ.get(f"FLASHNODE_{key.upper()}"):
            return f"set by FLASHNODE_{key.upper()}"
        return None


def _gpu_percent(nvml: Nvml | None, gpus: GpuPool) -> float | None:
    """The node's GPUs' mean utilisation now (None: no GPU, or one unreadable)."""
    if nvml is None or not gpus.devices:
        return None
    readings = [nvml.utilization(d) for d in gpus.devices]
    ok = [r for r in readings if r is not None]
    return sum(ok) / len(ok) if ok and len(ok) == len(readings) else None


def _console(
    settings: Settings,
    agent: Agent,
    coordinator: Coordinator,
    ring: UsageRing | None,
    source: Source,
    ledger: LedgerView,
) -> Console | None:
    """The owner's console, when ``ui_listen`` asks for it. An address that cannot be bound
    leaves the agent working without it (the console is on by default: a second agent on the
    machine, or a port taken, must not stop the work), and says so."""
    if settings.ui_listen is None or ring is None:
        return None
    from flashnode.console import start
    from flashnode.console.wiring import Wiring

    wiring = Wiring(
        state_dir=settings.state_dir,
        settings=lambda: agent.settings,
        config_file=source.file,
        validate=lambda path: load_settings(source.flags, os.environ, path),
        overridden=source.overridden,
        reload=agent.request_reload,
        node_view=coordinator.node_view,
        job_view=coordinator.job_view,
        ring=ring,
        task_uids=_task_uids(settings),
        ledger=ledger,
    )
    try:
        return start(settings.ui_listen, wiring)
    except OSError as exc:
        log.warning(
            "the console is off: cannot listen on %s (%s); set ui_listen to another address",
            settings.ui_listen,
            exc.strerror or exc,
        )
        return None


def _task_uids(settings: Settings) -> frozenset[int]:
    """The uids trusted tasks may run as (every slot the package makes users for)."""
    if settings.task_user is None:
        return frozenset()
    import pwd

    from flashnode.runners.trustedhost import slot_user_name

    found = set()
    for slot in range(64):
        try:
            found.add(pwd.getpwnam(slot_user_name(settings.task_user, slot)).pw_uid)
        except KeyError:
            continue
    return frozenset(found)


def run_agent(
    settings: Settings,
    reload: Callable[[], Settings] | None = None,
    line: TerminalLine | None = None,
    lock: statelock.StateLock | None = None,
    accepted: frozenset[str] = frozenset(),
    source: Source | None = None,
    agent_exit: AgentExit | None = None,
) -> None:
    """Run the agent on its state dir, holding the state dir's lock (``lock``: already taken)
    until every attempt has ended and the last status is written. ``accepted``: what the
    preflight warned of at start (the quarantine's checks do not count it again)."""
    try:
        inventory.ensure_state_dir(settings.state_dir)
        if lock is None:
            lock = lock_state_dir(settings.state_dir, agent_exit)
        node = inventory.node_id(settings)
    except OSError as exc:
        raise ConfigError(f"state dir {settings.state_dir}: {exc.strerror or exc}") from None
    try:
        _locked_run(settings, reload, line, node, accepted, source)
    finally:
        lock.release()


def _locked_run(
    settings: Settings,
    reload: Callable[[], Settings] | None,
    line: TerminalLine | None,
    node: str,
    accepted: frozenset[str],
    source: Source | None,
) -> None:
    if capabilities(settings).on_host and os.geteuid() == 0:
        # Before any thread starts (threads, and the tasks they start, inherit it).
        why = private_session_keyring()
        if why:
            log.warning("tasks share this agent's session keyring (%s)", why)
    try:
        served = metrics.create(
            settings.metrics_listen, settings.metrics_allow_remote, _task_uids(settings)
        )
    except ValueError as exc:
        raise ConfigError(f"metrics_listen: {exc}") from None
    except OSError as exc:
        raise PrerequisiteError(
            f"cannot serve metrics at {settings.metrics_listen}: {exc.strerror or exc}; fix:"
            " free that address (another program or agent may hold it), or set metrics_listen"
            ' to another one, or to "off" to serve no metrics; then start the agent again'
        ) from None
    try:
        _run_agent(settings, served, reload, line, node, accepted, source or Source())
    finally:
        served.close()


def _run_agent(
    settings: Settings,
    served: metrics.MetricsSink,
    reload: Callable[[], Settings] | None,
    line: TerminalLine | None,
    node: str,
    accepted: frozenset[str],
    source: Source,
) -> None:
    """The agent built from its edges (each step below builds one part), run until it stops;
    then what it opened closed, and the signal handlers it replaced put back."""
    edges = _edges(settings, node)
    ctx = _context(settings, edges, served)
    running = _Running(settings, edges, ctx)
    edges.data.fetcher.room = running.dataset_room
    pause_reader = pausefile.PauseReader(settings.state_dir)
    controls, readers = _controls(settings, edges, pause_reader)
    courtesy = _courtesy(settings, edges, running)
    ring = _usage_ring(settings, edges)
    given = LedgerView(ctx.ledger.path, checkpoint=settings.state_dir / ledgerview.CHECKPOINT_FILE)
    agent = Agent(
        ctx,
        edges.coordinator,
        _registration(edges, node),
        reload=reload,
        sink=Sinks(
            Notifier(),
            metrics.PublishedSink(served),
            *([line] if line else []),
            *([ring] if ring else []),
        ),
        on_settings=running.on_settings,
        limits=edges.limits_of,
        controls=controls,
        health=_health(accepted),
        status_extra={"signals": {k: int(v) for k, v in SIGNALS.items()}},
        machine_stopping=machine_stopping,
        totals=given.totals,
        courtesy=courtesy,
        credentials=StoredCredentials(
            settings, reload or (lambda: settings), edges.coordinator.set_credentials, os.environ
        ),
    )
    readers.task_cpu = agent.task_cpu  # every running task, containers included
    _log_start(settings, node, edges.slots, source.file)
    previous = _install_signals(agent, pause_reader)
    console = _console(settings, agent, edges.coordinator, ring, source, given)
    try:
        agent.run()
    finally:
        if console is not None:
            console.close()
        if ring is not None:
            ring.close()
        given.save()
        edges.janitor.drain(60)
        for sig, old in previous:
            signal.signal(sig, old)
        edges.coordinator.close()
        edges.data.fetcher.close()


@dataclass(frozen=True)
class _Edges:
    """What the agent's parts stand on, built once at start: NVML and the node's GPUs, the clock,
    the slots, the runner, the coordinator client, the machine (memory bytes, CPUs) and the
    per-task limits on it, the caches, and the janitor that removes retired workspaces off the
    next claim's way."""

    nvml: Nvml | None
    gpus: GpuPool
    clock: SystemClock
    slots: int
    runner: Runner
    coordinator: Coordinator
    machine: tuple[int, int]
    limits: Limits
    envs: EnvCache | None
    data: DataCache
    janitor: Background

    def limits_of(self, new: Settings) -> Limits:
        """The per-task limits under ``new`` settings (a reload may change the slots)."""
        return task_limits(new, effective_slots(new, len(self.gpus.devices)), *self.machine)


def _edges(settings: Settings, node: str) -> _Edges:
    nvml = Nvml.open(settings.nvml_library)
    gpus = GpuPool(nvml.devices if nvml is not None else [])
    clock = SystemClock()
    slots = effective_slots(settings, len(gpus.devices))
    runner = make_runner(settings, RunnerEnv(node, gpus, clock, slots))
    coordinator = Coordinator(
        settings.coordinator,
        token=settings.token.get_secret_value() if settings.token else None,
        join_code=settings.join_code.get_secret_value() if settings.join_code else None,
    )
    machine = (psutil.virtual_memory().total, os.cpu_count() or 1)
    limits = task_limits(settings, slots, *machine)
    return _Edges(
        nvml=nvml,
        gpus=gpus,
        clock=clock,
        slots=slots,
        runner=runner,
        coordinator=coordinator,
        machine=machine,
        limits=limits,
        envs=env_cache(settings, limits),
        data=data_cache(settings),
        janitor=Background("janitor"),
    )


def _context(settings: Settings, edges: _Edges, served: metrics.MetricsSink) -> AttemptContext:
    """What every attempt is given: the edges, the ledger, the outbox, the metrics."""
    return AttemptContext(
        coordinator=edges.coordinator,
        runner=edges.runner,
        settings=settings,
        clock=edges.clock,
        ledger=Ledger.shared(settings.state_dir / "ledger.jsonl"),
        outbox=Outbox(settings.state_dir / "outbox"),
        start_thread=_thread,
        rng=random.Random(),
        gpu=edges.nvml,
        gpus=edges.gpus,
        limits=edges.limits,
        space=lambda: diskuse.space(settings.state_dir),
        metrics=served,
        envs=edges.envs,
        data=edges.data,
        schema_check=json_schema_problem,
        later=edges.janitor.submit,
    )


class _Running:
    """The running configuration, as the last reload left it (``on_settings``, the agent's hook),
    and what reads it outside the loop: the dataset fetcher's room above ``min_free_bytes``, the
    GPU power cap's percent; a reload also gives the caches their new budgets and policies."""

    def __init__(self, settings: Settings, edges: _Edges, ctx: AttemptContext) -> None:
        self.settings = settings
        self._edges = edges
        self._ctx = ctx

    def dataset_room(self, nbytes: int, what: str) -> None:
        """The fetcher's check before it writes ``nbytes`` of a dataset slice (ShortOfRoom)."""
        self._ctx.reserved.room(self.settings, self._ctx.space(), nbytes, 0, what)

    def power_percent(self) -> float | None:
        return self.settings.gpu_power_limit_percent

    def on_settings(self, new: Settings, limits: Limits) -> None:
        data, envs = self._edges.data, self._edges.envs
        token, code = new.token, new.join_code  # a reload re-reads the stored credentials too
        self._edges.coordinator.set_credentials(
            token.get_secret_value() if token else None, code.get_secret_value() if code else None
        )
        data.budget_bytes = new.dataset_cache_bytes
        self.settings = new
        data.fetcher.policy = OriginPolicy.of(new.dataset_allow_private_origins)
        data.prune()
        if envs is not None:
            envs.reconfigure(
                new.env_cache_bytes,
                new.min_free_bytes,
                limits,
                OriginPolicy.of(new.env_allow_private_indexes),
            )


def _registration(edges: _Edges, node: str) -> Callable[[Settings], NodeRegistration]:
    """What the node registers as under the current settings, its GPUs read again each time."""
    nvml, gpus, runner = edges.nvml, edges.gpus, edges.runner

    def registration(current: Settings) -> NodeRegistration:
        devices = nvml.refresh() if nvml is not None else []
        gpus.set_devices(devices)
        offer = capabilities(current).offer(current, runner.module_capable, runner.pools(current))
        passed = [d.info for d in devices] if runner.passes_gpus(current) else []
        return inventory.registration(current, node, offer, passed)

    return registration


def _controls(
    settings: Settings, edges: _Edges, pause_reader: pausefile.PauseReader
) -> tuple[Controls, Readers]:
    """The owner's controls and the readers of their rules (the agent fills in ``task_cpu``)."""
    readers = Readers(
        pause=pause_reader,
        on_battery=sensors.on_battery,
        idle_seconds=sensors.seat_idle_seconds,
        host_cpu=sensors.host_cpu_times,
    )
    return Controls(Rules.from_settings(settings), readers, edges.clock), readers


def _courtesy(settings: Settings, edges: _Edges, running: _Running) -> CourtesyWatch:
    """The owner's courtesy rules (a GPU wanted back, heat, power); without NVML, no GPU to read
    or cap."""
    nvml = edges.nvml
    readers = CourtesyReaders(
        cpu_temperature=sensors.cpu_temperature, process_name=sensors.process_name
    )
    power = None
    if nvml is not None:
        readers = replace(readers, processes=nvml.processes, temperature=nvml.temperature)
        power = PowerCap(nvml, settings.state_dir, running.power_percent)
    return CourtesyWatch(
        CourtesyRules.from_settings(settings), readers, edges.clock, edges.gpus, power
    )


def _health(accepted: frozenset[str]) -> Callable[[Settings], list[str]]:
    def health(current: Settings) -> list[str]:
        """The quarantine's check: the preflight's problems, but those the owner started with."""
        found = preflight.problems(current)
        return [p.line() for p in found if p.fatal or p.what not in accepted]

    return health


def _usage_ring(settings: Settings, edges: _Edges) -> UsageRing | None:
    """The console's record of recent use (kept in the state dir across restarts), when the
    console is served."""
    if settings.ui_listen is None:
        return None
    from flashnode.console.usage import UsageRing

    return UsageRing(gpu=lambda: _gpu_percent(edges.nvml, edges.gpus), state_dir=settings.state_dir)


def _log_start(settings: Settings, node: str, slots: int, config_file: Path | None) -> None:
    log.info(
        "flashnode %s: node %s, %s runner, %d slot(s), pools %s, coordinator %s",
        __version__,
        node,
        settings.runner,
        slots,
        ",".join(settings.pools) or "-",
        settings.coordinator,
    )
    for key, table in top_level_runner_keys(config_file) if config_file is not None else []:
        log.warning(
            "%s: %s at the top level is read for this release only: move it into the [%s]"
            " table, at the end of the file",
            config_file,
            key,
            table,
        )


_Handler = Callable[[int, FrameType | None], Any]


def _install_signals(
    agent: Agent, pause_reader: pausefile.PauseReader
) -> list[tuple[int, _Handler | int | None]]:
    """The agent's signal handlers installed (each only sets a flag or a request); the handlers
    they replaced, to put back when the agent has stopped."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        agent.request_stop()

    def on_drain(signum: int, frame: FrameType | None) -> None:
        agent.request_drain()

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        agent.request_reload()

    def on_pause(mode: PauseMode) -> Callable[[int, FrameType | None], None]:
        return lambda signum, frame: pause_reader.signalled(Pause(mode, None, time.time()))

    def on_resume(signum: int, frame: FrameType | None) -> None:
        pause_reader.signalled(None)

    handlers: list[tuple[int, Callable[[int, FrameType | None], None]]] = [
        (signal.SIGTERM, on_signal),
        (signal.SIGINT, on_signal),
        (signal.SIGHUP, on_hangup),
        # `flashnode pause` and `resume` on a full disk, where the pause file cannot be written.
        (pausefile.SIGNALS["pause"], on_pause("drain")),
        (pausefile.SIGNALS["pause_now"], on_pause("now")),
        (pausefile.SIGNALS["resume"], on_resume),
        (SIGNALS["drain"], on_drain),  # `flashnode drain`
    ]
    return [(sig, signal.signal(sig, handler)) for sig, handler in handlers]
