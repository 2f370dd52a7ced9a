"""The node loop: register, node heartbeat, claim, hand attempts to slots, drain.

``run`` has three phases, as uvicorn's server does: ``startup`` (reap what an earlier run left,
resume the outbox), the loop, and ``shutdown``, which runs in every case (a drain, a second
signal, refused credentials, a bug) and stops, ends and records every running attempt before the
agent returns.

It imports no edge: the coordinator, the runner, the clock and the way attempts are started are
all given to it, so tests drive it with fakes and a fake clock. Signal handlers (in the CLI) only
call ``request_stop``/``request_reload``; the loop acts on them.

The owner's controls (``controls.py``) are evaluated every turn: the node claims only while no
rule holds; ``flashnode pause --now`` stops running attempts as an ending that is not the task's
fault; a rule named in ``suspend_when`` suspends running tasks until it clears. Heartbeats go on
throughout: a paused node is online and says why it takes no work.

Its parts: ``reload.py`` keeps the configuration (each attempt gets the one it was claimed
under), ``publisher.py`` says what the node does from a frozen ``NodeView`` of it each turn,
``holds.py`` holds claiming for the node's own reasons, ``pacing.py`` says when to talk to the
coordinator next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashnode.attempt import Attempt, AttemptContext, Outcome
from flashnode.attempt.record import State
from flashnode.clock import Clock
from flashnode.config.settings import Settings
from flashnode.coordinator.ids import SAFE_ID
from flashnode.coordinator.messages import NodeHeartbeat, NodeRegistration
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    CoordinatorError,
    CredentialsError,
    Stopped,
    Unregistered,
)
from flashnode.evidence.gpupool import Device
from flashnode.node.controls import Controls
from flashnode.node.decision import Decision
from flashnode.node.guard import Ending
from flashnode.node.holds import NodeHolds
from flashnode.node.pacing import Pacing
from flashnode.node.publisher import NodeView, Problem, Publisher, task_cpu
from flashnode.node.reload import Config, Reloader
from flashnode.node.rules import Rules
from flashnode.owner.status import StatusSink
from flashnode.sandbox.diskuse import Space
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.removal import remove_stale_workspaces

log = logging.getLogger(__name__)

TICK = 0.5  # the longest the loop sleeps before looking at its stop flags
SHUTDOWN_MARGIN_S = 30.0  # for the last reports of stopped attempts


class AgentCoordinator(Protocol):
    def register(self, registration: NodeRegistration) -> str: ...
    def node_heartbeat(self, heartbeat: NodeHeartbeat) -> None: ...
    def claim(self, node_id: str) -> dict[str, Any] | None: ...


@dataclass
class Stats:
    started: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1


class Agent:
    def __init__(
        self,
        ctx: AttemptContext,
        coordinator: AgentCoordinator,
        registration: Callable[[Settings], NodeRegistration],
        clock: Clock | None = None,
        reload: Callable[[], Settings] | None = None,
        space: Callable[[], Space | None] | None = None,
        sink: StatusSink | None = None,
        on_settings: Callable[[Settings, Limits], None] | None = None,
        controls: Controls | None = None,
        health: Callable[[Settings], list[str]] | None = None,
        status_extra: dict[str, Any] | None = None,
        totals: Callable[[], dict[str, Any]] | None = None,
        limits: Callable[[Settings], Limits] | None = None,
    ) -> None:
        """``ctx``: the edges every attempt is given, and the configuration the agent starts
        with (``settings``, ``limits``; after a reload the current one is ``reloader.current``,
        and each attempt is given a copy of ``ctx`` with it). ``reload``: the configuration as
        it is now (for ``request_reload``); ``limits``: the per-task limits of reloaded
        settings (None: they stay); ``on_settings``: what else follows a reload (the caches'
        budgets). ``controls``: the owner's rules (None: none). ``space``: the state dir's
        disk now (default: ``ctx.space``). ``health``: this node's own checks for the given
        settings, as one line per problem (the preflight; none: always healthy).
        ``status_extra``: more for status.json (what owners' commands may use to reach it).
        ``totals``: what this node gave, today and all time (from the ledger: it survives
        restarts), for status.json. Counts go to ``ctx.metrics``."""
        self.ctx = ctx
        self.controls = controls
        self.metrics = ctx.metrics
        self.decision = Decision()  # the owner controls' latest word
        self.coordinator = coordinator
        self.registration = registration
        self.clock = clock or ctx.clock
        self._wake = threading.Event()
        self.reloader = Reloader(
            Config(ctx.settings, ctx.limits),
            self.clock,
            ctx.start_thread,
            read=reload,
            limits=limits,
            prepare=ctx.runner.reconfigure,
            applied=self._reloaded,
            wake=self._wake.set,
        )
        self._on_settings = on_settings
        self.publisher = Publisher(self.clock, sink, status_extra, totals)
        self.sink = self.publisher.sink
        self.pacing = Pacing(ctx.settings, ctx.rng)  # when to talk to the coordinator next
        # The node's own holds: the black-hole guard, the backoff after a revoked lease, the disk.
        self.holds = NodeHolds(
            ctx.settings,
            self.clock,
            ctx.rng,
            space or ctx.space,
            ctx.reserved,
            health,
            ctx.start_thread,
            ctx.later,
            self._wake.set,
        )
        self.node_id = ""
        self._slots_made = effective_slots(ctx.settings, len(ctx.gpus.devices))
        self.stats = Stats()
        self.running: dict[int, Attempt] = {}
        self._lock = threading.Lock()
        self._registered = False
        self._problems: dict[str, Problem] = {}  # the failing conversations with the coordinator
        self._beats = 0
        self._last_beat_wall: float | None = None
        self._last_ended: dict[str, Any] | None = None  # the latest attempt's end, for status
        self._started_wall = self.clock.wall()
        self._next_heartbeat = 0.0
        self._next_claim = 0.0
        self._next_register = 0.0
        self._draining = False
        self._drain_started = False
        self._drain_deadline = 0.0
        self._extend_at = 0.0
        self._stop_now = False

    @property
    def settings(self) -> Settings:
        """The settings the next claim runs under (a reload swaps them)."""
        return self.reloader.current.settings

    # --- control (safe to call from a signal handler: sets flags only) ------------------------

    def request_stop(self) -> None:
        """First call: drain. Second call: stop now, still cleaning up."""
        if self._draining:
            self._stop_now = True
        self._draining = True

    def request_reload(self) -> None:
        """Re-read the configuration (pools, limits) and register again."""
        self.reloader.request()

    # --- the three phases ---------------------------------------------------------------------

    def run(self) -> None:
        """Run until drained, stopped, or ``max_tasks`` attempts have finished. Refused
        credentials end the loop and are raised again once every attempt is stopped."""
        self.startup()
        fatal: BaseException | None = None
        try:
            self._loop()
        except CredentialsError as exc:
            log.error("the coordinator refused this node's credentials: %s", exc)
            fatal = exc
        except BaseException as exc:
            fatal = exc
            raise
        finally:
            self.shutdown(fatal is not None)
        if fatal is not None:
            raise fatal

    def startup(self) -> None:
        """Before any claim: reap what an earlier run of this agent left running, commit the
        results it finished (the outbox), let the rest lapse, and remove workspaces no record
        names."""
        outbox = self.ctx.outbox
        for lease_id in outbox.leases():
            try:
                self._recover(lease_id)
            except Exception:  # one bad leftover must not keep the agent from starting
                log.exception("lease %s: recovery failed; dropping its record", lease_id)
                outbox.remove(lease_id)
        try:
            self.ctx.runner.reconcile()
            keep = set(outbox.leases())
            stale = remove_stale_workspaces(self.settings.state_dir / "attempts", keep=keep)
            for lease_id in stale:  # ended by a crash before its task started: no record
                self._ledger_lapsed(lease_id, "agent restarted before the task started")
        except Exception:
            log.exception("cleaning up after an earlier run failed")
        self.sink.send(READY=1)

    def _recover(self, lease_id: str) -> None:
        outbox = self.ctx.outbox
        record = outbox.read(lease_id)
        if record is None:
            outbox.remove(lease_id)
            return
        if record.process:
            self.ctx.runner.reap(record.process)
        attempt = Attempt(self._context(), record.lease, record.slot, record=record)
        if record.state is State.FINISHED:
            outcome = attempt.resume()
        else:
            outcome = attempt.abandon("agent restarted")
        self.stats.count(outcome)

    def _ledger_lapsed(self, lease_id: str, reason: str) -> None:
        if not SAFE_ID.match(lease_id):
            return
        log.warning("lease %s: %s; letting its lease lapse", lease_id, reason)
        entry = {"lease_id": lease_id, "outcome": Outcome.LAPSED.value, "reason": reason}
        try:
            self.ctx.ledger.append({**entry, "ended_at": self.clock.wall()})
        except OSError as exc:
            log.error("lease %s: cannot write the ledger: %s", lease_id, exc)
        self.stats.count(Outcome.LAPSED)

    def _loop(self) -> None:
        while True:
            self.sink.tick()
            now = self.clock.monotonic()
            self._drain_tick(now)
            self._owner_controls()
            if self.ctx.ledger.pending:  # lines a full disk kept back
                self.ctx.ledger.flush()
            if self._stop_now:
                self._cancel_all(Stopped("agent stopping"), grace=0.0)
            elif self._draining and now >= self._drain_deadline:
                self._cancel_all(Stopped("node draining"), self.settings.kill_grace_seconds)
            if not self.running and (self._draining or self._quota_spent()):
                return
            self.reloader.tick()
            if not self._registered:
                if now >= self._next_register:
                    self._register()
            else:
                if now >= self._next_heartbeat:
                    self._heartbeat()
                if self._may_claim() and now >= self._next_claim:
                    self._claim()
                    self._publish()
                    continue
            self._publish()
            wake_at = self._next_heartbeat if self._registered else self._next_register
            if self._may_claim():
                wake_at = min(wake_at, self._next_claim)
            self.clock.wait(self._wake, min(max(wake_at - now, 0.0), TICK))
            self._wake.clear()

    def shutdown(self, abrupt: bool = False) -> None:
        """Stop every running attempt (left to lapse: not the tasks' fault), wait for each to
        end and be recorded, say goodbye to the coordinator, publish the final status."""
        s = self.settings
        left = self._attempts()
        if left:
            log.info("stopping %d running attempt(s)", len(left))
            self._cancel_all(Stopped("agent stopping"), 0.0 if abrupt else s.kill_grace_seconds)
            deadline = self.clock.monotonic() + s.kill_grace_seconds + SHUTDOWN_MARGIN_S
            while self.running and self.clock.monotonic() < deadline:
                self.sink.tick()
                self.clock.wait(self._wake, TICK)
                self._wake.clear()
            if self.running:
                log.error("%d attempt(s) did not end in time", len(self.running))
        if self._registered and not abrupt:
            with contextlib.suppress(CoordinatorError, CredentialsError):
                self.coordinator.node_heartbeat(
                    NodeHeartbeat(node_id=self.node_id, status="terminating")
                )
        try:
            self.ctx.runner.close()
        except Exception:  # the last status and log line must still be written
            log.exception("closing the runner failed")
        self._publish(final=True)
        log.info("agent stopped: %s", self.stats.outcomes)

    # --- the owner's controls and the node's own holds -----------------------------------------

    def _owner_controls(self) -> None:
        """Evaluate the owner's rules; stop or suspend running attempts as they say. Add the
        node's own holds (a full disk, the quarantine, the backoff after a revoked lease): they
        hold claiming and say why, but stop or suspend nothing."""
        d = self.controls.evaluate() if self.controls else Decision()
        self.decision = d.holding(*self.holds.holds(self.settings))
        attempts = self._attempts()
        for attempt in attempts:
            # Not the task's fault: the lease lapses, no `fail`. A finished result (its
            # task ran, its outputs are spooled) is still committed: the pause stops tasks.
            if d.stop_reason and attempt.record.state is not State.FINISHED:
                attempt.cancel(Stopped(d.stop_reason), self.settings.kill_grace_seconds)
            attempt.request_suspension(d.suspend_reason)
        suspended = sum(a.suspended_since is not None for a in attempts)
        self.metrics.set_running(len(attempts), suspended)
        self.metrics.set_controls(d.paused is not None, [h.rule for h in self.decision.holds])

    def task_cpu(self) -> dict[str, float] | None:
        """Cumulative CPU seconds of every running attempt's task (for the ``load`` rule)."""
        with self._lock:
            attempts = list(self.running.items())
        return task_cpu(attempts)

    # --- reload -------------------------------------------------------------------------------

    def _reloaded(self, config: Config) -> None:
        """A reload applied (on the reload's thread): the node's parts take the new settings,
        and the node registers again (its pools may have changed)."""
        new = config.settings
        self.holds.reconfigure(new)
        if self.controls is not None:
            self.controls.reconfigure(Rules.from_settings(new))
        if self._on_settings is not None:
            self._on_settings(new, config.limits)
        log.info("configuration reloaded: pools %s; registering again", ",".join(new.pools) or "-")
        self._registered = False
        self._next_register = self._next_claim = 0.0

    def _context(self) -> AttemptContext:
        """What an attempt is given: the agent's edges and the configuration current now, which
        it keeps whatever reload comes while it runs."""
        config = self.reloader.current
        return dataclasses.replace(
            self.ctx,
            settings=config.settings,
            limits=config.limits,
            lent_now=lambda: self.reloader.current.settings.local_data,
        )

    # --- draining -----------------------------------------------------------------------------

    def _drain_tick(self, now: float) -> None:
        s = self.settings
        if self._draining and not self._drain_started:
            self._drain_started = True
            self._drain_deadline = now + s.drain_seconds
            log.info("draining: no new claims; %d attempt(s) running", len(self.running))
            self.sink.send(STOPPING=1)
            self._next_heartbeat = now
        if self._draining and now >= self._extend_at:
            # Tell systemd the stop takes longer: what is left of the drain, the kill grace,
            # and a margin for the last commits.
            left = max(self._drain_deadline - now, 0.0) + s.kill_grace_seconds + SHUTDOWN_MARGIN_S
            self.sink.send(EXTEND_TIMEOUT_USEC=int(left * 1e6))
            self._extend_at = now + 5

    # --- what the agent is doing ---------------------------------------------------------------

    def _publish(self, final: bool = False) -> None:
        self.publisher.publish(self._view(), final)

    def _view(self) -> NodeView:
        """The node now, frozen for the publisher."""
        running = tuple(a.snapshot() for a in self._attempts() if a.lease is not None)
        return NodeView(
            settings=self.settings,
            node_id=self.node_id,
            registered=self._registered,
            draining=self._draining,
            drain_deadline=self._drain_deadline if self._drain_started else None,
            started_at=self._started_wall,
            beats=self._beats,
            last_heartbeat_at=self._last_beat_wall,
            problems=tuple(self._problems.values()),
            counters=dict(self.stats.outcomes),
            running=running,
            decision=self.decision,
            last_ended=self._last_ended,
            reload_refused=self.reloader.refused,
        )

    # --- claiming -----------------------------------------------------------------------------

    def _attempts(self) -> list[Attempt]:
        with self._lock:
            return list(self.running.values())

    def _quota_spent(self) -> bool:
        m = self.settings.max_tasks
        return m is not None and self.stats.started >= m

    @property
    def slots(self) -> int:
        """Attempts run at once: ``slots``, or with ``auto`` one per GPU (1 without GPUs); never
        more than at the start, for which the runner made its slots (GPUs found later add none)."""
        return min(effective_slots(self.settings, len(self.ctx.gpus.devices)), self._slots_made)

    def _free_slot(self) -> int | None:
        used = {a.record.slot for a in self._attempts()}
        return next((i for i in range(self.slots) if i not in used), None)

    def _may_claim(self) -> bool:
        """Claim only with a free slot that could serve a task: on a GPU node, a free GPU."""
        if not self._registered or self._draining or self._quota_spent() or self.reloader.busy:
            return False
        if not self.decision.may_claim:
            return False
        gpus = self.ctx.gpus
        if self._free_slot() is None or (gpus.devices and gpus.free == 0):
            return False
        return self.ctx.runner.ready()

    # --- coordinator conversations ------------------------------------------------------------

    def _register(self) -> None:
        now = self.clock.monotonic()
        try:
            self.node_id = self.coordinator.register(self.registration(self.settings))
        except CoordinatorError as exc:
            self._failing("registration", exc)
            answered = self.clock.monotonic()
            self._next_register = answered + self.pacing.register_failed(answered - now)
            return
        self._registered = True
        self._working("registration")
        self.pacing.registered()
        log.info("registered as node %s", self.node_id)

    def _forgotten(self, what: str) -> None:
        """The coordinator forgot this node (it restarted): register again after the pacing's
        spread (a fleet noticed together), then claim at once."""
        log.info("coordinator %s: registering again", what)
        self._registered = False
        now = self.clock.monotonic()
        self._next_register = now + self.pacing.rejoin()
        self._next_claim = 0.0

    def _heartbeat(self) -> None:
        self._next_heartbeat = self.clock.monotonic() + self.pacing.heartbeat()
        heartbeat = NodeHeartbeat(
            node_id=self.node_id, status="draining" if self._draining else "online"
        )
        try:
            self.coordinator.node_heartbeat(heartbeat)
        except Unregistered:
            self._forgotten("forgot this node")
            return
        except CoordinatorError as exc:
            self._failing("node heartbeat", exc)
            return
        self._working("node heartbeat")
        self._beats += 1
        self._last_beat_wall = self.clock.wall()

    def _claim(self) -> None:
        now = self.clock.monotonic()
        try:
            lease = self.coordinator.claim(self.node_id)
        except Unregistered:
            self.metrics.claim_finished(self.clock.monotonic() - now, "error")
            self._forgotten("refused the claim as unregistered")
            return
        except CoordinatorError as exc:
            answered = self.clock.monotonic()
            self.metrics.claim_finished(answered - now, "error")
            self._failing("claim", exc)
            self._next_claim = answered + self.pacing.claim_failed(answered - now)
            return
        answered = self.clock.monotonic()
        took = answered - now
        self.metrics.claim_finished(took, "empty" if lease is None else "work")
        self._working("claim")
        self._next_claim = answered + self.pacing.claimed(lease is not None, took, answered)
        if lease is None:
            return
        lease_id = lease.get("lease_id")
        held = {a.record.lease_id for a in self._attempts()}
        if isinstance(lease_id, str) and lease_id in held:
            # The same lease again (a replayed or hostile answer): it is running here already,
            # and a second attempt would share its workspace and cgroup.
            log.error("claim answer names lease %s, which runs here already: ignored", lease_id)
            self._next_claim = answered + self.pacing.claimed(False, took, answered)
            return
        self.stats.started += 1
        slot = self._free_slot() or 0
        attempt = Attempt(self._context(), lease, slot, self._reserve_gpus(lease))
        key = self.stats.started
        with self._lock:
            self.running[key] = attempt
        self.ctx.start_thread(lambda: self._run_attempt(key, attempt), f"attempt-{key}")

    def _reserve_gpus(self, lease: dict[str, Any]) -> list[Device]:
        """Take the GPUs a lease asks for now, in the loop, so that the next claim already
        sees them held; the attempt checks the request properly (and ends it with a reason)."""
        payload = lease.get("payload")
        want = payload.get("gpus") if isinstance(payload, dict) else None
        if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
            return []
        try:
            return self.ctx.gpus.acquire(want)
        except AttemptFailed:
            return []

    def _run_attempt(self, key: int, attempt: Attempt) -> None:
        outcome = Outcome.FAILED
        started = self.clock.monotonic()
        try:
            outcome = attempt.run()
        finally:
            with self._lock:
                self.running.pop(key, None)
            self.stats.count(outcome)
            self._ended(attempt, outcome, self.clock.monotonic() - started)
            self.pacing.attempt_ended(self.clock.monotonic())
            self._next_claim = self.clock.monotonic()  # claim again at once
            self._wake.set()

    def _ended(self, attempt: Attempt, outcome: Outcome, seconds: float) -> None:
        """Tell the node's own holds how an attempt ended."""
        lease = attempt.lease
        reason = attempt.ended[1] if attempt.ended else ""
        ending = Ending(
            outcome,
            reason,
            lease.job_id if lease else "",
            attempt.node_fault,
            seconds,
            job_endpoint=attempt.job_endpoint,
            outgrew_room=attempt.outgrew_room,
        )
        self.holds.ended(ending, attempt.lease_id)
        self._last_ended = {
            "lease_id": attempt.lease_id,
            "job_id": ending.job_id,
            "task_id": lease.task_id if lease else "",
            "outcome": outcome.value,
            "reason": reason,
            "ended_at": self.clock.wall(),
        }

    def _cancel_all(self, ending: AttemptLapsed, grace: float) -> None:
        for attempt in self._attempts():
            attempt.cancel(ending, grace)

    # --- one log line per state change -------------------------------------------------------

    def _failing(self, what: str, exc: Exception) -> None:
        self.metrics.coordinator_error(what)
        known = self._problems.get(what)
        if known is None:
            log.warning("%s failing, retrying with backoff: %s", what, exc)
        since = known.since if known is not None else self.clock.monotonic()
        self._problems[what] = Problem(what, since, str(exc))

    def _working(self, what: str) -> None:
        known = self._problems.pop(what, None)
        if known is not None:
            log.info("%s works again after %.0f s", what, self.clock.monotonic() - known.since)


def effective_slots(settings: Settings, gpus: int) -> int:
    if settings.slots == "auto":
        return max(1, gpus)
    return settings.slots
