"""The run: start the task through the runner, wait for it (its exit, its timeout, a cancel, a
lost lease, its outputs outgrowing their cap), sample it, and turn how it ended into evidence and,
when it did not succeed, the reason."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from flashnode.attempt.record import State
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.runners import spec as specs
from flashnode.runners.base import RunResult
from flashnode.sampler import Sampler
from flashnode.wire import ExecutionEvidence

if TYPE_CHECKING:
    from flashnode.attempt import Attempt

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often out/ is measured against its cap while the task runs
LOST_GRACE_S = 1.0  # at most this long for a task whose lease is lost


def run(a: Attempt) -> None:
    assert a.lease is not None and a.task is not None and a.workspace is not None
    ctx, s = a.ctx, a.ctx.settings
    timeout = min(a.task.timeout_seconds or s.max_task_seconds, s.max_task_seconds)
    cpu = ctx.cpu_window()

    def record(identity: dict[str, Any]) -> None:
        a.save(
            State.RUNNING, process=identity, task_uid=a.workspace.task_uid if a.workspace else None
        )

    start = specs.build(
        a.task,
        a.lease.lease_id,
        a.record.slot,
        a.workspace,
        a.devices,
        bool(ctx.gpus.devices),
        ctx.limits,
        a.wake.set,
        record,
        a.prepared,
    )
    a.check()
    cpu.start()
    a.handle = handle = ctx.runner.start(start)
    sampler = Sampler(ctx.clock, s.sample_seconds, handle, ctx.gpu, ctx.gpus.devices, a.devices)
    ctx.start_thread(sampler.run, f"sampler-{a.lease_id}")
    for watcher in a.during_run:
        watcher.start(a)
    log.info("lease %s: running (%s runner, timeout %g s)", a.lease_id, ctx.runner.name, timeout)
    t0 = ctx.clock.monotonic()
    stopped: Exception | None = None
    try:
        stopped = _wait(a, timeout, t0)
        wall = ctx.clock.monotonic() - t0
        host_gpu, task_gpu = sampler.finish()
        task_cpu = handle.cpu_seconds()
        a.result = result = handle.result()
    finally:
        sampler.finish()
        for watcher in a.during_run:
            watcher.finish(a)
    a.record.task_usage = {
        "cpu_percent_mean": round(task_cpu / wall * 100, 2) if task_cpu and wall > 0 else None,
        "gpu_util_percent_mean": task_gpu,
    }
    a.record.evidence = ExecutionEvidence(
        wall_seconds=round(wall, 4),
        cpu_percent_mean=cpu.stop(),
        gpu_util_percent_mean=host_gpu,
        image_digest=result.image_digest,
        exit_code=result.status,
    )
    a.check()
    if stopped is not None:
        raise stopped
    _verdict(result)


def _wait(a: Attempt, timeout: float, t0: float) -> Exception | None:
    """Until the main process exits; stops it (and says why) on a lost lease, a cancel, the
    timeout or outputs past their cap."""
    assert a.handle is not None and a.workspace is not None
    ctx, s, handle = a.ctx, a.ctx.settings, a.handle
    deadline = t0 + timeout
    next_watch = t0 + WATCH_S
    while not handle.exited():
        now = ctx.clock.monotonic()
        if a.keeper is not None and a.keeper.lost.is_set():
            handle.terminate(min(s.kill_grace_seconds, LOST_GRACE_S))
            return None
        if a.cancelled is not None:
            handle.terminate(a.cancel_grace)
            return a.cancelled
        if now >= deadline:
            handle.terminate(s.kill_grace_seconds)
            return AttemptFailed(f"timed out after {timeout:g} s")
        if now >= next_watch:
            next_watch = now + WATCH_S
            if a.workspace.usage() > s.max_output_total_bytes:
                handle.terminate(s.kill_grace_seconds)
                return AttemptFailed(
                    f"outputs grew past {s.max_output_total_bytes} bytes; the task was stopped"
                )
        ctx.clock.wait(a.wake, min(deadline, next_watch) - now)
        a.wake.clear()
    return None


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


def release(a: Attempt) -> None:
    """Whatever way the attempt ends: nothing of the task left running, its GPUs free again."""
    try:
        if a.handle is not None and a.result is None:
            a.handle.terminate(0.0)
            a.result = a.handle.result()
    finally:
        a.ctx.gpus.release(a.devices)


def _last_lines(text: str, n: int = 5) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])
