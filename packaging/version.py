"""Print the package version of ``flashnode/__init__.py`` as nfpm's semver version and prerelease.

``0.5.0.dev0`` → ``0.5.0 dev0``; ``1.2.0rc1`` → ``1.2.0 rc1``; ``1.2.0`` → ``1.2.0`` and an empty
prerelease. nfpm writes the prerelease with a tilde for both packagers (deb ``0.5.0~dev0``, rpm
``0.5.0~dev0-1``), so a pre-release sorts before its release. Post and local versions are refused.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

text = Path(sys.argv[1]).read_text()
version = re.search(r'__version__ = "(.+)"', text)
if version is None:
    sys.exit("no __version__")
m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)*)(?:\.?(dev|a|b|rc)([0-9]+))?", version[1])
if m is None:
    sys.exit(f"version {version[1]!r} has no package form (post and local versions are refused)")
print(m[1], f"{m[2]}{m[3]}" if m[2] else "")
