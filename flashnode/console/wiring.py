"""What the agent hands the console (``Wiring``): its own module, so that the console's parts
and the package that starts them import it without importing each other."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashnode.config.settings import Settings
    from flashnode.console.usage import UsageRing
    from flashnode.owner.ledgerview import LedgerView


@dataclass
class Wiring:
    """What the agent hands the console (``cli.py`` builds it)."""

    state_dir: Path
    settings: Callable[[], Settings]  # the running configuration (a reload replaces it)
    config_file: Path | None  # what a change is written to; None: no file, no changes
    validate: Callable[[Path], object]  # the loader `work` uses (raises ConfigError)
    overridden: Callable[[str], str | None]  # "set by --pool", "set by FLASHNODE_POOLS", None
    reload: Callable[[], None]  # the agent re-reads its configuration (as on SIGHUP)
    node_view: Callable[[str], dict[str, Any] | None]  # GET /nodes, this node's entry
    ring: UsageRing
    task_uids: frozenset[int] = frozenset()  # the task users: no request of theirs is answered
    clock: Callable[[], float] = time.time
    ledger: LedgerView | None = None  # the agent's (None: the console reads the ledger itself)
    job_view: Callable[[str], dict[str, Any] | None] = lambda job_id: None  # NotFound: no job
