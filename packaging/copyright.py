"""Print a machine-readable Debian copyright file for the package: flashnode and every
distribution bundled in its virtualenv, with the license each declares."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

venv = Path(sys.argv[1])
print("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
print("Upstream-Name: flashnode")
print("Comment: flashnode bundles its Python dependencies in /opt/flashnode (a virtualenv).")
print()
print("Files: *")
print("Copyright: flashnode developers")
print("License: Apache-2.0")
print(" On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.")
site = next(venv.glob("lib/python3*/site-packages"))
for dist in sorted(metadata.distributions(path=[str(site)]), key=lambda d: d.metadata["Name"]):
    name = dist.metadata["Name"]
    if name in ("flashnode", "pip", "setuptools", "wheel"):
        continue
    license_ = (
        dist.metadata.get("License-Expression")
        or next(
            (
                c.split("::")[-1].strip()
                for c in dist.metadata.get_all("Classifier") or []
                if c.startswith("License ::") and "OSI Approved ::" in c
            ),
            None,
        )
        or (dist.metadata.get("License") or "").splitlines()[0:1]
    )
    if isinstance(license_, list):
        license_ = license_[0] if license_ else "see the distribution's metadata"
    author = dist.metadata.get("Author") or dist.metadata.get("Author-email") or "its authors"
    print()
    tops = sorted(
        {
            f.parts[0] + ("/*" if len(f.parts) > 1 else "")
            for f in dist.files or []
            if f.parts and not f.parts[0].startswith("..") and f.parts[0] != "__pycache__"
        }
    )
    print("Files: " + " ".join(f"opt/flashnode/lib/python3*/site-packages/{t}" for t in tops))
    print(f"Comment: {name} {dist.version}, bundled")
    print(f"Copyright: {author.splitlines()[0]}")
    print(f"License: {license_}")
