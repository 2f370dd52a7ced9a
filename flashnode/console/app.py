"""What the console's requests mean: the checks every request passes (``auth.py``), what each
page of data holds, and the owner's actions, each done by the one implementation the command line
uses too (``pausefile`` for pause and resume, ``configedit`` for the config file).

The data is what the agent publishes: ``status.json`` (``flashnode status``), the ledger
(``flashnode history``), the running attempts' captured output (``flashnode logs``), the
node's use over the last hour, day and week (``usage.py``) and what the coordinator says of
this node and of the jobs shown (asked on the lookup thread, ``lookups.py``, never on a
request's). Whatever a task printed and whatever the coordinator said is hostile: it leaves here
as JSON strings with terminal control escaped, and the page only ever sets it as text.

What a task printed is the owner's alone (``logs/`` is root's, 0700): the view-only level, which
shows what ``flashnode history`` and ``flashnode status`` show of the node, gets nothing of it in
any answer (``output_hidden``: the running tasks' lines, the kept output of ended attempts, the
last line the status text carries, the stderr lines a failure's reason quotes).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from flashnode import __version__
from flashnode.config import configedit
from flashnode.config.settings import Settings
from flashnode.console import auth
from flashnode.console.lookups import NODE_KEEP_S, Lookups, NodeAnswer
from flashnode.console.server import Request, Response
from flashnode.console.wiring import Wiring
from flashnode.coordinator.ids import SAFE_ID
from flashnode.owner import lastexit, pausefile, status
from flashnode.owner.ledgerview import LedgerView
from flashnode.sandbox import logcap
from flashnode.sanitise import sanitise

log = logging.getLogger(__name__)

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
OUTPUT_TAIL_BYTES = 4096
OUTPUT_LINES = 12
JOBS_PER_REQUEST = 64
LOWERED_BY = 20  # the latest attempts listed as what may have lowered the scores
TEXT_CHARS = 2000
# Terminal control but newline and tab, DEL, C1, and the bidi controls that reorder text.
# span: (seconds, seconds between usage points, tasks-chart bin)
SPANS = {"hour": (3600, 10, 300), "day": (86400, 60, 3600), "week": (7 * 86400, 600, 6 * 3600)}
EDITABLE = ("run_windows", "task_cpu_percent")


def clean(text: object, limit: int = TEXT_CHARS, keep: str = "") -> str:
    """Hostile text for the page: a string, sanitised (``keep``: controls kept), bounded."""
    value = text if isinstance(text, str) else "" if text is None else str(text)
    return sanitise(value, keep=keep, limit=limit)


class App:
    def __init__(self, wiring: Wiring, gate: auth.Gate, hosts: frozenset[str], cookie: str) -> None:
        self.w = wiring
        self.gate = gate
        self.hosts = hosts
        self.cookie = cookie
        self.ledger = wiring.ledger or LedgerView(wiring.state_dir / "ledger.jsonl", wiring.clock)
        self.lookups = Lookups(wiring.node_view, wiring.job_view, wiring.clock)
        self._edit_lock = threading.Lock()

    # --- every request --------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        if request.uid is not None and request.uid in self.w.task_uids:
            # A task shares the host's network: one that got hold of the owner's cookie (a
            # browser sends it to every port of this host) still gets nothing.
            return _error(403, "refused: a task's user")
        host = (request.header("host") or "").lower()
        if host not in self.hosts:
            return _error(421, "this console answers only to its own address")
        if request.method == "GET" and request.path in STATIC:
            return _static(*STATIC[request.path])
        if request.method == "GET" and request.path == "/login":
            return self._login(request)
        session_id = _cookie(request.header("cookie"), self.cookie)
        session = self.gate.session(session_id)
        if session is None:
            return _error(401, "not logged in: run `flashnode ui` for a login link")
        if request.method == "GET":
            site = request.header("sec-fetch-site")
            if request.path.startswith("/api/") and site not in (None, "same-origin"):
                return _error(403, "refused: the request does not come from this console's page")
            return self._get(request, session)
        if request.method != "POST":
            return _error(405, "method not allowed")
        refused = self._refused_change(request, host, session)
        if refused is not None:
            return refused
        if request.path == "/api/logout":
            self.gate.logout(session_id)
            return _json({"ok": True}, [("Set-Cookie", f"{self.cookie}=; Path=/; Max-Age=0")])
        if session.level != "owner":
            return _error(
                403, "this login may only look: run `sudo flashnode ui` to change the node"
            )
        try:
            body = json.loads(request.body or b"{}")
        except (ValueError, RecursionError):
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        action = ACTIONS.get(request.path)
        if action is None:
            return _error(404, "no such action")
        return action(self, body)

    def _refused_change(
        self, request: Request, host: str, session: auth.Session
    ) -> Response | None:
        """Why a state-changing request is refused, or None: it must come from this console's
        own page (Origin, and Sec-Fetch-Site where the browser sends it), and carry the
        session's CSRF token and a JSON body."""
        if not auth.same_origin(request.header("origin"), host):
            return _error(403, "refused: the request does not come from this console's page")
        site = request.header("sec-fetch-site")
        if site is not None and site != "same-origin":
            return _error(403, "refused: the request does not come from this console's page")
        token = request.header(auth.CSRF_HEADER) or ""
        if not auth.hmac_equal(token, session.csrf):
            return _error(403, "refused: missing or wrong CSRF token")
        if (request.header("content-type") or "").split(";")[0].strip() != "application/json":
            return _error(415, "a change is sent as application/json")
        return None

    def _login(self, request: Request) -> Response:
        found = self.gate.login(request.query.get("token", ""))
        if found is None:
            page = (
                "<!doctype html><meta charset=utf-8><title>flashnode</title>"
                "<p>This login link is not valid: it expired, was used already, or belongs to"
                " an agent that has restarted since. Run <code>flashnode ui</code> for a new one."
            )
            return Response(403, page.encode(), "text/html; charset=utf-8")
        sid, _ = found
        cookie = f"{self.cookie}={sid}; Path=/; HttpOnly; SameSite=Strict"
        return Response(303, b"", "text/plain", [("Location", "/"), ("Set-Cookie", cookie)])

    def _get(self, request: Request, session: auth.Session) -> Response:
        path = request.path
        if path == "/api/session":
            return _json({"level": session.level, "csrf": session.csrf})
        owner = session.level == "owner"  # what a task printed is the owner's alone
        if path == "/api/state":
            return _json(self.state(owner))
        if path == "/api/charts":
            return _json(self.charts(request.query.get("span", "hour")))
        if path == "/api/history":
            try:
                limit = max(1, min(int(request.query.get("limit", "100")), 500))
            except ValueError:
                limit = 100
            return _json(self.history(request.query.get("outcome") or None, limit, owner))
        if path == "/api/coordinator":
            return _json(self.coordinator_view(owner))
        if path == "/api/jobs":
            ids = [j for j in request.query.get("ids", "").split(",") if SAFE_ID.match(j)]
            return _json({j: self.job(j) for j in dict.fromkeys(ids[:JOBS_PER_REQUEST])})
        return _error(404, "not found")

    # --- what the console shows -----------------------------------------------------------------

    def state(self, owner: bool = True) -> dict[str, Any]:
        """The node as ``flashnode status`` shows it; ``owner``: with what its tasks printed
        (their newest lines, and the last one the status text carries)."""
        snapshot = status.read(self.w.state_dir)
        s = self.w.settings()
        out: dict[str, Any] = {
            "now": self.w.clock(),
            "version": __version__,
            "agent": None,
            "totals": self.ledger.totals(),
            "settings": self._settings(s),
        }
        if snapshot is None:
            return out
        out["totals"] = snapshot.get("totals") or out["totals"]
        controls = snapshot.get("controls") if isinstance(snapshot.get("controls"), dict) else {}
        out["agent"] = {
            "node_id": clean(snapshot.get("node_id"), 200),
            "coordinator": clean(snapshot.get("coordinator"), 300),
            "runner": clean(snapshot.get("runner"), 40),
            "pools": [clean(p, 200) for p in snapshot.get("pools") or []],
            "state": clean(
                snapshot.get("state") if owner else _state_text(snapshot, controls or {})
            ),
            "registered": bool(snapshot.get("registered")),
            "draining": bool(snapshot.get("draining")),
            "last_heartbeat_age_s": snapshot.get("last_heartbeat_age_s"),
            "slots": s.slots,
            "counters": snapshot.get("counters") or {},
        }
        out["why"] = _why(snapshot, controls or {}, lastexit.read(self.w.state_dir))
        out["stale"] = status.staleness(snapshot, self.w.clock())
        out["running"] = [self._attempt(a, owner) for a in snapshot.get("running") or []]
        return out

    def _attempt(self, a: dict[str, Any], owner: bool = True) -> dict[str, Any]:
        lease = str(a.get("lease_id") or "")
        shown = {k: v for k, v in a.items() if k not in ("last_output",)}
        shown = dict(json.loads(json.dumps(shown, default=str)))  # plain data only
        for key in ("lease_id", "job_id", "task_id", "phase", "suspend_reason"):
            shown[key] = clean(a.get(key), 300) or None
        pool = clean(a.get("pool"), 128) or None
        if pool is not None and pool not in self.w.settings().pools:  # the payload's word only
            pool += " (not one of this node's pools)"
        shown["pool"] = pool
        shown["facts"] = clean(status.describe_facts(a), 500)
        shown["output"] = self.output_tail(lease) if owner else None
        shown["output_hidden"] = not owner
        return shown

    def output_tail(self, lease: str) -> dict[str, str] | None:
        """The last lines a task printed on each stream while its output is on this node (what
        ``flashnode logs`` reads: the agent's own copy, which the task cannot reach, kept for
        the latest ``keep_logs`` attempts after their end); None when none is kept."""
        found = logcap.find(self.w.state_dir, lease)
        if found is None:
            return None
        logs, _ = found
        return {name: _tail(logs / f"{name}.txt") for name in ("stdout", "stderr")}

    def _settings(self, s: Settings) -> dict[str, Any]:
        return {
            "config_file": str(self.w.config_file) if self.w.config_file else None,
            "run_windows": list(s.run_windows),
            "run_windows_timezone": s.run_windows_timezone,
            "task_cpu_percent": s.task_cpu_percent,
            "pools": list(s.pools),
            "overridden": {
                k: v for k in (*EDITABLE, "pools") if (v := self.w.overridden(k)) is not None
            },
        }

    def charts(self, span: str) -> dict[str, Any]:
        """The usage history (``usage.py``: kept across restarts) and the tasks done per bin
        (from the ledger) over the last hour, day or week (anything else: the hour)."""
        span = span if span in SPANS else "hour"
        seconds, step, bin_seconds = SPANS[span]
        now = self.w.clock()
        since = now - seconds
        points: list[list[int | None]] = [list(p) for p in self.w.ring.series(since, step)]
        if not points:  # a fresh agent before its first sample: this moment, not measured yet
            points.append([int(now), None, None, None])
        return {
            "span": span,
            "since": since,
            "now": now,
            "usage": points,
            "step_seconds": step,
            "tasks": self.ledger.per_bin(since, bin_seconds),
            "bin_seconds": bin_seconds,
        }

    def history(self, outcome: str | None, limit: int, owner: bool = True) -> list[dict[str, Any]]:
        """The ledger's latest attempts; ``owner``: with what each printed, while it is kept,
        and the stderr lines a failure's reason quotes."""
        out = []
        for r in self.ledger.latest(outcome, limit):
            shown = dict(r)
            for key in ("lease_id", "job_id", "task_id", "pool", "outcome", "reason", "facts"):
                shown[key] = clean(r.get(key))
            if not owner:
                shown["reason"] = status.without_output(shown["reason"])
            shown["output"] = self.output_tail(str(r.get("lease_id") or "")) if owner else None
            shown["output_hidden"] = not owner
            out.append(shown)
        return out

    def coordinator_view(self, owner: bool = True) -> dict[str, Any]:
        """This node as the coordinator last said it sees it (asked on the lookup thread:
        ``pending`` until the first answer), its scores explained, and how old that is:
        ``fetched_at`` (when it was asked), ``age_s``, ``current`` (asked within
        ``NODE_KEEP_S``, nothing failed since), ``asking`` (a newer ask under way). Never a
        view as if current when the latest ask failed, or the agent's own conversations with
        the coordinator fail since it was asked: then ``error`` and ``failed``, with the last
        good view under ``last_known`` (its own ``fetched_at``)."""
        snapshot = status.read(self.w.state_dir) or {}
        node = snapshot.get("node_id")
        if not isinstance(node, str) or not SAFE_ID.match(node):
            return {"error": "not registered yet"}
        answer = self.lookups.node(node)
        if answer is None:
            return {"error": "asking the coordinator", "pending": True}
        now = self.w.clock()
        known = None
        if answer.fetched_at is not None:
            known = self._scores(answer, snapshot, owner)
            known["fetched_at"] = answer.fetched_at
            known["age_s"] = max(now - answer.fetched_at, 0.0)
        asking = answer.asking_since is not None
        failed = _failing_since(answer, snapshot)
        if failed is not None:
            at, error = failed
            return {
                "error": clean(f"the coordinator did not answer: {error}", 300),
                "failed": True,
                "failed_at": at,
                "fetched_at": answer.fetched_at,
                "last_known": known,
                "asking": asking,
            }
        assert known is not None  # an answer with no failure is a good one
        if answer.record is None:
            return {
                "error": "the coordinator lists no such node",
                "failed": False,
                "fetched_at": answer.fetched_at,
                "asking": asking,
            }
        known["failed"] = False
        known["asking"] = asking
        known["current"] = known["age_s"] < NODE_KEEP_S
        return known

    def _scores(self, answer: NodeAnswer, snapshot: dict[str, Any], owner: bool) -> dict[str, Any]:
        """The last good answer's view, its scores explained and what may have lowered them."""
        if answer.record is None:
            return {"listed": False}
        view = _node_view(answer.record)
        view["explained"] = SCORES_EXPLAINED
        since = snapshot.get("registered_at") or snapshot.get("started_at")
        view["lowered_by"] = self.lowered_by(since, owner)
        return view

    def lowered_by(self, since: object, owner: bool = True) -> list[dict[str, Any]]:
        """The attempts that ended ``since`` (the node's latest registration: the coordinator
        counts from there) and may have lowered its scores, newest first, each with who caused
        it in plain words: the job's own error, its author's cancel, the coordinator taking the
        lease back, this node giving it up or letting it go (``owner``: with the stderr lines a
        failure's reason quotes). A lease taken back is asked about again when what the
        coordinator said of its job was asked before the lease was lost (a cancel since)."""
        start = since if isinstance(since, (int, float)) and not isinstance(since, bool) else 0
        found = []
        for r in self.ledger.latest(None, 500):
            ended = r.get("ended_at")
            if isinstance(ended, (int, float)) and ended < start:
                break
            outcome = str(r.get("outcome"))
            if outcome not in LOWERING:
                continue
            job = clean(r.get("job_id"), 200)
            reason = str(r.get("reason") or "")
            known, state = False, None
            if SAFE_ID.match(job) and outcome == "lost" and not given_up(reason):
                after = ended if isinstance(ended, (int, float)) else None
                known, record = self.lookups.job_since(job, after)
                state = _job_state(record)
            found.append(
                {
                    "job_id": job,
                    "task_id": clean(r.get("task_id"), 200),
                    "outcome": clean(outcome, 40),
                    "ended_at": ended,
                    "cause": cause(outcome, state, reason, known),
                    "reason": clean(
                        (reason if owner else status.without_output(reason)).split("\n")[0], 300
                    ),
                }
            )
            if len(found) >= LOWERED_BY:
                break
        return found

    def job(self, job_id: str) -> dict[str, str | None]:
        """A job's name and state as its coordinator last said (asked on the lookup thread);
        nothing while it has not said."""
        record = self.lookups.job(job_id)
        spec = record.get("spec") if isinstance(record, dict) else None
        meta = spec.get("metadata") if isinstance(spec, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        return {"name": clean(name, 80) or None, "state": _job_state(record)}

    # --- what the console changes ---------------------------------------------------------------

    def pause(self, body: dict[str, Any]) -> Response:
        mode, duration = body.get("mode", "drain"), body.get("for")
        if mode not in ("drain", "now") or not (duration is None or isinstance(duration, str)):
            return _error(400, 'mode is "drain" or "now"; "for" a duration like 30m, 2h, 1d')
        try:
            made = pausefile.pause(self.w.state_dir, duration, mode == "drain", self.w.clock())
        except ValueError as exc:
            return _error(422, str(exc))
        except OSError as exc:
            return _error(500, f"cannot write the pause: {exc.strerror or exc}")
        log.info("console: %s", pausefile.describe(made))
        return _json({"ok": True, "message": pausefile.describe(made)})

    def resume(self, body: dict[str, Any]) -> Response:
        try:
            removed = pausefile.clear(self.w.state_dir)
        except OSError as exc:
            return _error(500, f"cannot remove the pause: {exc.strerror or exc}")
        if removed:
            log.info("console: resumed")
        return _json({"ok": True, "message": "resumed" if removed else "not paused"})

    def set_settings(self, body: dict[str, Any]) -> Response:
        changes: dict[str, Any] = {}
        for key, value in body.items():
            if key not in EDITABLE:
                return _error(400, f"{clean(key, 60)} cannot be changed here")
            if key == "run_windows":
                if (
                    not isinstance(value, list)
                    or len(value) > 32
                    or not all(isinstance(w, str) and len(w) <= 100 for w in value)
                ):
                    return _error(400, "run_windows is a list of windows")
                value = [w.strip() for w in value if w.strip()] or None
            elif value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                return _error(400, "task_cpu_percent is a number, or null for no cap")
            changes[key] = value
        if not changes:
            return _error(400, "nothing to change")

        def edit(doc: Any) -> None:
            for key, value in changes.items():
                configedit.set_key(doc, key, value)

        return self._edit_config(list(changes), edit)

    def pools(self, body: dict[str, Any]) -> Response:
        join, leave = body.get("join"), body.get("leave")
        pool = join if isinstance(join, str) else leave if isinstance(leave, str) else None
        if pool is None or (join is not None and leave is not None):
            return _error(400, 'name one pool: {"join": ID} or {"leave": ID}')
        try:
            configedit.check_pool(pool)
        except configedit.Refused as exc:
            return _error(422, str(exc))

        def change(current: list[str]) -> list[str]:
            if join is not None:
                return current if pool in current else [*current, pool]
            return [p for p in current if p != pool]

        def edit(doc: Any) -> None:
            assert self.w.config_file is not None
            configedit.set_pools(doc, change(configedit.file_pools(doc, self.w.config_file)))

        return self._edit_config(["pools"], edit)

    def _edit_config(self, keys: list[str], edit: Callable[[Any], None]) -> Response:
        path = self.w.config_file
        if path is None:
            return _error(
                409, "the agent was started without a config file: there is nothing to change"
            )
        for key in keys:
            why = self.w.overridden(key)
            if why is not None:
                return _error(409, f"{key} is {why}, which the config file cannot change")
        with self._edit_lock:
            try:
                doc = configedit.parse(path)
                edit(doc)
                configedit.write(path, doc, self.w.validate)
            except configedit.Refused as exc:
                return _error(422, str(exc))
        log.info("console: changed %s in %s; reloading", ", ".join(keys), path)
        self.w.reload()
        return _json({"ok": True, "message": f"{', '.join(keys)} changed in {path}; reloading"})


LOWERING = ("failed", "lapsed", "lost")

SCORES_EXPLAINED = {
    "reliability": (
        "accepted tasks ÷ (accepted + failed attempts + abandoned leases), counted by the"
        " coordinator since this node last registered (a restart of the coordinator, or of"
        " this agent, starts the count again)"
    ),
    "placement_tier": (
        "unproven: fewer than 5 attempts resolved; steady: 90 % or more accepted; shaky: under"
        " 75 %; mixed: between. Only a coordinator that orders claims by reliability uses it:"
        " steady nodes get the tasks with the fewest attempts left, shaky ones those with the"
        " most. It never decides whether this node gets work"
    ),
}


# The reasons of a lease this node gave up itself (the lease keeper's): the coordinator did not
# take it back, whatever its job's state.
GIVEN_UP = (
    (
        "lease could not be renewed before its deadline",
        "this node gave it up: the coordinator did not answer before the lease's deadline",
    ),
    ("credentials refused", "this node gave it up: the coordinator refused its credentials"),
)


def given_up(reason: str) -> str | None:
    """Why this node gave up a lease itself, in an owner's words (None: it did not)."""
    return next((words for start, words in GIVEN_UP if reason.startswith(start)), None)


def cause(outcome: str, job_state: str | None, reason: str = "", known: bool = True) -> str:
    """Who made an attempt end without a result, in words an owner reads (``known``: the
    job's state was asked after the lease was lost)."""
    if outcome == "failed":
        return "the job's own error"
    if outcome == "lost":
        gave_up = given_up(reason)
        if gave_up is not None:
            return gave_up
        if job_state == "cancelled":  # a cancel kills the live lease
            return "cancelled by its author"
        if not known:
            return "the coordinator took the lease back (asking it whether the job was cancelled)"
        return "the coordinator took the lease back"
    return "this node let it go"


def _state_text(snapshot: dict[str, Any], controls: Mapping[str, Any]) -> str:
    """The status text without the running tasks' last lines, made again from what it is made
    of (``Publisher.text``): running attempts and what holds claiming. Any other text (idle,
    draining, the coordinator unreachable) carries no task's line."""
    text = str(snapshot.get("state") or "")
    running = [a for a in snapshot.get("running") or [] if isinstance(a, dict)]
    if not running:
        return text
    if not text.startswith("running "):
        lines = [a.get("last_output") for a in running]
        if any(isinstance(x, str) and x.strip() and x in text for x in lines):
            return f"{len(running)} task(s) running"  # a text made some other way
        return text
    quiet = "; ".join(status.attempt_line({**a, "last_output": ""}, None) for a in running)
    held = "; ".join(
        str(h.get("reason")) for h in controls.get("held_by") or [] if isinstance(h, dict)
    )
    return f"running {quiet} | not claiming: {held}" if held else f"running {quiet}"


ACTIONS: dict[str, Callable[[App, dict[str, Any]], Response]] = {
    "/api/pause": App.pause,
    "/api/resume": App.resume,
    "/api/settings": App.set_settings,
    "/api/pools": App.pools,
}


def _why(
    snapshot: dict[str, Any], controls: Mapping[str, Any], last_exit: dict[str, Any] | None
) -> dict[str, Any]:
    """Why the node is not working, in general terms: each hold with its reason and its fix,
    a failing coordinator conversation, the last refused reload, and how the agent before
    this one exited (refused credentials, a configuration error, ...) while that still holds
    (``status.current_exit``: not a second agent refused beside this one, not refused
    credentials the coordinator accepted since)."""
    holds = []
    for h in controls.get("held_by") or []:
        if isinstance(h, dict):
            holds.append(
                {
                    "rule": clean(h.get("rule"), 60),
                    "reason": clean(h.get("reason"), 500),
                    "fix": clean(h.get("fix"), 500) if h.get("fix") else None,
                    "suspends": bool(h.get("suspends")),
                }
            )
    refused = snapshot.get("reload_refused")
    problems = [
        {
            "conversation": clean(p.get("conversation"), 60),
            "since": p.get("since") if isinstance(p.get("since"), (int, float)) else None,
            "error": clean(p.get("error"), 500),
            "fix": clean(p.get("fix"), 500),
        }
        for p in snapshot.get("coordinator_problems") or []
        if isinstance(p, dict)
    ]
    exited = None
    last_exit = status.current_exit(last_exit, snapshot)
    if last_exit is not None:
        started = snapshot.get("started_at")
        exited = {
            **{k: last_exit.get(k) for k in ("at", "code")},
            "error": clean(last_exit.get("error"), 1000),
            "fix": clean(last_exit.get("fix"), 1000),
            "before_start": isinstance(started, (int, float)) and last_exit["at"] < started,
        }
    rejoined = snapshot.get("rejoined")
    return {
        "holds": holds,
        "rejoined": rejoined if isinstance(rejoined, int) and not isinstance(rejoined, bool) else 0,
        "coordinator": problems,
        "last_exit": exited,
        "reload_fix": status.RELOAD_FIX,
        "paused": controls.get("paused"),
        "stop_reason": clean(controls.get("stop_reason"), 500) or None,
        "reload_refused": (
            {"at": refused.get("at"), "reason": clean(refused.get("reason"), 1000)}
            if isinstance(refused, dict)
            else None
        ),
    }


_NODE_NUMBERS = ("accepted_tasks", "failed_attempts", "abandoned_leases", "last_heartbeat_age_s")


def _failing_since(answer: NodeAnswer, snapshot: dict[str, Any]) -> tuple[float, str] | None:
    """(since, error) when the view asked last is not current because asking failed: the
    latest ask, or the agent's own conversations with the coordinator failing since the last
    good answer was asked (a page opened a while into an outage)."""
    if answer.failed_at is not None:
        return answer.failed_at, answer.error or "no answer"
    fetched = answer.fetched_at
    for p in snapshot.get("coordinator_problems") or []:
        since = p.get("since") if isinstance(p, dict) else None
        if isinstance(since, (int, float)) and fetched is not None and since > fetched:
            what = clean(p.get("conversation"), 60) or "a conversation"
            return since, f"{what}: {clean(p.get('error'), 240)}"
    return None


def _job_state(record: object) -> str | None:
    state = record.get("state") if isinstance(record, dict) else None
    return clean(state, 40).lower() or None


def _node_view(node: dict[str, Any]) -> dict[str, Any]:
    view: dict[str, Any] = {}
    for key in _NODE_NUMBERS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            view[key] = value
    reliability = node.get("reliability")
    if isinstance(reliability, (int, float)) and not isinstance(reliability, bool):
        view["reliability"] = reliability
    view["placement_tier"] = clean(node.get("placement_tier"), 40) or None
    view["online"] = node.get("online") is True
    return view


def _tail(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(size - OUTPUT_TAIL_BYTES, 0), os.SEEK_SET)
        data = os.read(fd, OUTPUT_TAIL_BYTES)
    except OSError:
        return ""
    finally:
        os.close(fd)
    lines = data.decode("utf-8", "replace").replace("\r", "\n").split("\n")
    if size > OUTPUT_TAIL_BYTES:
        lines = lines[1:]  # the first may be cut
    kept = [x for x in lines if x.strip()][-OUTPUT_LINES:]
    return clean("\n".join(kept), OUTPUT_TAIL_BYTES, keep="\n\t")


def _cookie(header: str | None, cookie: str) -> str | None:
    for part in (header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == cookie and value:
            return value
    return None


def _json(value: object, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(200, json.dumps(value).encode(), "application/json", headers or [])


def _error(code: int, message: str) -> Response:
    return Response(code, json.dumps({"error": message}).encode(), "application/json")


def _static(name: str, content_type: str) -> Response:
    data = resources.files("flashnode.console").joinpath("static", name).read_bytes()
    return Response(200, data, content_type)
