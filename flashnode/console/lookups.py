"""What the console asks the coordinator (this node's record, a job's name and state), asked on
one thread of its own, never on a request's.

A request reads what is known and says what it wants known; the lookup thread asks the
coordinator one thing at a time, and sleeps (no timer) while nothing is wanted. So a slow, silent
or hostile coordinator, or a page asking for many jobs, never holds a request (nor the owner's
few connections) longer than a dictionary read. What is wanted is bounded; a job asked about
is not asked again for ``JOB_KEEP_S`` (``MISS_KEEP_S`` when the coordinator did not answer),
unless what it said was asked before something that may have changed it (a lease of that job
lost since: ``job_since``). Every answer is kept with when it was asked, so that what is shown
can say how old it is, and a failed ask is kept beside the last good answer, never in its place
unsaid.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashnode.errors import FlashnodeError, NotFound

log = logging.getLogger(__name__)

NODE_KEEP_S = 15.0  # every open page asks for the node's record
JOB_KEEP_S = 300.0  # a job's name never changes; its state (cancelled?) may
MISS_KEEP_S = 60.0  # a coordinator that did not answer is asked again after this
JOBS_KEPT = 256
WANTED_MAX = 128

Record = dict[str, Any]


@dataclass(frozen=True)
class NodeAnswer:
    """What is known of this node's record at the coordinator."""

    record: Record | None  # the last good answer (None: the coordinator lists no such node)
    fetched_at: float | None  # when that answer was asked (None: no good answer yet)
    failed_at: float | None  # when the latest ask was made, if it failed (None: it did not)
    error: str | None  # why the latest ask failed (None: it did not)
    asking_since: float | None  # when the ask in flight began (None: none is)


@dataclass(frozen=True)
class _Job:
    expires: float  # asked again from then on
    tried_at: float  # when the latest ask began, answered or not
    asked_at: float | None  # when the answer kept was asked (None: none was had)
    record: Record | None  # that answer (None: no such job, or none had)


class Lookups:
    def __init__(
        self,
        node_view: Callable[[str], Record | None],
        job_view: Callable[[str], Record | None],
        clock: Callable[[], float],
    ) -> None:
        """``node_view``: GET /nodes, this node's entry (None: not listed); ``job_view``:
        GET /jobs/{id} (NotFound: no such job). Both raise FlashnodeError when the coordinator
        does not answer."""
        self._node_view, self._job_view, self._clock = node_view, job_view, clock
        self._cond = threading.Condition()
        self._node: tuple[str, NodeAnswer] | None = None  # whose, and what is known
        self._node_wanted: str | None = None
        self._node_asking: tuple[str, float] | None = None  # the ask in flight: whose, since
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._wanted: OrderedDict[str, None] = OrderedDict()
        self._job_asking: str | None = None  # the job asked now: not wanted again meanwhile
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- what a request reads -------------------------------------------------------------------

    def node(self, node_id: str) -> NodeAnswer | None:
        """What the coordinator last said of this node, with when it was asked, and whether
        the latest ask failed (and why); asked again when the latest ask is older than
        ``NODE_KEEP_S``. None: nothing known of this node yet."""
        now = self._clock()
        with self._cond:
            found = self._node[1] if self._node is not None and self._node[0] == node_id else None
            asking = self._node_asking
            since = asking[1] if asking is not None and asking[0] == node_id else None
            latest = None if found is None else found.failed_at or found.fetched_at
            if since is None and (latest is None or now - latest >= NODE_KEEP_S):
                self._want_node(node_id)
                since = now  # this request's ask: it is under way (the page asks again soon)
            if found is None:
                return None
            return NodeAnswer(found.record, found.fetched_at, found.failed_at, found.error, since)

    def job(self, job_id: str) -> Record | None:
        """What the coordinator last said of a job (None: not known, or no such job); asked
        when not known or kept too long."""
        return self.job_since(job_id, None)[1]

    def job_since(self, job_id: str, after: float | None) -> tuple[bool, Record | None]:
        """(known, record): what the coordinator last said of a job, known only when it was
        asked at ``after`` or later (a lease of the job lost then: an answer asked before may
        say "running" of a job cancelled since, and is asked again, however young)."""
        now = self._clock()
        with self._cond:
            found = self._jobs.get(job_id)
            since = float("-inf") if after is None else after
            if found is None or now >= found.expires or found.tried_at < since:
                self._want_job(job_id)
            if found is None or found.asked_at is None or found.asked_at < since:
                return False, None
            return True, found.record

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(5)

    # --- the lookup thread ----------------------------------------------------------------------

    def _want_node(self, node_id: str) -> None:
        self._node_wanted = node_id
        self._wake()

    def _want_job(self, job_id: str) -> None:
        # One being asked is not wanted again: a request during the ask would see the answer
        # before it, and ask once more after it (one ask per request, the thread slow).
        if job_id in self._wanted or job_id == self._job_asking or len(self._wanted) >= WANTED_MAX:
            return
        self._wanted[job_id] = None
        self._wake()

    def _wake(self) -> None:
        """Under the lock: the thread is told (and started, the first time)."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="console-lookups", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._node_wanted is None and not self._wanted:
                    self._cond.wait()
                if self._closed:
                    return
                node, self._node_wanted = self._node_wanted, None
                job, asked = None, 0.0
                if node is None:
                    job, _ = self._wanted.popitem(last=False)
                    self._job_asking = job
                else:
                    asked = self._clock()
                    self._node_asking = (node, asked)
            try:
                if node is not None:
                    self._ask_node(node, asked)
                elif job is not None:
                    self._ask_job(job)
            except Exception:  # a lookup must never end the thread the page relies on
                log.exception("console: asking the coordinator failed")
            finally:
                with self._cond:
                    self._job_asking = None

    def _ask_node(self, node_id: str, asked: float) -> None:
        """Ask for this node's record (``asked``: when the ask began, the time its answer
        carries)."""
        try:
            try:
                record = self._node_view(node_id)
            except FlashnodeError as exc:
                with self._cond:  # the last good answer is kept, said to be that old
                    before = self._node[1] if self._node and self._node[0] == node_id else None
                    kept = before or NodeAnswer(None, None, None, None, None)
                    failed = NodeAnswer(kept.record, kept.fetched_at, asked, str(exc), None)
                    self._node = (node_id, failed)
                return
            with self._cond:
                self._node = (node_id, NodeAnswer(record, asked, None, None, None))
        finally:
            with self._cond:
                self._node_asking = None

    def _ask_job(self, job_id: str) -> None:
        record: Record | None = None
        with self._cond:
            asked = self._clock()  # what it answers may be this old (a cancel just after)
        try:
            record = self._job_view(job_id)
        except NotFound:
            pass  # no such job: nothing to show
        except FlashnodeError:  # not answered: what was had is kept, as old as it was
            with self._cond:
                before = self._jobs.get(job_id)
                kept_at, kept = (before.asked_at, before.record) if before else (None, None)
                self._keep(job_id, _Job(self._clock() + MISS_KEEP_S, asked, kept_at, kept))
            return
        with self._cond:
            self._keep(job_id, _Job(self._clock() + JOB_KEEP_S, asked, asked, record))

    def _keep(self, job_id: str, found: _Job) -> None:
        """Under the lock: what is known of a job, the oldest forgotten past ``JOBS_KEPT``."""
        self._jobs[job_id] = found
        self._jobs.move_to_end(job_id)
        while len(self._jobs) > JOBS_KEPT:
            self._jobs.popitem(last=False)
