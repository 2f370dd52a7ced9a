"""One lease from claim to commit (docs/design.md §1): the attempt, its phases and what they keep.

The parts, each in its own place (ARCHITECTURE.md): ``orchestrator.py`` the ``Attempt`` (the
phase sequence, ``PHASES``, and how an attempt ends), ``hooks.py`` the state and hooks its
phases share, ``phases/`` the phases, ``context.py`` what the node hands an attempt,
``keeper.py`` the lease's renewal, ``record.py`` and ``outbox.py`` the record a restarted agent
reads back, ``diskwatch.py`` the task's disk. This module only names what the rest of the
package uses.
"""

from flashnode.attempt.context import AttemptContext, CoordinatorPort
from flashnode.attempt.keeper import LeaseKeeper
from flashnode.attempt.orchestrator import PHASES, Attempt
from flashnode.attempt.record import Outcome

__all__ = ["PHASES", "Attempt", "AttemptContext", "CoordinatorPort", "LeaseKeeper", "Outcome"]
