"""The run: start the task through the runner, wait for it (its exit, its timeout, a cancel, a
lost lease, its files outgrowing their caps, the state dir's disk filling up, an owner control
suspending it), sample it, and turn how it ended into evidence and, when it did not succeed, the
reason.

The task's disk (``attempt.diskwatch``): its caps are set when it starts (``task_disk_bytes``
and ``task_disk_files``, or what the state dir's disk has free above ``min_free_bytes`` if that
is less: past such a cap, the lease lapses) and watched while it runs, and looked at once more
when it has ended (nothing of it running then): the walk of its files every ``WATCH_S``, less
often when a walk is slow (a tree of many files), so that it never takes more than a small share
of the agent's time; between walks, the disk's free space and inodes, and a walk at once, the
task frozen meanwhile, when the disk lost half of what the task may still write. A task past a
cap is killed at once (writing on would take more). A full disk the task's own files do not
explain is the node's fault (``DiskFull``: the lease is left to lapse): the task is stopped as
soon as it is seen, and a task that failed while the disk was full is taken to have failed
because of it.

Suspension (``Attempt.request_suspension``: the loop's owner controls, the courtesy's owner's use
of a GPU and heat): the task is frozen through its runner and resumed once no source asks; time
suspended does not count against the task's timeout nor as its running time in its evidence
(its GPU is not sampled meanwhile), and the lease keeper keeps renewing meanwhile. Each pause is
recorded (when, how long, why: the ledger's ``pauses``). A suspension longer than
``max_suspend_seconds`` (default: the lease's window, ``lease_seconds``) stops the task and gives
the lease back (``AttemptLapsed``: not the task's fault), so that no lease sits frozen for hours
while other nodes could run it: each source from when it asked, the owner's use of the task's
GPU ``gpu_yield_stop_seconds`` longer (the courtesy stops the task at that; this bounds one that
failed to). A task that cannot be suspended is ended the same way: the owner's rule wins."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from flashnode.attempt.diskwatch import DiskWatch, Look, full_disk, over_caps
from flashnode.attempt.phases.data import still_lent
from flashnode.attempt.phases.relay import Relay
from flashnode.attempt.record import State
from flashnode.coordinator.messages import ExecutionEvidence
from flashnode.errors import AttemptFailed, AttemptLapsed, Detached, Stopped
from flashnode.evidence.sampler import Sampler, task_cpu_percent
from flashnode.runners import plan as plans
from flashnode.runners.base import Handle, RunResult, SuspendFailed
from flashnode.sandbox import outputs

if TYPE_CHECKING:
    from collections.abc import Sequence

    from flashnode.attempt.diskwatch import DiskCaps
    from flashnode.attempt.hooks import AttemptHooks
    from flashnode.attempt.record import Staged
    from flashnode.evidence.sampler import CpuWindow
    from flashnode.runners.plan import Contribution
    from flashnode.sandbox.diskuse import Space
    from flashnode.sandbox.outputs import Usage
    from flashnode.sandbox.workspace import Workspace

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the task's files are walked
WATCH_COST = 20  # ... or at most 1/WATCH_COST of the time: the next watch waits that many walks
LOST_GRACE_S = 1.0  # at most this long for a task whose lease is lost, or on a full disk
PAUSES_KEPT = 20  # the pauses an attempt's record lists (all are counted)


def run(
    a: AttemptHooks, staged: Staged, contributions: Sequence[Contribution]
) -> ExecutionEvidence:
    """The task run to its end, started by the plan resolved from what the phases before
    contributed (its module spec written first); the evidence of a run that ended well (also in
    the record)."""
    lease, task, ws = staged.lease, staged.task, staged.workspace
    ctx, s = a.ctx, a.ctx.settings
    timeout = min(task.timeout_seconds or s.max_task_seconds, s.max_task_seconds)
    cpu = ctx.cpu_window()

    def record(identity: dict[str, Any]) -> None:
        a.record.process, a.record.task_uid = identity, ws.task_uid
        a.record.task_started_at = ctx.clock.wall()
        a.record.gpus = [d.visible for d in a.devices]
        a.save(State.RUNNING)

    space, use = ctx.space(), outputs.usage(ws)
    caps = ctx.reserved.start(a.lease_id, s, use, space)  # released in ``release``
    facts = ctx.runner.facts(ws, a.record.slot)
    plan = plans.resolve(
        task,
        lease,
        a.record.slot,
        ws,
        facts,
        contributions,
        gpus=a.devices,
        gpu_node=bool(ctx.gpus.devices),
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
        a.handle = handle = ctx.runner.start(plan)
    if a.keeper is not None:
        a.lease_renewed(a.keeper.deadline - ctx.clock.monotonic())
    return _watch(a, staged, handle, (space, use, caps), timeout, cpu, launched)


def rejoin(a: AttemptHooks, staged: Staged, handle: Handle) -> ExecutionEvidence:
    """The task an earlier run of the agent started and let go of, rejoined (``handle``):
    watched from here to its end as ``run`` watches it, its timeout counted from its start, its
    checkpoints relayed on from the newest one shipped."""
    ctx, s, task, ws = a.ctx, a.ctx.settings, staged.task, staged.workspace
    timeout = min(task.timeout_seconds or s.max_task_seconds, s.max_task_seconds)
    cpu = ctx.cpu_window()
    space, use = ctx.space(), outputs.usage(ws)
    caps = ctx.reserved.start(a.lease_id, s, use, space)  # released in ``release``
    if task.checkpoint is not None:
        a.during_run.append(Relay(a, staged, a.record.relayed))
    started = a.record.task_started_at
    # Its pauses before the restart are neither its running time nor against its timeout.
    paused = a.record.timings.get("suspended", 0.0)
    ran = max(ctx.clock.wall() - started - paused, 0.0) if started is not None else 0.0
    cpu.start()
    return _watch(a, staged, handle, (space, use, caps), timeout, cpu, ctx.clock.monotonic(), ran)


def _watch(
    a: AttemptHooks,
    staged: Staged,
    handle: Handle,
    disk: tuple[Space | None, Usage, DiskCaps],
    timeout: float,
    cpu: CpuWindow,
    launched: float,
    ran: float = 0.0,
) -> ExecutionEvidence:
    """From the task's start (``ran`` seconds ago: it was rejoined) to its end, sampled and
    watched; its evidence once it ended well."""
    ctx, s, lease, ws = a.ctx, a.ctx.settings, staged.lease, staged.workspace
    space, use, caps = disk
    cores = os.cpu_count() or 1
    sampler = Sampler(
        ctx.clock,
        s.sample_seconds,
        handle,
        ctx.gpu,
        ctx.gpus.devices,
        a.devices,
        cpu=handle.cpu_seconds,
        cores=cores,
        paused=lambda: a.suspended_since is not None,
    )
    ctx.start_thread(sampler.run, f"sampler-{a.lease_id}")
    a.usage = sampler.live
    for watcher in a.during_run:
        watcher.start(a)
    log.info("lease %s: running (%s runner, timeout %g s)", a.lease_id, ctx.runner.name, timeout)
    t0, cpu0 = sampler.cpu_start
    if ran:  # its CPU so far is all its own, over all the time it ran
        t0, cpu0 = t0 - ran, 0.0
    stopped: Exception | None = None
    first = Look(space, use.disk_bytes, use.disk_files) if space is not None else None
    max_suspend = s.max_suspend_seconds or lease.window
    waited = _Wait(a, handle, ws, timeout, max_suspend, t0, DiskWatch(caps, first, launched))
    waited.before = a.record.timings.get("suspended", 0.0)  # a rejoined task's, before
    try:
        with a.timed("execute.wait", phase=False):
            stopped = waited.run()
        if isinstance(stopped, Detached):
            raise stopped
        wall = ctx.clock.monotonic() - t0
        with a.timed("execute.result", phase=False):
            host_gpu, task_gpu = sampler.finish()
            task_cpu = handle.cpu_seconds()
            a.result = result = handle.result()
    finally:
        waited.end_pause(ctx.clock.monotonic())
        a.suspended_since = None
        a.usage = None
        sampler.finish()
        for watcher in a.during_run:
            if isinstance(stopped, Detached):
                watcher.stop()
            else:
                watcher.finish(a)
    suspended = waited.suspended_total(t0 + wall)
    active = wall - suspended
    if suspended + waited.before > 0:
        a.record.timings["suspended"] = round(suspended + waited.before, 4)
    if a.pauses:
        a.facts["pauses"] = {
            "count": waited.pause_count,
            "seconds": round(suspended + waited.before, 1),
            "list": a.pauses[-PAUSES_KEPT:],
        }
    a.record.task_usage = {
        # Over the time the task could run (a suspension is not the task idling), and from the
        # moment it was handed over: the CPU of its launch is not its own.
        "cpu_percent_mean": task_cpu_percent(
            None if task_cpu is None else task_cpu - (cpu0 or 0.0), active, cores
        ),
        "gpu_util_percent_mean": task_gpu,
    }
    a.record.evidence = evidence = ExecutionEvidence(
        wall_seconds=round(active, 4),  # its running time: pauses are not the task's
        cpu_percent_mean=cpu.stop(),
        gpu_util_percent_mean=host_gpu,
        image_digest=result.image_digest,
        exit_code=result.status,
    )
    a.check()
    if stopped is not None:
        raise stopped
    # What it left, with nothing of it running any more: written faster than a watch.
    over = over_caps(outputs.usage(ws), 0, s, caps)
    if over is not None:
        raise over
    if result.status != 0 or result.cause or result.oom:
        full = full_disk(ctx.space())  # what made it fail, most likely: the node's fault
        if full is not None:
            raise full
    _verdict(result)
    return evidence


class _Wait:
    """Until the main process exits; stops it (and says why) on a lost lease, a cancel, the
    timeout, files past their caps, a full disk, or a suspension that lasts too long."""

    def __init__(
        self,
        a: AttemptHooks,
        handle: Handle,
        ws: Workspace,
        timeout: float,
        max_suspend: float,
        t0: float,
        disk: DiskWatch,
    ) -> None:
        self.a, self.handle, self.ws, self.timeout, self.disk = a, handle, ws, timeout, disk
        self.deadline = t0 + timeout
        self.next_watch = t0 + WATCH_S
        self.next_space = t0
        self.max_suspend = max_suspend
        self.suspended_at: float | None = None
        self._suspended = 0.0  # seconds suspended before the present suspension
        self._why = ""  # why the present suspension began
        self.pause_count = 0
        self.before = 0.0  # seconds suspended before a restart (a rejoined task's)

    def suspended_total(self, now: float) -> float:
        ongoing = now - self.suspended_at if self.suspended_at is not None else 0.0
        return self._suspended + ongoing

    def end_pause(self, now: float) -> None:
        """The present suspension, if any, into the attempt's list of pauses."""
        if self.suspended_at is None:
            return
        a, held = self.a, now - self.suspended_at
        self.pause_count += 1
        wall = a.ctx.clock.wall() - held
        a.pauses.append({"at": round(wall, 1), "seconds": round(held, 1), "why": self._why})
        del a.pauses[:-PAUSES_KEPT]

    def run(self) -> Exception | None:
        a, handle = self.a, self.handle
        ctx, s = a.ctx, a.ctx.settings
        while not handle.exited():
            now = ctx.clock.monotonic()
            if a.keeper is not None and a.keeper.lost.is_set():
                handle.terminate(min(s.kill_grace_seconds, LOST_GRACE_S))
                return None
            if a.detaching and handle.detach():
                log.info("lease %s: its task runs on for the next agent", a.lease_id)
                if self.suspended_at is not None:  # not its running time after the rejoin
                    self._keep_suspended(self._suspended + now - self.suspended_at)
                return Detached()
            if a.cancelled is not None:
                handle.terminate(a.cancel_grace)
                return a.cancelled
            ending = self._suspension(now)
            if ending is not None:
                handle.terminate(s.kill_grace_seconds)
                return ending
            if self.suspended_at is None and now >= self.deadline:
                handle.terminate(s.kill_grace_seconds)
                return AttemptFailed(f"timed out after {self.timeout:g} s")
            if now >= self.next_space:
                space = ctx.space()
                if self.disk.sample(now, space):
                    looked = self._look(frozen=True)
                    if looked is not None:
                        return looked
                    space = self.disk.last.space if self.disk.last else space
                self.next_space = ctx.clock.monotonic() + self.disk.next_in(space)
            if now >= self.next_watch:
                looked = self._look(frozen=self.disk.risky(ctx.space()))
                if looked is not None:
                    return looked
            until = min(self.next_watch, self.next_space) if self.disk.last else self.next_watch
            too_long = self._too_long_at()
            # Suspended, the timeout waits (it moves on by the time suspended).
            until = min(until, self.deadline if too_long is None else too_long)
            ctx.clock.wait(a.wake, until - ctx.clock.monotonic())
            a.wake.clear()
        return None

    def _look(self, frozen: bool) -> AttemptFailed | AttemptLapsed | None:
        """Walk the task's files (frozen meanwhile, where it can be and is not suspended
        already) and read the disk; the ending when a cap is passed (the task is killed: it
        must not write on) or the disk is full and the task's files do not explain it."""
        a, handle = self.a, self.handle
        clock, s = a.ctx.clock, a.ctx.settings
        froze = False
        if frozen and self.suspended_at is None:
            try:
                handle.suspend()
                froze = True
            except SuspendFailed as exc:  # walked all the same, only not frozen
                log.warning("lease %s: %s, to measure its files", a.lease_id, exc)
        started = clock.monotonic()
        try:
            space = a.ctx.space()  # first: what the task writes during the walk counts twice
            usage, held = outputs.usage(self.ws), handle.disk_bytes()
        except (AttemptFailed, AttemptLapsed) as exc:
            handle.terminate(0.0)
            return exc
        over = over_caps(usage, held, s, self.disk.caps, "; the task was stopped")
        if over is not None:
            handle.terminate(0.0)
            return over
        look = Look(space, usage.disk_bytes + held, usage.disk_files) if space else None
        if frozen:
            full = full_disk(space)  # within its caps, the task cannot have filled it
            if full is not None:
                handle.terminate(min(s.kill_grace_seconds, LOST_GRACE_S))
                return full
        if froze and look is not None:
            outrun = self.disk.outrun(look, started, s, "; the task was stopped")
            if outrun is not None:
                handle.terminate(0.0)
                return outrun
        after = a.ctx.space() if look is not None else None
        if froze:
            try:
                handle.resume()
            except SuspendFailed as exc:
                handle.terminate(0.0)
                return AttemptLapsed(f"{exc}, after its files were measured")
        now = clock.monotonic()
        if look is not None:
            still = froze or self.suspended_at is not None  # it made nothing meanwhile
            self.disk.walked(look, started, now, after, still)
        self.a.ctx.reserved.held(self.a.lease_id, usage.disk_bytes + held, usage.disk_files)
        self.next_watch = now + max(WATCH_S, (now - started) * WATCH_COST)
        return None

    def _suspension(self, now: float) -> AttemptLapsed | None:
        """Suspend or resume as the owner's controls ask; the ending of a suspension that
        lasted too long or could not be done."""
        a, handle = self.a, self.handle
        reason = a.suspend_reason
        if reason is not None and self.suspended_at is None:
            try:
                handle.suspend()
            except SuspendFailed as exc:
                log.error("lease %s: %s", a.lease_id, exc)
                return Stopped(f"{exc}, while asked to suspend it ({reason})")
            self.suspended_at = now
            a.suspended_since = now
            self._why = reason
            log.info("lease %s: task suspended: %s", a.lease_id, reason)
        elif reason is None and self.suspended_at is not None:
            held = now - self.suspended_at
            try:
                handle.resume()
            except SuspendFailed as exc:
                log.error("lease %s: %s", a.lease_id, exc)
                return Stopped(str(exc))
            self._suspended += held
            self.deadline += held  # suspended time does not count against the timeout
            self.end_pause(now)
            self.suspended_at = None
            self._keep_suspended(self._suspended)
            a.suspended_since = None
            log.info("lease %s: task resumed after %.0f s suspended", a.lease_id, held)
        too_long = self._too_long_at()
        if too_long is not None and now >= too_long:
            limit = too_long - (self.suspended_at or too_long)
            return Stopped(
                f"suspended for longer than {limit:g} s"
                f" ({a.suspend_reason or 'released just now'}); the lease lapses"
            )
        return None

    def _keep_suspended(self, seconds: float) -> None:
        """Its time suspended so far (``seconds`` in this run), in its record: a restart
        counts it neither as its running time nor against its timeout."""
        a = self.a
        a.record.timings["suspended"] = round(self.before + seconds, 4)
        try:
            a.save(State.RUNNING)
        except OSError as exc:  # a full disk: only a restart's count would be off
            log.warning("lease %s: cannot keep its time suspended: %s", a.lease_id, exc)

    def _too_long_at(self) -> float | None:
        """When the present suspension has lasted too long (monotonic); None while the task
        runs. Each source bounds its own time: ``max_suspend`` from when it asked (or the
        suspension began), the owner's use of the GPU ``gpu_yield_stop_seconds`` more (the
        courtesy stops the task at that; this only bounds a courtesy that failed to)."""
        began = self.suspended_at
        if began is None:
            return None
        sources = self.a.suspend_sources or {"owner": began}  # released: resumed next turn
        stop = self.a.ctx.settings.gpu_yield_stop_seconds
        return min(
            max(since, began) + self.max_suspend + (stop if source == "gpu" else 0.0)
            for source, since in sources.items()
        )


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


def release(a: AttemptHooks) -> None:
    """Whatever way the attempt ends: nothing of the task left running, its GPUs free again."""
    try:
        if a.handle is not None and a.result is None:
            a.handle.terminate(0.0)
            a.result = a.handle.result()
    finally:
        a.ctx.gpus.release(a.devices)
        a.ctx.reserved.end(a.lease_id)


def _last_lines(text: str, n: int = 5) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])
