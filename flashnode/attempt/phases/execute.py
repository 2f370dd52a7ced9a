"""The run: start the task through the runner, guard it while it runs, sample it, and turn how
it ended into evidence and, when it did not succeed, the reason.

While it runs, its guards (``attempt/guards/``, built for each task here) watch it: a lost lease,
the agent's restart, a cancel, the owner's suspension and its bound, its timeout, its disk, and
any the wiring adds; the first that ends it says why and whose fault it is. Its caps on disk are
set when it starts (``attempt/diskwatch.py``) and what it left is looked at once more when it has
ended (nothing of it running then): a full disk the task's own files do not explain is the
node's fault, and a task that failed while the disk was full is taken to have failed because of
it. Time paused does not count against the task's timeout nor as its running time in its
evidence (its GPU is not sampled meanwhile); each pause is recorded (when, how long, why: the
ledger's ``pauses``)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from flashnode.attempt.diskwatch import DiskWatch, Look, full_disk, over_caps
from flashnode.attempt.guards.base import Beside, End, Guard
from flashnode.attempt.guards.cancel import CancelGuard
from flashnode.attempt.guards.disk import DiskGuard
from flashnode.attempt.guards.lease import LeaseGuard
from flashnode.attempt.guards.restart import RestartGuard
from flashnode.attempt.guards.sampling import SamplingGuard
from flashnode.attempt.guards.supervisor import Supervisor
from flashnode.attempt.guards.suspension import SuspensionGuard
from flashnode.attempt.guards.timeout import TimeoutGuard
from flashnode.attempt.phases.data import still_lent
from flashnode.attempt.phases.relay import Relay
from flashnode.coordinator.messages import ExecutionEvidence
from flashnode.errors import AttemptFailed, AttemptLapsed, Detached
from flashnode.evidence.sampler import Sampler, task_cpu_percent
from flashnode.runners import plan as plans
from flashnode.runners.base import Handle, RunResult
from flashnode.runners.registry import capabilities
from flashnode.sandbox import outputs
from flashnode.sandbox.progress import newest_metrics_step

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from flashnode.attempt.diskwatch import DiskCaps
    from flashnode.attempt.hooks import AttemptView
    from flashnode.attempt.record import Staged
    from flashnode.evidence.sampler import CpuWindow
    from flashnode.runners.plan import Contribution
    from flashnode.sandbox.diskuse import Space
    from flashnode.sandbox.outputs import Usage
    from flashnode.sandbox.workspace import Workspace

log = logging.getLogger(__name__)


def run(a: AttemptView, staged: Staged, contributions: Sequence[Contribution]) -> ExecutionEvidence:
    """The task run to its end, started by the plan resolved from what the phases before
    contributed (its module spec written first); the evidence of a run that ended well (also in
    the record)."""
    lease, task, ws = staged.lease, staged.task, staged.workspace
    ctx, s = a.ctx, a.ctx.settings
    timeout = min(task.timeout_seconds or s.max_task_seconds, s.max_task_seconds)
    cpu = ctx.cpu_window()

    def record(identity: dict[str, Any]) -> None:
        a.started(identity, ws.task_uid)

    space, use = ctx.space(), outputs.usage(ws)
    caps = ctx.reserved.start(a.lease_id, s, use, space)  # released in ``release``
    facts, abilities = ctx.runner.facts(ws, a.record.slot), capabilities(s)
    plan = plans.resolve(
        task,
        lease,
        a.record.slot,
        ws,
        facts,
        contributions,
        gpus=a.devices,
        gpu_node=bool(ctx.gpus.devices),
        renumbered=abilities.gpu_addressing == "renumbered",
        limits=ctx.limits,
        on_exit=a.wake.set,
        record=record,
        max_file_bytes=caps.bytes + 1,  # a file that size is past the cap already
    )
    plans.write_module_spec(plan, facts.group)
    still_lent(a, plan.views)  # a fetch since the views were made can take an hour
    a.check()
    cpu.start()
    launched = ctx.clock.monotonic()  # the task may make files from here on
    with a.timed("execute.start", phase=False):
        handle = ctx.runner.start(plan)
        a.running(handle, None)
    if a.keeper is not None:
        a.lease_renewed(a.keeper.deadline - ctx.clock.monotonic())
    return _watch(a, staged, handle, (space, use, caps), timeout, cpu, launched)


def rejoin(a: AttemptView, staged: Staged, handle: Handle) -> ExecutionEvidence:
    """The task an earlier run of the agent started and let go of, rejoined (``handle``):
    watched from here to its end as ``run`` watches it, its timeout counted from its start, its
    checkpoints relayed on from the newest one shipped."""
    ctx, s, task, ws = a.ctx, a.ctx.settings, staged.task, staged.workspace
    timeout = min(task.timeout_seconds or s.max_task_seconds, s.max_task_seconds)
    cpu = ctx.cpu_window()
    space, use = ctx.space(), outputs.usage(ws)
    caps = ctx.reserved.start(a.lease_id, s, use, space)  # released in ``release``
    if task.checkpoint is not None:
        a.beside(Relay(a, staged, a.record.relayed))
    started = a.record.task_started_at
    # Its pauses before the restart are neither its running time nor against its timeout, nor
    # the time it stayed frozen since the agent let go of it paused (its runner's rejoin just
    # let it run again).
    paused = a.record.timings.get("suspended", 0.0)
    frozen_at = a.record.timings.get("frozen_at")
    if frozen_at is not None:
        paused += max(ctx.clock.wall() - frozen_at, 0.0)
        a.keep_paused(paused)
    ran = max(ctx.clock.wall() - started - paused, 0.0) if started is not None else 0.0
    cpu.start()
    return _watch(a, staged, handle, (space, use, caps), timeout, cpu, ctx.clock.monotonic(), ran)


def _watch(
    a: AttemptView,
    staged: Staged,
    handle: Handle,
    disk: tuple[Space | None, Usage, DiskCaps],
    timeout: float,
    cpu: CpuWindow,
    launched: float,
    ran: float = 0.0,
) -> ExecutionEvidence:
    """From the task's start (``ran`` seconds ago: it was rejoined) to its end, sampled and
    guarded; its evidence once it ended well."""
    ctx, s, ws = a.ctx, a.ctx.settings, staged.workspace
    cores = os.cpu_count() or 1
    sampler = Sampler(
        ctx.clock,
        handle,
        ctx.gpu,
        ctx.gpus.devices,
        a.devices,
        cpu=handle.cpu_seconds,
        cores=cores,
        paused=lambda: a.suspended_since is not None,
    )
    a.running(handle, sampler.live)
    for watcher in a.during_run:
        watcher.start(a)
    runtime = ctx.runner.runtime(staged.task.pool)
    if runtime is not None:
        a.report("runtime", runtime)  # in its status while it runs, and in its ledger line
    under = f", runtime {runtime}" if runtime is not None else ""
    log.info("running (%s runner%s, timeout %g s)", ctx.runner.name, under, timeout)
    t0, cpu0 = sampler.cpu_start
    if ran:  # its CPU so far is all its own, over all the time it ran
        t0, cpu0 = t0 - ran, 0.0
    before = a.record.timings.get("suspended", 0.0)  # a rejoined task's, before the restart
    guards = _guards(a, staged, disk, timeout, t0, launched)
    progress = _progress(a, ws)

    def sample() -> None:
        sampler.sample()
        progress()

    guards.append(SamplingGuard(sample, s.sample_seconds, ctx.clock.monotonic(), sampler.quiet))
    supervisor = Supervisor(
        handle,
        guards,
        ctx.clock,
        a.wake,
        a,
        s.kill_grace_seconds,
        before,
        # No pause, whichever guards hold it, outlasts the suspension's own longest bound.
        max_paused=(s.max_suspend_seconds or staged.lease.window) + s.gpu_yield_stop_seconds,
        can_pause=capabilities(s).pause,
    )
    ended: End | None = None
    try:
        with a.timed("execute.wait", phase=False):
            ended = supervisor.run()
        if ended is not None and isinstance(ended.why, Detached):
            raise ended.why
        wall = ctx.clock.monotonic() - t0
        with a.timed("execute.result", phase=False):
            host_gpu, task_gpu = sampler.finish()
            task_cpu = handle.cpu_seconds()
            result = handle.result()
            a.ran(result)
    finally:
        supervisor.finish(ctx.clock.monotonic())
        progress()
        if a.result is None:  # not read here: it runs on, or the attempt's end reads it
            a.ran(None)
        sampler.finish()
        for watcher in a.during_run:
            if ended is not None and isinstance(ended.why, Detached):
                watcher.stop()
            else:
                watcher.finish(a)
    suspended = supervisor.paused_total(t0 + wall)
    active = wall - suspended
    task_usage: dict[str, Any] = {
        # Over the time the task could run (a suspension is not the task idling), and from the
        # moment it was handed over: the CPU of its launch is not its own.
        "cpu_percent_mean": task_cpu_percent(
            None if task_cpu is None else task_cpu - (cpu0 or 0.0), active, cores
        ),
        "gpu_util_percent_mean": task_gpu,
    }
    evidence = ExecutionEvidence(
        wall_seconds=round(active, 4),  # its running time: pauses are not the task's
        cpu_percent_mean=cpu.stop(),
        gpu_util_percent_mean=host_gpu,
        image_digest=result.image_digest,
        exit_code=result.status,
    )
    a.evidence(evidence, task_usage, suspended + before, supervisor.pause_count)
    a.check()
    if ended is not None and ended.why is not None:
        raise ended.why
    # What it left, with nothing of it running any more: written faster than a watch.
    over = over_caps(outputs.usage(ws), 0, s, disk[2])
    if over is not None:
        raise over
    if result.status != 0 or result.cause or result.oom:
        full = full_disk(ctx.space())  # what made it fail, most likely: the node's fault
        if full is not None:
            raise full
    _verdict(result)
    return evidence


def _progress(a: AttemptView, ws: Workspace) -> Callable[[], None]:
    """A reading of how far the task says it got (the newest step in its metrics log), reported
    to the live view and the ledger line when it moved."""
    last: list[int | None] = [None]

    def read() -> None:
        step = newest_metrics_step(ws)
        if step is not None and step != last[0]:
            last[0] = step
            a.report("metrics_step", step)

    return read


def _guards(
    a: AttemptView,
    staged: Staged,
    disk: tuple[Space | None, Usage, DiskCaps],
    timeout: float,
    started: float,
    launched: float,
) -> list[Guard]:
    """The task's guards, in the order they are asked: the first to end it says why."""
    ctx, s = a.ctx, a.ctx.settings
    space, use, caps = disk
    first = Look(space, use.disk_bytes, use.disk_files) if space is not None else None
    lease_id, ws, abilities = a.lease_id, staged.workspace, capabilities(s)
    guards: list[Guard] = [
        LeaseGuard(a, s.kill_grace_seconds),
        RestartGuard(a, abilities.reattach),
        CancelGuard(a),
        SuspensionGuard(
            a,
            s.max_suspend_seconds or staged.lease.window,
            s.gpu_yield_stop_seconds,
            s.kill_grace_seconds,
        ),
        TimeoutGuard(started, timeout, s.kill_grace_seconds),
        DiskGuard(
            DiskWatch(caps, first, launched),
            s,
            ctx.clock,
            ctx.space,
            lambda: outputs.usage(ws),
            lambda nbytes, files: ctx.reserved.held(lease_id, nbytes, files),
            started,
            abilities.pause,
        ),
    ]
    beside = Beside(s, staged.lease, a, ctx.clock, started)
    guards += [g for g in (make(beside) for make in ctx.guards) if g is not None]
    return guards


def _verdict(result: RunResult) -> None:
    """Raise the reason a run that did not succeed failed; return for a clean exit."""
    if result.cause:
        if result.node_fault:
            raise AttemptLapsed(result.cause)
        raise AttemptFailed(result.cause)
    if result.oom:
        raise AttemptFailed("out of memory")
    if result.status == 0:
        return
    what = (
        f"killed by signal {result.signal}"
        if result.signal is not None
        else f"exit code {result.exit_code}"
    )
    tail = _last_lines(result.stderr_tail)
    raise AttemptFailed(f"{what}: {tail}" if tail else what)


def release(a: AttemptView) -> None:
    """Whatever way the attempt ends: nothing of the task left running, its GPUs free again."""
    try:
        if a.handle is not None and a.result is None:
            a.handle.terminate(0.0)
            a.ran(a.handle.result())
    finally:
        a.ctx.gpus.release(a.devices)
        a.ctx.reserved.end(a.lease_id)


def _last_lines(text: str, n: int = 5) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])
