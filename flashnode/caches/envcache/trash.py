"""Trees taken out of sight at once (``Trash``): renamed into ``.tmp/del.<random>`` (atomic: no
reader ever sees half a tree), then removed; what a crash leaves there the sweep removes."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from flashnode.sandbox.removal import remove_tree


class Trash:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def hide(self, path: Path) -> Path | None:
        """Move ``path`` out of sight at once (atomic); where it went, or None if it was gone."""
        doomed = self.tmp / f"del.{secrets.token_hex(6)}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        return doomed

    def doom(self, path: Path) -> None:
        """Move ``path`` out of sight at once, then delete it."""
        doomed = self.hide(path)
        if doomed is not None:
            remove_tree(doomed)
