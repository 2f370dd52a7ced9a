"""The node's session with the coordinator: registration, the node heartbeat, the claim.

``Session`` owns the conversation: the node id the coordinator gave, whether the node is
registered (and under which settings: a reload registers again, since the pools may have
changed), the heartbeats answered, noticing that the coordinator forgot the node (it restarted)
and registering again, the claim call and what its answer says, and the conversations that fail
(one log line when one starts failing, one when it works again). ``pacing.py`` says when each
call is due; the loop says whether a claim may be made at all.

Refused credentials (a 401 or 403 to the registration, the node heartbeat or the claim) do not
end the agent: the session stops claiming and holds (``hold``: the rule ``credentials``, with
its fix), registers again every few minutes (``CREDENTIALS_RECHECK_S``) with the credentials
read again (``Credentials``), and at once when the stored ones change (``flashnode login``, a
fixed token file): a coordinator that accepts them again, or a fixed token, lets the node work
again by itself, without a restart.

Every method runs on the loop's thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from flashnode import logcontext
from flashnode.clock import Clock, stamp
from flashnode.config.settings import Settings
from flashnode.coordinator.messages import NodeHeartbeat, NodeRegistration
from flashnode.errors import ConfigError, CoordinatorError, CredentialsError, Unregistered
from flashnode.node.decision import Hold
from flashnode.node.pacing import Pacing
from flashnode.owner.metrics import MetricsSink

log = logging.getLogger(__name__)

CREDENTIALS_RECHECK_S = 180.0  # refused credentials: register again this often (jittered)
CREDENTIALS_WATCH_S = 2.0  # ... and look this often whether the stored ones changed


@dataclass(frozen=True)
class Problem:
    """A conversation with the coordinator that fails: since when (monotonic), its latest error."""

    conversation: str
    since: float
    error: str


@dataclass(frozen=True)
class Refusal:
    """The coordinator refused this node's credentials: since when (wall), its latest answer,
    and when (wall) the node asks again at the latest."""

    since: float
    error: str
    recheck_at: float


class Credentials(Protocol):
    """The node's credentials as stored (a token file, what ``flashnode login`` wrote)."""

    def changed(self) -> bool:
        """Whether the stored credentials changed since they were last read (cheap: a stat)."""
        ...

    def reread(self) -> None:
        """Read them again and hand them to the client; ConfigError when they cannot be read."""
        ...


class AgentCoordinator(Protocol):
    def register(self, registration: NodeRegistration) -> str: ...
    def node_heartbeat(self, heartbeat: NodeHeartbeat) -> None: ...
    def claim(self, node_id: str) -> dict[str, Any] | None: ...


class Session:
    def __init__(
        self,
        coordinator: AgentCoordinator,
        registration: Callable[[Settings], NodeRegistration],
        clock: Clock,
        pacing: Pacing,
        metrics: MetricsSink,
        credentials: Credentials | None = None,
    ) -> None:
        """``registration``: what the node says of itself under given settings.
        ``credentials``: the stored credentials, read again after a refusal (None: never)."""
        self._coordinator = coordinator
        self._credentials = credentials
        self._registration = registration
        self._clock = clock
        self.pacing = pacing
        self._metrics = metrics
        self.node_id = ""
        self.registered = False
        self._under: Settings | None = None  # the settings the node registered under
        self.problems: dict[str, Problem] = {}  # the failing conversations, by name
        self.beats = 0
        self.last_beat_wall: float | None = None
        self.registered_wall: float | None = None  # the latest registration accepted (wall)
        self.refused: Refusal | None = None  # the coordinator refuses the credentials
        self._next_watch = 0.0
        self._next_register = 0.0
        self._next_heartbeat = 0.0
        self._next_claim = 0.0

    # --- when ---------------------------------------------------------------------------------

    def wake_at(self, may_claim: bool) -> float:
        """When (monotonic) the next call is due."""
        if not self.registered:
            return self._next_register
        return min(self._next_heartbeat, self._next_claim) if may_claim else self._next_heartbeat

    def heartbeat_soon(self, now: float) -> None:
        """Send the next heartbeat at ``now`` (a drain started: tell the coordinator)."""
        self._next_heartbeat = now

    def attempt_ended(self, at: float) -> None:
        """An attempt ended at ``at`` (monotonic): claim again at once, and quickly a while."""
        self.pacing.attempt_ended(at)
        self._next_claim = at

    # --- the calls ----------------------------------------------------------------------------

    def turn(self, now: float, settings: Settings, draining: bool) -> bool:
        """Register (again, after a reload) or send the heartbeat, whichever is due; True when
        the node was registered already, and a claim may follow in this turn."""
        if self.registered and settings is not self._under:
            self.registered = False
            self._next_register = self._next_claim = 0.0
        if not self.registered:
            if self.refused is not None and self._credentials_changed(now):
                log.info("the stored credentials changed: registering again")
                self._next_register = now
            if now >= self._next_register:
                if self.refused is not None and not self._reread(now):
                    return False
                self._register(settings)
            return False
        if now >= self._next_heartbeat:
            self._heartbeat(draining)
        return True

    def claim_due(self, now: float) -> bool:
        return self.registered and now >= self._next_claim

    def registered_under(self, settings: Settings) -> bool:
        """Whether the node is registered with exactly ``settings`` (its pools, its GPUs): a
        claim goes out only then, so that a reload landing during the heartbeat never claims
        under the registration it replaces."""
        return self.registered and self._under is settings

    def claim(self, held: Collection[str]) -> dict[str, Any] | None:
        """Ask for work; the lease to run, or None. A lease named in ``held`` (running here
        already) is ignored."""
        now = self._clock.monotonic()
        try:
            lease = self._coordinator.claim(self.node_id)
        except Unregistered:
            self._metrics.claim_finished(self._clock.monotonic() - now, "error")
            self._forgotten("refused the claim as unregistered")
            return None
        except CredentialsError as exc:
            self._metrics.claim_finished(self._clock.monotonic() - now, "error")
            self._refuse("claim", exc)
            return None
        except CoordinatorError as exc:
            answered = self._clock.monotonic()
            self._metrics.claim_finished(answered - now, "error")
            self._failing("claim", exc)
            self._next_claim = answered + self.pacing.claim_failed(answered - now)
            return None
        answered = self._clock.monotonic()
        took = answered - now
        self._metrics.claim_finished(took, "empty" if lease is None else "work")
        self._working("claim")
        self._next_claim = answered + self.pacing.claimed(lease is not None, took, answered)
        if lease is None:
            return None
        lease_id = lease.get("lease_id")
        if isinstance(lease_id, str) and lease_id in held:
            # The same lease again (a replayed or hostile answer): it is running here already,
            # and a second attempt would share its workspace and cgroup.
            log.error(
                "a claim answer names this lease again, which runs here already: ignored",
                extra=logcontext.fields(lease_id),
            )
            self._next_claim = answered + self.pacing.claimed(False, took, answered)
            return None
        return lease

    def goodbye(self) -> None:
        """Tell the coordinator the node is leaving (nothing if it was not registered)."""
        if self.registered:
            with contextlib.suppress(CoordinatorError, CredentialsError):
                self._coordinator.node_heartbeat(
                    NodeHeartbeat(node_id=self.node_id, status="terminating")
                )

    def _register(self, settings: Settings) -> None:
        now = self._clock.monotonic()
        try:
            self.node_id = self._coordinator.register(self._registration(settings))
        except CredentialsError as exc:
            self._refuse("registration", exc)
            return
        except CoordinatorError as exc:
            self._failing("registration", exc)
            answered = self._clock.monotonic()
            self._next_register = answered + self.pacing.register_failed(answered - now)
            return
        self.registered = True
        self._under = settings
        self.registered_wall = self._clock.wall()
        self._working("registration")
        self.pacing.registered()
        if self.refused is not None:
            self.refused = None
            log.info("the coordinator accepts this node's credentials again")
        log.info("registered as node %s", self.node_id)

    def _forgotten(self, what: str) -> None:
        """The coordinator forgot this node (it restarted): register again after the pacing's
        spread (a fleet noticed together), then claim at once."""
        log.info("coordinator %s: registering again", what)
        self.registered = False
        self._next_register = self._clock.monotonic() + self.pacing.rejoin()
        self._next_claim = 0.0

    def _heartbeat(self, draining: bool) -> None:
        self._next_heartbeat = self._clock.monotonic() + self.pacing.heartbeat()
        heartbeat = NodeHeartbeat(node_id=self.node_id, status="draining" if draining else "online")
        try:
            self._coordinator.node_heartbeat(heartbeat)
        except Unregistered:
            self._forgotten("forgot this node")
            return
        except CredentialsError as exc:
            self._refuse("node heartbeat", exc)
            return
        except CoordinatorError as exc:
            self._failing("node heartbeat", exc)
            return
        self._working("node heartbeat")
        self.beats += 1
        self.last_beat_wall = self._clock.wall()

    # --- refused credentials: hold, and ask again ------------------------------------------------

    def hold(self, settings: Settings) -> Hold | None:
        """While the coordinator refuses the credentials: claim nothing, say why and the fix."""
        refused = self.refused
        if refused is None:
            return None
        where = settings.coordinator
        return Hold(
            "credentials",
            f"the coordinator refused this node's credentials since {stamp(refused.since)}"
            f" ({refused.error}); asks again by {stamp(refused.recheck_at)}, and at once when"
            " the stored token changes",
            fix=f"store a token (and join code) that {where} accepts: sudo flashnode login"
            f" --coordinator {where} (or correct the file token_file names); the agent takes"
            " it up by itself, no restart needed",
        )

    def _refuse(self, what: str, exc: CredentialsError) -> None:
        """The coordinator refused the credentials: stop claiming (the node is not registered
        any more), and ask again after ``CREDENTIALS_RECHECK_S`` (or when they change)."""
        self._metrics.coordinator_error(what)
        self._problem_cleared(what)
        # It answered: no conversation is unreachable. Those the hold stops trying (a claim
        # that failed while the coordinator was down) would show that failure all along.
        for other in list(self.problems):
            self.problems.pop(other)
            self._metrics.coordinator_working(other)
        wait = CREDENTIALS_RECHECK_S * self.pacing.rng.uniform(0.8, 1.0)
        now, wall = self._clock.monotonic(), self._clock.wall()
        error = str(exc)
        if self.refused is None:
            log.error(
                "the coordinator refused this node's credentials (%s): holding, claiming"
                " nothing; asking again every few minutes and when the stored token changes",
                error,
            )
        elif self.refused.error != error:
            log.warning("the coordinator still refuses the credentials, now: %s", error)
        since = wall if self.refused is None else self.refused.since
        self.refused = Refusal(since, error, wall + wait)
        self.registered = False
        self._next_register = now + wait
        self._next_claim = 0.0

    def _credentials_changed(self, now: float) -> bool:
        if self._credentials is None or now < self._next_watch:
            return False
        self._next_watch = now + CREDENTIALS_WATCH_S
        try:
            return self._credentials.changed()
        except OSError:
            return False

    def _reread(self, now: float) -> bool:
        """Read the stored credentials again before asking; False (and the next try after the
        recheck's wait) when they cannot be read."""
        if self._credentials is None:
            return True
        try:
            self._credentials.reread()
        except (ConfigError, OSError) as exc:
            refused = self.refused
            wait = CREDENTIALS_RECHECK_S * self.pacing.rng.uniform(0.8, 1.0)
            self._next_register = now + wait
            if refused is not None:
                error = f"the credentials cannot be read: {exc}"
                if refused.error != error:
                    log.warning("%s", error)
                self.refused = Refusal(refused.since, error, self._clock.wall() + wait)
            return False
        return True

    def _problem_cleared(self, what: str) -> None:
        """A conversation answered (even a refusal): it is not unreachable any more."""
        known = self.problems.pop(what, None)
        if known is not None:
            log.info("%s answers again after %.0f s", what, self._clock.monotonic() - known.since)

    # --- one log line per state change --------------------------------------------------------

    def _failing(self, what: str, exc: Exception) -> None:
        self._metrics.coordinator_error(what)
        known = self.problems.get(what)
        if known is None:
            log.warning("%s failing, retrying with backoff: %s", what, exc)
        elif known.error != str(exc):  # why it fails changed: a squatter now holds the port...
            log.warning("%s still failing, now: %s", what, exc)
        since = known.since if known is not None else self._clock.monotonic()
        self.problems[what] = Problem(what, since, str(exc))

    def _working(self, what: str) -> None:
        self._metrics.coordinator_working(what)
        known = self.problems.pop(what, None)
        if known is not None:
            log.info("%s works again after %.0f s", what, self._clock.monotonic() - known.since)
