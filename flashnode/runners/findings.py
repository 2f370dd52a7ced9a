"""What a check before work finds (``preflight.py``, each runner's ``preflight``): a ``Problem``
with its fix, or an ``Ok`` with what was found (for ``flashnode doctor``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashnode.errors import ExitCode


@dataclass(frozen=True)
class Problem:
    """Something wrong, in the owner's words: what was checked, why it fails, how to fix it.

    ``code`` is the exit code ``work`` ends with because of it; None for a warning (``work``
    starts anyway, and says so in its log).
    """

    what: str
    why: str
    fix: str
    code: ExitCode | None = ExitCode.CONFIG

    @property
    def fatal(self) -> bool:
        return self.code is not None

    def line(self) -> str:
        return f"{self.what}: {self.why}; fix: {self.fix}"


@dataclass(frozen=True)
class Ok:
    """A check that passed, with what was found (for ``doctor``)."""

    what: str
    detail: str = ""


Finding = Ok | Problem
