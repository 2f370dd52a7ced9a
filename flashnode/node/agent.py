"""The node loop: startup, then turn by turn the owner's controls, the session with the
coordinator (register, heartbeat, claim), attempts handed to free slots, the drain; shutdown.

``run`` has three phases, as uvicorn's server does: ``startup`` (reap what an earlier run left,
resume the outbox), the loop, and ``shutdown``, which runs in every case (a drain, a second
signal, a bug) and stops, ends and records every running attempt before the
agent returns.

It imports no edge: the coordinator, the runner, the clock and the way attempts are started are
all given to it, so tests drive it with fakes and a fake clock. Signal handlers (in the CLI) only
call ``request_stop``/``request_reload``; the loop acts on them.

The loop keeps no state of its parts; each owns its own:

* ``session.py`` (``Session``): registration, the node heartbeat, registering again when the
  coordinator forgot the node or a reload changed the settings, the claim and its answer;
  ``pacing.py`` says when each call is due;
* ``workers.py`` (``Workers``): one worker per slot: the running attempts, their threads, the
  GPUs a lease takes, the owner controls' stop and suspension applied to them, their endings;
* ``drain.py`` (``Drain``): the stop requests and the drain's clock;
* ``reload.py`` (``Reloader``): the configuration, swapped as one by a reload; each attempt is
  given a frozen snapshot of the one it was claimed under (``Reloader.snapshot``);
* ``controls.py`` (the owner's rules) and ``holds.py`` (the node's own holds on claiming);
* ``courtesy/`` (``CourtesyWatch``, its own thread): a GPU the owner uses given back, heat and
  power kept in bounds, per GPU; its holds join the turn's;
* ``publisher.py`` (``Publisher``): what the node does, from a frozen ``NodeView`` each turn;
* ``recovery.py``: what an earlier run left, at startup.

The owner's controls are evaluated every turn: the node claims only while no rule holds;
``flashnode pause --now`` stops running attempts as an ending that is not the task's fault; a
rule named in ``suspend_when`` suspends running tasks until it clears. Heartbeats go on
throughout: a paused node is online and says why it takes no work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from flashnode.attempt import AttemptContext, Outcome
from flashnode.clock import Clock
from flashnode.config.settings import Settings
from flashnode.coordinator.messages import NodeRegistration
from flashnode.errors import Stopped
from flashnode.node.controls import Controls
from flashnode.node.courtesy.rules import CourtesyRules
from flashnode.node.courtesy.watch import CourtesyWatch
from flashnode.node.decision import Decision
from flashnode.node.drain import SHUTDOWN_MARGIN_S, Drain
from flashnode.node.holds import NodeHolds
from flashnode.node.pacing import Pacing
from flashnode.node.publisher import NodeView, Publisher
from flashnode.node.recovery import recover
from flashnode.node.reload import Config, Reloader
from flashnode.node.rules import Rules
from flashnode.node.session import AgentCoordinator, Credentials, Session
from flashnode.node.workers import Workers, effective_slots
from flashnode.owner.status import StatusSink
from flashnode.sandbox.diskuse import Space
from flashnode.sandbox.limits import Limits

__all__ = ["Agent", "AgentCoordinator", "effective_slots"]

log = logging.getLogger(__name__)

TICK = 1.0  # the longest the loop sleeps before looking at its stop flags (and the pause file)
# A stop lets go of running tasks in seconds: an attempt elsewhere than its task's run (staging,
# an upload) is stopped with at most this grace, and the agent waits at most this long in all.
DETACH_GRACE_S = 3.0
DETACH_WAIT_S = 7.0
# While the machine shuts down, tasks get at most this grace, and the agent waits this long in
# all (the relay's last sweep ships the newest checkpoint meanwhile).
POWEROFF_GRACE_S = 8.0
POWEROFF_WAIT_S = 13.0


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
        machine_stopping: Callable[[], bool] | None = None,
        courtesy: CourtesyWatch | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        """``ctx``: the edges every attempt is given, and the configuration the agent starts
        with (``settings``, ``limits``; after a reload the current one is ``reloader.current``,
        and each attempt is given a snapshot of ``ctx`` with it). ``reload``: the configuration
        as it is now (for ``request_reload``); ``limits``: the per-task limits of reloaded
        settings (None: they stay); ``on_settings``: what else follows a reload (the caches'
        budgets). ``controls``: the owner's rules (None: none). ``space``: the state dir's
        disk now (default: ``ctx.space``). ``health``: this node's own checks for the given
        settings, as one line per problem (the preflight; none: always healthy).
        ``status_extra``: more for status.json (what owners' commands may use to reach it).
        ``totals``: what this node gave, today and all time (from the ledger: it survives
        restarts), for status.json. ``machine_stopping``: whether the machine is shutting down
        (a stop then ends running tasks instead of letting go of them). ``courtesy``: the
        owner's courtesy (GPUs given back, heat, power), run on a thread of its own from the
        start to the shutdown (None: none). ``credentials``: the stored credentials, read
        again while the coordinator refuses them (the node holds meanwhile: ``session.py``).
        Counts go to ``ctx.metrics``."""
        self._machine_stopping = machine_stopping or (lambda: False)
        self.rejoined = 0  # tasks an earlier run let go of, rejoined at the start
        self.ctx = ctx
        self.clock = clock or ctx.clock
        self.controls = controls
        self.courtesy = courtesy
        self._run_on: set[str] = set()  # GPUs of tasks let go of at the shutdown: they run on
        self.decision = Decision()  # the owner controls' latest word
        self._wake = threading.Event()
        self._on_settings = on_settings
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
        self.publisher = Publisher(self.clock, sink, status_extra, totals)
        pacing = Pacing(ctx.settings, ctx.rng)
        self.session = Session(
            coordinator, registration, self.clock, pacing, ctx.metrics, credentials
        )
        self.workers = Workers(ctx, self.clock, self._wake.set)
        self.drain = Drain()
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
        self._started_wall = self.clock.wall()
        self._applied = ctx.settings  # the settings the loop's parts run under

    @property
    def settings(self) -> Settings:
        """The settings the next claim runs under (a reload swaps them)."""
        return self.reloader.current.settings

    @property
    def sink(self) -> StatusSink:
        return self.publisher.sink

    def task_cpu(self) -> dict[str, float] | None:
        """Cumulative CPU seconds of every running attempt's task (for the ``load`` rule)."""
        return self.workers.task_cpu()

    # --- control (safe to call from a signal handler: sets flags only) ------------------------

    def request_stop(self) -> None:
        """Leave now (SIGTERM): running tasks are let go of for the next start of the agent to
        rejoin, or, while the machine shuts down, stopped with their grace (``shutdown``)."""
        self.drain.request_stop()

    def request_drain(self) -> None:
        """``flashnode drain``: no new claims, running attempts may finish for
        ``drain_seconds``; a second request stops them now, still cleaning up."""
        self.drain.request_drain()

    def request_reload(self) -> None:
        """Re-read the configuration (pools, limits) and register again."""
        self.reloader.request()

    # --- the three phases ---------------------------------------------------------------------

    def run(self) -> None:
        """Run until drained, stopped, or ``max_tasks`` attempts have finished. Refused
        credentials do not end it: the node holds until the coordinator accepts them."""
        self.startup()
        fatal = True
        try:
            self._loop()
            fatal = False
        finally:
            self.shutdown(fatal)

    def startup(self) -> None:
        """Before any claim: rejoin the tasks an earlier run of this agent let go of, commit
        the results it finished (the outbox), reap and let lapse the rest, and remove
        workspaces no record names."""
        rejoined = recover(self.reloader.snapshot(self.ctx), self.workers.count)
        for attempt, handle in rejoined:
            self.workers.adopt(attempt, handle)
        self.rejoined = len(rejoined)
        if rejoined:
            log.info("re-attached %d task(s) after a restart", len(rejoined))
        courtesy = self.courtesy
        if courtesy is not None:
            courtesy.start()
            grace = lambda: self.settings.kill_grace_seconds  # noqa: E731
            self.ctx.start_thread(lambda: courtesy.run(self.workers.attempts, grace), "courtesy")
        self.sink.send(READY=1)

    def _loop(self) -> None:
        while True:
            if self.drain.leaving:
                return
            self.sink.tick()
            now = self.clock.monotonic()
            self._take_endings()
            self._take_settings()
            if self.drain.tick(now, self.settings, self.sink, self.workers.running()):
                self.session.heartbeat_soon(now)
            self._owner_controls()
            if self.ctx.ledger.pending:  # lines a full disk kept back
                self.ctx.ledger.flush()
            stopping = self.drain.stopping(now, self.settings)
            if stopping is not None:
                self.workers.cancel_all(*stopping)
            if not self.workers.running() and (self.drain.draining or self._quota_spent()):
                return
            self.reloader.tick()
            registered = self.session.turn(now, self.settings, self.drain.draining)
            # The configuration the claim goes out under, which its attempt keeps: a reload
            # that lands meanwhile (during the heartbeat or the claim) is the next claim's.
            config = self.reloader.current
            if (
                registered
                and self.session.registered_under(config.settings)
                and self._may_claim()
                and self.session.claim_due(now)
            ):
                lease = self.session.claim(self.workers.leases())
                if lease is not None:
                    self.workers.start(lease, self.reloader.snapshot(self.ctx, config))
                    if self.courtesy is not None:
                        self.courtesy.wake()
                self._publish()
                continue
            self._publish()
            wake_at = self.session.wake_at(self._may_claim())
            news = self.publisher.news_due()  # status.json's, held back a moment
            if news is not None:
                wake_at = min(wake_at, news)
            self.clock.wait(self._wake, min(max(wake_at - now, 0.0), TICK))
            self._wake.clear()

    def shutdown(self, abrupt: bool = False) -> None:
        """End the loop's work in seconds. After a stop (SIGTERM), running tasks are let go of
        for the next start of the agent to rejoin (an attempt elsewhere than its task's run is
        stopped); while the machine shuts down, or after a drain or a fatal error, every running
        attempt is stopped (left to lapse: not the tasks' fault; the relay ships the newest
        checkpoint its task left). Then each is waited for and recorded, the coordinator told
        goodbye (unless tasks run on), the final status published."""
        s, now = self.settings, self.clock.monotonic()
        left = self.workers.running()
        if self.courtesy is not None:  # no turn of it crosses the shutdown's
            self.courtesy.stop()
        if self.drain.leaving:
            self.sink.send(STOPPING=1)
        if left:
            if self.drain.leaving and not abrupt and not self._machine_stopping():
                log.info("leaving %d running attempt(s) to the next start of the agent", left)
                self.workers.detach_all(min(s.kill_grace_seconds, DETACH_GRACE_S))
                deadline = now + DETACH_WAIT_S
            elif self.drain.leaving and not abrupt:
                log.info("the machine shuts down: stopping %d running attempt(s)", left)
                grace = min(s.kill_grace_seconds, POWEROFF_GRACE_S)
                self.workers.cancel_all(Stopped("the machine shuts down"), grace)
                deadline = now + POWEROFF_WAIT_S
            else:
                log.info("stopping %d running attempt(s)", left)
                grace = 0.0 if abrupt else s.kill_grace_seconds
                self.workers.cancel_all(Stopped("agent stopping"), grace)
                deadline = now + s.kill_grace_seconds + SHUTDOWN_MARGIN_S
            late = self.workers.wait_all(deadline, self._wake, self.sink.tick)
            if late:
                log.error("%d attempt(s) did not end in time", late)
        detached = self._take_endings()
        if self.courtesy is not None:
            self.courtesy.close(self._run_on)
        if detached:
            log.info(
                "%d task(s) run on for the next start (reattach_seconds %g)",
                detached,
                s.reattach_seconds,
            )
        elif not abrupt:
            self.session.goodbye()
        try:
            self.ctx.runner.close()
        except Exception:  # the last status and log line must still be written
            log.exception("closing the runner failed")
        self._publish(final=True)
        log.info("agent stopped: %s", self.workers.summary())

    # --- what each turn weighs ----------------------------------------------------------------

    def _owner_controls(self) -> None:
        """Evaluate the owner's rules; stop or suspend running attempts as they say. Add the
        node's own holds (a full disk, the quarantine, the backoff after a revoked lease): they
        hold claiming and say why, but stop or suspend nothing."""
        d = self.controls.evaluate() if self.controls else Decision()
        courtesy = self.courtesy.holds() if self.courtesy else []
        refused = self.session.hold(self.settings)
        self.decision = d.holding(*self.holds.holds(self.settings), *courtesy, refused)
        self.workers.obey(d, self.settings.kill_grace_seconds)
        self.ctx.metrics.set_controls(d.paused is not None, [h.rule for h in self.decision.holds])

    def _take_endings(self) -> int:
        """Act on the attempts that ended: the node's own holds learn how, and the node
        claims again at once. How many were let go of (their tasks run on)."""
        detached = 0
        for ended in self.workers.ended():
            if ended.outcome is Outcome.DETACHED:
                detached += 1
                self._run_on.update(d.visible for d in ended.attempt.devices)
                continue
            self.holds.ended(ended.ending, ended.attempt.lease_id)
            self.session.attempt_ended(ended.at)
        return detached

    def _quota_spent(self) -> bool:
        m = self.settings.max_tasks
        return m is not None and self.workers.stats.started >= m

    def _may_claim(self) -> bool:
        """Claim only with a free slot that could serve a task: on a GPU node, a free GPU."""
        if self.drain.draining or self._quota_spent() or self.reloader.busy:
            return False
        if not self.decision.may_claim or not self.workers.could_take(self.settings):
            return False
        return self.ctx.runner.ready()

    # --- reload -------------------------------------------------------------------------------

    def _reloaded(self, config: Config) -> None:
        """A reload applied (on the reload's thread, before claims resume): the edges that
        follow it (the caches' budgets and origin policies) take the new settings. The loop's
        own parts take them at its next turn (``_take_settings``), on the loop's thread."""
        if self._on_settings is not None:
            self._on_settings(config.settings, config.limits)

    def _take_settings(self) -> None:
        """At the start of a turn, before anything weighs them: the owner's rules and the
        node's holds take the settings a reload made current. The session registers again by
        itself when it sees them (the pools may have changed)."""
        new = self.settings
        if new is self._applied:
            return
        self._applied = new
        self.holds.reconfigure(new)
        if self.controls is not None:
            self.controls.reconfigure(Rules.from_settings(new))
        if self.courtesy is not None:
            self.courtesy.reconfigure(CourtesyRules.from_settings(new))
        log.info("configuration reloaded: pools %s; registering again", ",".join(new.pools) or "-")

    # --- what the agent is doing ---------------------------------------------------------------

    def _publish(self, final: bool = False) -> None:
        self.publisher.publish(self._view(), final)

    def _view(self) -> NodeView:
        """The node now, frozen for the publisher."""
        running = tuple(
            a.snapshot() for a in self.workers.attempts() if a.lease is not None and not a.settled
        )
        session = self.session
        return NodeView(
            settings=self.settings,
            node_id=session.node_id,
            registered=session.registered,
            draining=self.drain.draining,
            drain_deadline=self.drain.deadline,
            started_at=self._started_wall,
            beats=session.beats,
            last_heartbeat_at=session.last_beat_wall,
            problems=tuple(session.problems.values()),
            counters=self.workers.outcomes(),
            running=running,
            decision=self.decision,
            last_ended=self.workers.last_ended,
            reload_refused=self.reloader.refused,
            rejoined=self.rejoined,
            registered_at=session.registered_wall,
        )
