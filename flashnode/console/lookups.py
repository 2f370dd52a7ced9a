"""What the console asks the coordinator (this node's record, a job's name and state), asked on
one thread of its own, never on a request's.

A request reads what is known and says what it wants known; the lookup thread asks the
coordinator one thing at a time, and sleeps (no timer) while nothing is wanted. So a slow, silent
or hostile coordinator, or a page asking for many jobs, never holds a request (nor the owner's
few connections) longer than a dictionary read. What is wanted is bounded; a job asked about
is not asked again for ``JOB_KEEP_S`` (``MISS_KEEP_S`` when the coordinator did not answer).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from flashnode.errors import FlashnodeError, NotFound

log = logging.getLogger(__name__)

NODE_KEEP_S = 15.0  # every open page asks for the node's record
JOB_KEEP_S = 300.0  # a job's name never changes; its state (cancelled?) may
MISS_KEEP_S = 60.0  # a coordinator that did not answer is asked again after this
JOBS_KEPT = 256
WANTED_MAX = 128

Record = dict[str, Any]


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
        self._node: tuple[float, str, Record | None, str | None] | None = None
        self._node_wanted: str | None = None
        self._jobs: OrderedDict[str, tuple[float, Record | None]] = OrderedDict()
        self._wanted: OrderedDict[str, None] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- what a request reads -------------------------------------------------------------------

    def node(self, node_id: str) -> tuple[bool, Record | None, str | None]:
        """(known, record, error): what the coordinator last said of this node; asked again
        when older than ``NODE_KEEP_S``. Not known yet: (False, None, None)."""
        now = self._clock()
        with self._cond:
            found = self._node
            if found is None or found[1] != node_id or now - found[0] >= NODE_KEEP_S:
                self._want_node(node_id)
            if found is None or found[1] != node_id:
                return False, None, None
            return True, found[2], found[3]

    def job(self, job_id: str) -> Record | None:
        """What the coordinator last said of a job (None: not known, or no such job); asked
        when not known or kept too long."""
        now = self._clock()
        with self._cond:
            found = self._jobs.get(job_id)
            if found is None or now >= found[0]:
                self._want_job(job_id)
            return None if found is None else found[1]

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
        if job_id in self._wanted or len(self._wanted) >= WANTED_MAX:
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
                job = None
                if node is None:
                    job, _ = self._wanted.popitem(last=False)
            try:
                if node is not None:
                    self._ask_node(node)
                elif job is not None:
                    self._ask_job(job)
            except Exception:  # a lookup must never end the thread the page relies on
                log.exception("console: asking the coordinator failed")

    def _ask_node(self, node_id: str) -> None:
        record: Record | None = None
        error: str | None = None
        try:
            record = self._node_view(node_id)
        except FlashnodeError as exc:
            error = str(exc)
        with self._cond:
            self._node = (self._clock(), node_id, record, error)

    def _ask_job(self, job_id: str) -> None:
        record: Record | None = None
        keep = JOB_KEEP_S
        try:
            record = self._job_view(job_id)
        except NotFound:
            pass  # no such job: nothing to show
        except FlashnodeError:
            keep = MISS_KEEP_S
        with self._cond:
            self._jobs[job_id] = (self._clock() + keep, record)
            self._jobs.move_to_end(job_id)
            while len(self._jobs) > JOBS_KEPT:
                self._jobs.popitem(last=False)
