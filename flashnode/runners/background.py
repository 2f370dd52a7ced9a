"""One thread that runs jobs in order, off their callers' way: what may follow an attempt's
outcome (removing its workspace, a slot's turnover) without delaying the next claim, and without
a thread started for each."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from flashnode import logcontext

log = logging.getLogger(__name__)


class Background:
    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Run ``job`` after those submitted before it; the event is set once it ran (or
        failed: logged, never raised), in the caller's context (what it logs carries the fields
        of the attempt that submitted it)."""
        done = threading.Event()
        self._jobs.put((logcontext.carried(job), done))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return done

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every job submitted so far; False if they did not all end in time."""
        return self.submit(lambda: None).wait(timeout)

    def _run(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()
            except Exception:
                log.exception("%s: a background job failed", self._name)
            finally:
                done.set()
