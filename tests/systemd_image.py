"""A minimal Debian root with systemd as an engine image, for the test under a real systemd.

docs/design.md §8's recipe: ``debootstrap --variant=minbase --include=systemd,systemd-sysv,python3,dbus
bookworm``, imported with ``docker import``. Built once and kept as a named image whose tag is a
content hash of the recipe, so a later session (or a second test run) reuses it and a changed
recipe makes a new one. Run as a script to build it ahead of the tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
INCLUDE = ("systemd", "systemd-sysv", "python3", "dbus", "procps")
# Bumped when what goes into the image changes in a way the fields above do not show.
RECIPE_VERSION = "1"
REPOSITORY = "flashnode-test-systemd"


def recipe() -> str:
    return "\n".join(
        [RECIPE_VERSION, SUITE, MIRROR, "minbase", ",".join(INCLUDE), os.uname().machine]
    )


def image_name() -> str:
    return f"{REPOSITORY}:{hashlib.sha256(recipe().encode()).hexdigest()[:16]}"


def image_exists(name: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", name], capture_output=True)
    return done.returncode == 0


def cannot_build() -> str | None:
    """Why this host cannot build the image, or None."""
    if os.geteuid() != 0:
        return "debootstrap needs root"
    if shutil.which("docker") is None:
        return "no docker CLI"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine answers"
    if shutil.which("debootstrap") is None:
        return "debootstrap is not installed (.ci/run installs it)"
    return None


def ensure_image(log: Path | None = None) -> str:
    """The image's name, building it first when it does not exist yet. Raises RuntimeError with
    the tail of debootstrap's output when the build fails."""
    name = image_name()
    if image_exists(name):
        return name
    root = Path(tempfile.mkdtemp(prefix="flashnode-debootstrap-"))
    out = log or root.with_suffix(".log")
    try:
        with out.open("wb") as fh:
            done = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=" + ",".join(INCLUDE),
                    SUITE,
                    str(root),
                    MIRROR,
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=900,
            )
        if done.returncode != 0:
            tail = out.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError("debootstrap failed:\n" + "\n".join(tail))
        # The apt caches are of no use in the image.
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / cache).glob("*.deb"):
                entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        imported = subprocess.run(
            ["docker", "import", "-", name], stdin=tar.stdout, capture_output=True, timeout=600
        )
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr.decode(errors='replace')}")
        return name
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if log is None:
            with contextlib.suppress(OSError):
                out.unlink()


if __name__ == "__main__":
    why = cannot_build()
    if why:
        sys.exit(f"cannot build: {why}")
    print(ensure_image(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
